------------------------------ MODULE Handoff ------------------------------
(***************************************************************************)
(* Prefill -> decode hand-off of one request's KV (design atlas D7).       *)
(*                                                                         *)
(* A prefill worker computes a request's KV and hands it to a decode       *)
(* worker.  This is not the shared cache: the hand-off's objects live in   *)
(* their own key space (one per request), are meant to be read once, and  *)
(* have their own retention: they are reclaimed once the decode side has  *)
(* acknowledged its take-over (Ack), or once a short TTL passed (Expire) *)
(* whoever then reclaims them, and never under a take-over's read: the   *)
(* decode side reads them under a read lease (spec/Lease.tla), and a      *)
(* remove is refused while a lease is held.                                *)
(*                                                                         *)
(* Publish(r, p) stands for the prefill writing every part of the hand-off *)
(* and then its ticket (the hand-off exists for readers only once all its *)
(* parts do); p is the request's own choice to also publish the KV into   *)
(* the long-term cache, as separate objects of the cache's key space with *)
(* the cache's retention.  The decode side makes at most MaxAttempts       *)
(* take-over attempts (Attempt: a miss when the hand-off is not there,     *)
(* else a read, which fails (ReadFails: a node lost, a corrupt part, a    *)
(* timeout) or completes (ReadDone)), then falls back to recomputing the  *)
(* request (Recompute) if the budget of recomputes it shares with every   *)
(* other request of its process allows, and refuses the request otherwise *)
(* (Refuse: the router may send it elsewhere).  A storage node may lose   *)
(* the hand-off at any time (Lose).                                       *)
(*                                                                         *)
(* The budget is a count here; the runtime's is a token bucket (the same  *)
(* bound over any interval, refilled over time).                          *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    Requests,     \* requests handed from prefill to decode
    MaxAttempts,  \* take-over attempts per request before falling back
    Budget        \* recomputes the decode process may start

ASSUME MaxAttempts \in Nat /\ Budget \in Nat

VARIABLES
    obj,       \* the hand-off's objects: "none" | "stored" | "reclaimed" | "lost"
    cache,     \* the long-term copy: "none" | "published" | "dropped"
    dec,       \* the decode side: "idle" | "reading" | "taken" | "acked" | "recomputed" | "failed"
    attempts,  \* take-over attempts made
    expired,   \* requests whose hand-off TTL has passed
    budget     \* recomputes left

vars == <<obj, cache, dec, attempts, expired, budget>>

Ended == {"acked", "recomputed", "failed"}

(***************************************************************************)
(* Guards and updates that the weakened models (Handoff_Weak_...) replace. *)
(***************************************************************************)
\* Retention: the hand-off may be reclaimed once the decode side acknowledged
\* its take-over, or once its TTL passed.
MayReclaim(r) == dec[r] = "acked" \/ r \in expired
WeakReclaimAnyTime(r) == TRUE

\* No reclaim while a take-over reads the hand-off (the read's lease).
NotRead(r) == dec[r] # "reading"
WeakIgnoreLease(r) == TRUE

\* Reclaiming the hand-off leaves the long-term copy alone (its own objects).
CacheAfterReclaim(r) == cache[r]
WeakHandoffIsCache(r) == IF cache[r] = "published" THEN "dropped" ELSE cache[r]

\* The decode side recomputes only while the shared budget allows.
MayRecompute == budget > 0
WeakIgnoreBudget == TRUE

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ obj = [r \in Requests |-> "none"]
    /\ cache = [r \in Requests |-> "none"]
    /\ dec = [r \in Requests |-> "idle"]
    /\ attempts = [r \in Requests |-> 0]
    /\ expired = {}
    /\ budget = Budget

(* The prefill stores the hand-off (every part, then the ticket) and, if   *)
(* the request asks for it, publishes the same KV into the long-term cache. *)
Publish(r, p) ==
    /\ obj[r] = "none"
    /\ obj' = [obj EXCEPT ![r] = "stored"]
    /\ cache' = [cache EXCEPT ![r] = IF p THEN "published" ELSE "none"]
    /\ UNCHANGED <<dec, attempts, expired, budget>>

(* A take-over attempt: a read of the hand-off if it is there, a miss else. *)
Attempt(r) ==
    /\ dec[r] = "idle"
    /\ attempts[r] < MaxAttempts
    /\ attempts' = [attempts EXCEPT ![r] = @ + 1]
    /\ dec' = [dec EXCEPT ![r] = IF obj[r] = "stored" THEN "reading" ELSE "idle"]
    /\ UNCHANGED <<obj, cache, expired, budget>>

(* The read fails: a part missing, lost or corrupt, or too slow. *)
ReadFails(r) ==
    /\ dec[r] = "reading"
    /\ dec' = [dec EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<obj, cache, attempts, expired, budget>>

(* The read completes: every part loaded and verified. *)
ReadDone(r) ==
    /\ dec[r] = "reading"
    /\ obj[r] = "stored"
    /\ dec' = [dec EXCEPT ![r] = "taken"]
    /\ UNCHANGED <<obj, cache, attempts, expired, budget>>

(* The decode side acknowledges its take-over. *)
Ack(r) ==
    /\ dec[r] = "taken"
    /\ dec' = [dec EXCEPT ![r] = "acked"]
    /\ UNCHANGED <<obj, cache, attempts, expired, budget>>

(* The hand-off's TTL passes. *)
Expire(r) ==
    /\ obj[r] = "stored"
    /\ r \notin expired
    /\ expired' = expired \cup {r}
    /\ UNCHANGED <<obj, cache, dec, attempts, budget>>

(* The hand-off's objects are removed (by the decode side after its ack,  *)
(* or by a sweep after the TTL).                                           *)
Reclaim(r) ==
    /\ obj[r] = "stored"
    /\ MayReclaim(r)
    /\ NotRead(r)
    /\ obj' = [obj EXCEPT ![r] = "reclaimed"]
    /\ cache' = [cache EXCEPT ![r] = CacheAfterReclaim(r)]
    /\ UNCHANGED <<dec, attempts, expired, budget>>

(* A storage node holding the hand-off is lost. *)
Lose(r) ==
    /\ obj[r] = "stored"
    /\ obj' = [obj EXCEPT ![r] = "lost"]
    /\ UNCHANGED <<cache, dec, attempts, expired, budget>>

(* Every attempt failed: recompute, taking one from the shared budget. *)
Recompute(r) ==
    /\ dec[r] = "idle"
    /\ attempts[r] = MaxAttempts
    /\ MayRecompute
    /\ dec' = [dec EXCEPT ![r] = "recomputed"]
    /\ budget' = budget - 1
    /\ UNCHANGED <<obj, cache, attempts, expired>>

(* Every attempt failed and the budget is spent: the request is refused. *)
Refuse(r) ==
    /\ dec[r] = "idle"
    /\ attempts[r] = MaxAttempts
    /\ budget = 0
    /\ dec' = [dec EXCEPT ![r] = "failed"]
    /\ UNCHANGED <<obj, cache, attempts, expired, budget>>

Next ==
    \/ \E r \in Requests, p \in BOOLEAN : Publish(r, p)
    \/ \E r \in Requests : Attempt(r) \/ ReadFails(r) \/ ReadDone(r) \/ Ack(r)
    \/ \E r \in Requests : Expire(r) \/ Reclaim(r) \/ Lose(r)
    \/ \E r \in Requests : Recompute(r) \/ Refuse(r)

\* Someone reclaims what may be reclaimed: the acknowledged take-over
\* itself, and a sweep of expired hand-offs.
SweepFairness(r) == WF_vars(Reclaim(r))
WeakNoSweep(r) == TRUE

(* Time passes, reads end, and the decode side and the sweeps act. The     *)
(* prefill need not ever publish.                                          *)
Fairness ==
    \A r \in Requests :
        /\ WF_vars(Attempt(r))
        /\ WF_vars(ReadFails(r) \/ ReadDone(r))
        /\ WF_vars(Ack(r))
        /\ WF_vars(Expire(r))
        /\ SweepFairness(r)
        /\ WF_vars(Recompute(r) \/ Refuse(r))

Spec == Init /\ [][Next]_vars /\ Fairness

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ obj \in [Requests -> {"none", "stored", "reclaimed", "lost"}]
    /\ cache \in [Requests -> {"none", "published", "dropped"}]
    /\ dec \in [Requests -> {"idle", "reading", "taken", "acked", "recomputed", "failed"}]
    /\ attempts \in [Requests -> Nat]
    /\ expired \subseteq Requests
    /\ budget \in Int

(* A hand-off is reclaimed only after the decode side acknowledged its     *)
(* take-over, or after its TTL.                                             *)
NoReclaimBeforeAckOrExpiry ==
    \A r \in Requests : obj[r] = "reclaimed" => dec[r] = "acked" \/ r \in expired

(* Nothing is reclaimed from under a take-over's read. *)
NoReclaimUnderRead ==
    \A r \in Requests : dec[r] = "reading" => obj[r] # "reclaimed"

(* A take-over uses a hand-off the prefill published. *)
TakeOverOfPublished ==
    \A r \in Requests : dec[r] \in {"taken", "acked"} => obj[r] # "none"

(* At most MaxAttempts take-over attempts per request. *)
RetriesBounded == \A r \in Requests : attempts[r] <= MaxAttempts

(* The decode side recomputes only after its attempts are spent. *)
RecomputeOnlyAfterRetries ==
    \A r \in Requests : dec[r] = "recomputed" => attempts[r] = MaxAttempts

(* Recomputes never exceed the budget, and every one is accounted. *)
RecomputeWithinBudget ==
    /\ budget >= 0
    /\ Cardinality({r \in Requests : dec[r] = "recomputed"}) + budget = Budget

(* The long-term copy outlives the hand-off's retention. *)
CacheOutlivesHandoff == \A r \in Requests : cache[r] # "dropped"

(***************************************************************************)
(* Liveness                                                                *)
(***************************************************************************)
(* No hand-off is kept forever: each is eventually reclaimed (or lost). *)
HandoffsReclaimed == <>[](\A r \in Requests : obj[r] # "stored")

(* Every request ends: taken over, recomputed, or refused. *)
RequestsEnd == <>(\A r \in Requests : dec[r] \in Ended)

=============================================================================

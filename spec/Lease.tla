------------------------------- MODULE Lease -------------------------------
(***************************************************************************)
(* Read leases: time-bounded protection of one object's bytes for one      *)
(* reader. Ending the protection is not deleting; bytes whose transfer     *)
(* completed after the lease may have expired (queueing, transfer and      *)
(* clock error counted) are rejected, since their space may already be     *)
(* reclaimed.                                                              *)
(*                                                                         *)
(* The master's clock is `now`, advanced by Tick up to MaxTime.  Objects   *)
(* are cached in storage slots (Put stands for the whole publish protocol *)
(* of spec/Publish.tla).  A reader sends a read request (Request) and, on  *)
(* its own clock, starts its deadline *before* sending.  The master may    *)
(* answer it ticks later (queueing): Grant records a lease for the reader  *)
(* on the object's slot that expires at now + TTL on the master's clock,   *)
(* and replies with the slot.  The reply reaches the reader (Reply), which *)
(* then transfers the bytes for any number of ticks, may renew its lease   *)
(* (Renew: refused once the lease expired) and finally completes the       *)
(* transfer (Complete).  Only then does it judge the bytes: it accepts     *)
(* them only if its own clock says the transfer completed within its      *)
(* conservative deadline; otherwise it rejects them.  It then releases the *)
(* lease (Release).  The master expires leases on its clock (in Tick).     *)
(*                                                                         *)
(* While any lease on an object is unexpired, neither Remove nor Evict     *)
(* (under memory pressure) may reclaim its slot.  A reclaimed slot may be  *)
(* reused at once by a new object (Put): its bytes are rewritten.  A read  *)
(* whose slot was reclaimed after the grant and before the transfer        *)
(* completed carries a ghost flag `clob`: its bytes may be garbage.        *)
(*                                                                         *)
(* Clock error.  The reader measures elapsed time from the instant it sent *)
(* its request (or its last renewal).  MaxSkew bounds how far that          *)
(* measurement may be off from the master's over one read: the reader's   *)
(* clock reads base + (now - base) + d for some d in -MaxSkew..MaxSkew,    *)
(* chosen by the environment at completion.  (With wall clocks that agree *)
(* within e at every instant, the bound on a measured interval is 2e.)     *)
(*                                                                         *)
(* Takeover.  The master may be replaced (spec/Failover.tla) at any time:  *)
(* the new master knows none of the leases the old one granted, and reads  *)
(* in flight go on.  Every object it finds counts as leased until one TTL *)
(* after the takeover (InheritLeases): the old master granted nothing      *)
(* after it lost its term, so no old lease outlives that.                  *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    Keys,      \* object keys
    Slots,     \* storage slots (regions); one object per slot
    Readers,   \* readers; each carries out one read at a time
    TTL,       \* lease duration, in ticks of the master's clock
    MaxSkew,   \* bound on the reader's clock error over one read
    MaxTime,   \* bound on the master's clock (keeps the model finite)
    MaxTakeovers, \* bound on takeovers by a new master (keeps the model finite)
    None       \* model value: no object, no slot, no lease, an idle reader

ASSUME TTL \in Nat /\ MaxSkew \in Nat /\ MaxTime \in Nat /\ MaxTakeovers \in Nat

VARIABLES
    now,      \* master: its clock
    dir,      \* master: key -> None | the slot holding the object
    lease,    \* master: reader -> None | [key, slot, exp]  (unexpired while now < exp)
    reader,   \* readers: reader -> None | the read it is carrying out
    dropped,  \* history: keys never put, or whose object a client removed (Remove) or
              \*   the store evicted (Evict) since it was last put
    inherited,   \* master: keys it found at its takeover, not reclaimed since
    quietUntil,  \* master: inherited keys count as leased while now < quietUntil
    takeovers    \* how many times a new master took over

vars == <<now, dir, lease, reader, dropped, inherited, quietUntil, takeovers>>

Times == 0..MaxTime
Skews == -MaxSkew..MaxSkew
Phases == {"asked", "granted", "transferring", "accepted", "rejected"}
Read == [ph : Phases, key : Keys, slot : Slots \cup {None}, base : Times, clob : BOOLEAN]
LeaseRec == [key : Keys, slot : Slots, exp : 0..(MaxTime + TTL)]

Present(k)   == dir[k] # None
FreeSlots    == {s \in Slots : \A k \in Keys : dir[k] # s}
Reading(r)   == reader[r] # None /\ reader[r].ph \in {"granted", "transferring"}
Unexpired(r) == lease[r] # None /\ now < lease[r].exp

(* Some reader holds a lease on k that the master's clock has not expired, *)
(* or k may still be leased by a master this one took over from.           *)
Leased(k) == \/ \E r \in Readers : Unexpired(r) /\ lease[r].key = k
             \/ k \in inherited /\ now < quietUntil

(* Memory pressure: every slot is in use (the eviction policy's watermark). *)
Pressure == FreeSlots = {}

(***************************************************************************)
(* Guards and updates that the weakened models (Lease_Weak_*.cfg) replace. *)
(***************************************************************************)
\* The reader accepts the bytes only if the elapsed time its own clock
\* measured is below TTL less the clock bound.
ReaderAccepts(elapsed) == elapsed < TTL - MaxSkew
WeakIgnoreSkew(elapsed) == elapsed < TTL

\* The reader's deadline runs from before it sent the request (base stays).
BaseOnReply(r) == reader[r].base
WeakBaseOnReply(r) == now

\* Eviction skips objects under an unexpired lease.
MayEvict(k) == ~Leased(k)
WeakEvictIgnoresLeases(k) == TRUE

\* A new master treats every object it finds as leased for one TTL.
InheritLeases == {k \in Keys : Present(k)}
WeakInheritNone == {}

\* Ending protection is not deleting: Release leaves the directory alone.
DirAfterRelease(r) == dir
WeakReleaseDeletes(r) ==
    IF lease[r] # None THEN [dir EXCEPT ![lease[r].key] = None] ELSE dir

(***************************************************************************)
(* Reclaiming k's slot: every read of that slot in progress is clobbered.  *)
(* Which request reclaimed it is recorded by the action (dropped).         *)
(***************************************************************************)
Reclaim(k) ==
    LET s == dir[k] IN
    /\ dir' = [dir EXCEPT ![k] = None]
    /\ reader' = [r \in Readers |->
                    IF Reading(r) /\ reader[r].slot = s
                    THEN [reader[r] EXCEPT !.clob = TRUE] ELSE reader[r]]
    /\ inherited' = inherited \ {k}

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ now = 0
    /\ dir = [k \in Keys |-> None]
    /\ lease = [r \in Readers |-> None]
    /\ reader = [r \in Readers |-> None]
    /\ dropped = Keys
    /\ inherited = {}
    /\ quietUntil = 0
    /\ takeovers = 0

(* The master's clock reads t; leases whose expiry it reached end. *)
Tick(t) ==
    /\ t \in Times
    /\ t > now
    /\ now' = t
    /\ lease' = [r \in Readers |->
                   IF lease[r] # None /\ lease[r].exp <= t THEN None ELSE lease[r]]
    /\ UNCHANGED <<dir, reader, dropped, inherited, quietUntil, takeovers>>

(* A new object is cached in a free slot (its bytes are written there). *)
Put(k, s) ==
    /\ ~Present(k)
    /\ s \in FreeSlots
    /\ dir' = [dir EXCEPT ![k] = s]
    /\ dropped' = dropped \ {k}
    /\ UNCHANGED <<now, lease, reader, inherited, quietUntil, takeovers>>

(* An idle reader sends a read request; its deadline starts now. *)
Request(r, k) ==
    /\ reader[r] = None
    /\ reader' = [reader EXCEPT ![r] = [ph |-> "asked", key |-> k, slot |-> None,
                                        base |-> now, clob |-> FALSE]]
    /\ UNCHANGED <<now, dir, lease, dropped, inherited, quietUntil, takeovers>>

(* The master handles the request (perhaps ticks later): a lease on a      *)
(* cached object, or a miss that ends the read.                            *)
Grant(r) ==
    /\ reader[r] # None
    /\ reader[r].ph = "asked"
    /\ LET k == reader[r].key IN
         IF Present(k)
         THEN /\ lease' = [lease EXCEPT ![r] = [key |-> k, slot |-> dir[k], exp |-> now + TTL]]
              /\ reader' = [reader EXCEPT ![r] = [@ EXCEPT !.ph = "granted", !.slot = dir[k]]]
         ELSE /\ reader' = [reader EXCEPT ![r] = None]       \* refused: KeyNotFound
              /\ UNCHANGED lease
    /\ UNCHANGED <<now, dir, dropped, inherited, quietUntil, takeovers>>

(* The grant reaches the reader, which starts the transfer. *)
Reply(r) ==
    /\ reader[r] # None
    /\ reader[r].ph = "granted"
    /\ reader' = [reader EXCEPT ![r] = [@ EXCEPT !.ph = "transferring",
                                                 !.base = BaseOnReply(r)]]
    /\ UNCHANGED <<now, dir, lease, dropped, inherited, quietUntil, takeovers>>

(* The reader renews its lease; its deadline restarts from the renewal.    *)
(* The master refuses (LeaseExpired) once the lease expired: not enabled.  *)
Renew(r) ==
    /\ reader[r] # None
    /\ reader[r].ph = "transferring"
    /\ Unexpired(r)
    /\ lease' = [lease EXCEPT ![r].exp = now + TTL]
    /\ reader' = [reader EXCEPT ![r].base = now]
    /\ UNCHANGED <<now, dir, dropped, inherited, quietUntil, takeovers>>

(* The transfer completes; the reader's clock is off by d.  It accepts the *)
(* bytes only if its measured elapsed time passes ReaderAccepts.           *)
Complete(r, d) ==
    /\ reader[r] # None
    /\ reader[r].ph = "transferring"
    /\ reader' = [reader EXCEPT ![r].ph =
                    IF ReaderAccepts(now - reader[r].base + d) THEN "accepted" ELSE "rejected"]
    /\ UNCHANGED <<now, dir, lease, dropped, inherited, quietUntil, takeovers>>

(* The reader is done with the bytes (kept or rejected) and releases the   *)
(* lease (a no-op at the master if it already expired).                    *)
Release(r) ==
    /\ reader[r] # None
    /\ reader[r].ph \in {"accepted", "rejected"}
    /\ dir' = DirAfterRelease(r)
    /\ lease' = [lease EXCEPT ![r] = None]
    /\ reader' = [reader EXCEPT ![r] = None]
    /\ UNCHANGED <<now, dropped, inherited, quietUntil, takeovers>>

(* A client deletes the object; refused (ObjectLeased) under a lease. *)
Remove(k) ==
    /\ Present(k)
    /\ ~Leased(k)
    /\ Reclaim(k)
    /\ dropped' = dropped \cup {k}
    /\ UNCHANGED <<now, lease, quietUntil, takeovers>>

(* Under memory pressure the store evicts an object; the policy (LRU among *)
(* unleased objects in the code) is one refinement of this choice.         *)
Evict(k) ==
    /\ Present(k)
    /\ Pressure
    /\ MayEvict(k)
    /\ Reclaim(k)
    /\ dropped' = dropped \cup {k}
    /\ UNCHANGED <<now, lease, quietUntil, takeovers>>

(* A new master takes over: the old lease table is gone; every object it  *)
(* finds counts as leased until now + TTL.                               *)
Takeover ==
    /\ takeovers < MaxTakeovers
    /\ takeovers' = takeovers + 1
    /\ lease' = [r \in Readers |-> None]
    /\ inherited' = InheritLeases
    /\ quietUntil' = now + TTL
    /\ UNCHANGED <<now, dir, reader, dropped>>

Next ==
    \/ Tick(now + 1)
    \/ Takeover
    \/ \E k \in Keys, s \in Slots : Put(k, s)
    \/ \E r \in Readers, k \in Keys : Request(r, k)
    \/ \E r \in Readers : Grant(r) \/ Reply(r) \/ Renew(r) \/ Release(r)
    \/ \E r \in Readers, d \in Skews : Complete(r, d)
    \/ \E k \in Keys : Remove(k) \/ Evict(k)

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ now \in Times
    /\ dir \in [Keys -> {None} \cup Slots]
    /\ \A k1, k2 \in Keys : k1 # k2 /\ Present(k1) => dir[k1] # dir[k2]
    /\ lease \in [Readers -> {None} \cup LeaseRec]
    /\ reader \in [Readers -> {None} \cup Read]
    /\ dropped \subseteq Keys
    /\ inherited \subseteq Keys
    /\ quietUntil \in 0..(MaxTime + TTL)
    /\ takeovers \in 0..MaxTakeovers

(* While a lease is unexpired by the master's clock, its object is still   *)
(* cached in the slot the lease protects, and no other object is there.    *)
NoReclaimUnderLease ==
    \A r \in Readers : Unexpired(r) =>
        /\ dir[lease[r].key] = lease[r].slot
        /\ \A k \in Keys : dir[k] = lease[r].slot => k = lease[r].key

(* A reader never accepts bytes from a slot that was reclaimed (and so     *)
(* perhaps reused and rewritten) between its grant and its completion.    *)
NoConsumeOfReclaimedBytes ==
    \A r \in Readers : reader[r] # None /\ reader[r].ph = "accepted" => ~reader[r].clob

(* Ending protection (release, expiry or takeover) is not deletion: a key *)
(* has no object exactly when it was never put, or a client's Remove or   *)
(* the store's Evict took it since it was last put.  The history is kept *)
(* by those two requests, not by the reclaim they share, so any other    *)
(* step that reclaims an object breaks it.                               *)
ReleaseIsNotDelete == \A k \in Keys : ~Present(k) <=> k \in dropped

(* The master holds a lease only for a read that was granted it. *)
LeasesHeldByReads ==
    \A r \in Readers : lease[r] # None =>
        /\ reader[r] # None
        /\ reader[r].ph # "asked"
        /\ reader[r].key = lease[r].key
        /\ reader[r].slot = lease[r].slot

=============================================================================

---------------------------- MODULE DirectWrite ----------------------------
(***************************************************************************)
(* Direct writers of the kvproto store.                                    *)
(*                                                                         *)
(* A direct writer writes the region it was granted itself: a client's CPU *)
(* memcpy into a storage segment on its own host, or a GPU DMA into a      *)
(* registered segment.  The storage node neither performs nor can refuse  *)
(* that write, so revoking the attempt cannot stop its bytes: a writer     *)
(* that was paused past its revoke (or its timeout) still writes when it  *)
(* wakes up.  The rule: a region granted to a direct writer is not granted *)
(* to anyone else, and not counted as free, until that writer reported its *)
(* write finished or is known dead (DrainWaitsForTheWriter); and a direct *)
(* write is published only after its writer reported it finished.  A      *)
(* writer writes its slot once and reports it in the same step (the       *)
(* runtime's writer sets the region's generation word right after its      *)
(* memcpy; a DMA's writer after the copy's completion event).             *)
(*                                                                         *)
(* One segment of Slots regions; each object takes one slot (replicas are  *)
(* spec/Publish.tla's business: each replica of a direct attempt is a slot *)
(* of its own under this rule).  `bytes` is a ghost: the token of the      *)
(* writer whose bytes a slot holds.                                        *)
(***************************************************************************)
EXTENDS Naturals

CONSTANTS
    Keys,      \* object keys
    Writers,   \* direct writer processes
    Slots,     \* regions of the segment
    MaxToken,  \* bound on put attempts (keeps the model finite)
    None       \* model value: no object, no region, an idle writer

Tokens == 1..MaxToken
States == {"granted", "published", "draining"}

VARIABLES
    dir,        \* master: key -> None | [token, slot, pub]
    region,     \* master and node: slot -> None | [token, state]
    nextToken,  \* master: the next attempt token
    writer,     \* writers: writer -> None | [key, token, slot, wrote]
    bytes       \* ghost: slot -> the token whose writer's bytes are there (0: none)

vars == <<dir, region, nextToken, writer, bytes>>

(* Some live writer of token t has not written yet: it may at any time. *)
Holds(t) == \E w \in Writers : writer[w] # None /\ writer[w].token = t /\ ~writer[w].wrote

(***************************************************************************)
(* Guards that the weakened models replace (DirectWrite_Weak_*.cfg).       *)
(***************************************************************************)
\* A freed region whose writer may still write drains first.
FreedState(t) == IF Holds(t) THEN "draining" ELSE None
\* The writer's PutEnd comes only after it reported its write finished.
MayPublish(w) == writer[w].wrote

WeakFreeAtOnce(t) == None
WeakPublishUnwritten(w) == TRUE

(* The region of slot i once the object holding token t is freed. *)
Freed(i, t) == LET s == FreedState(t) IN IF s = None THEN None ELSE [token |-> t, state |-> s]

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ dir = [k \in Keys |-> None]
    /\ region = [i \in Slots |-> None]
    /\ nextToken = 1
    /\ writer = [w \in Writers |-> None]
    /\ bytes = [i \in Slots |-> 0]

(* The master grants a free slot to an idle direct writer.  The master's   *)
(* decision and the node's taking the region are one step here; the        *)
(* runtime keeps them one for the writer, which writes only once the node  *)
(* shows the assign in the region's generation word.  A writer that wrote  *)
(* before could write a region a failed-over master's node never took,     *)
(* which the next master grants again.                                     *)
Grant(w, k, i) ==
    /\ writer[w] = None
    /\ dir[k] = None
    /\ region[i] = None
    /\ nextToken \in Tokens
    /\ dir' = [dir EXCEPT ![k] = [token |-> nextToken, slot |-> i, pub |-> FALSE]]
    /\ region' = [region EXCEPT ![i] = [token |-> nextToken, state |-> "granted"]]
    /\ writer' = [writer EXCEPT ![w] = [key |-> k, token |-> nextToken, slot |-> i, wrote |-> FALSE]]
    /\ nextToken' = nextToken + 1
    /\ UNCHANGED bytes

(* The writer's memcpy or DMA lands in its slot and the writer reports it *)
(* finished.  Nobody checks it: it lands whether or not the attempt still  *)
(* holds the slot.                                                         *)
Write(w) ==
    /\ writer[w] # None
    /\ ~writer[w].wrote
    /\ bytes' = [bytes EXCEPT ![writer[w].slot] = writer[w].token]
    /\ writer' = [writer EXCEPT ![w].wrote = TRUE]
    /\ UNCHANGED <<dir, region, nextToken>>

(* The writer reports its write finished and asks to publish; the master  *)
(* publishes only if the attempt still owns the key.  The writer is done   *)
(* either way: it writes nothing more.                                     *)
PutEnd(w) ==
    /\ writer[w] # None
    /\ MayPublish(w)
    /\ LET k == writer[w].key
           t == writer[w].token IN
         IF dir[k] # None /\ dir[k].token = t /\ ~dir[k].pub
         THEN /\ dir' = [dir EXCEPT ![k].pub = TRUE]
              /\ region' = [region EXCEPT ![dir[k].slot].state = "published"]
         ELSE UNCHANGED <<dir, region>>                    \* refused: StaleToken
    /\ writer' = [writer EXCEPT ![w] = None]
    /\ UNCHANGED <<nextToken, bytes>>

(* The writer process dies: the OS tells the storage node (its lock goes). *)
WriterDies(w) ==
    /\ writer[w] # None
    /\ writer' = [writer EXCEPT ![w] = None]
    /\ UNCHANGED <<dir, region, nextToken, bytes>>

(* The master revokes a pending attempt (the writer gave up, or its        *)
(* timeout fired: a timeout cannot tell a paused writer from a dead one).  *)
Revoke(k) ==
    /\ dir[k] # None
    /\ ~dir[k].pub
    /\ LET i == dir[k].slot IN
         region' = [region EXCEPT ![i] = Freed(i, dir[k].token)]
    /\ dir' = [dir EXCEPT ![k] = None]
    /\ UNCHANGED <<nextToken, writer, bytes>>

(* A published object is removed; its writer finished long ago. *)
Remove(k) ==
    /\ dir[k] # None
    /\ dir[k].pub
    /\ region' = [region EXCEPT ![dir[k].slot] = None]
    /\ dir' = [dir EXCEPT ![k] = None]
    /\ UNCHANGED <<nextToken, writer, bytes>>

(* A draining slot whose writer reported or died is free again. *)
Drain(i) ==
    /\ region[i] # None
    /\ region[i].state = "draining"
    /\ ~Holds(region[i].token)
    /\ region' = [region EXCEPT ![i] = None]
    /\ UNCHANGED <<dir, nextToken, writer, bytes>>

Next ==
    \/ \E w \in Writers, k \in Keys, i \in Slots : Grant(w, k, i)
    \/ \E w \in Writers : Write(w) \/ PutEnd(w) \/ WriterDies(w)
    \/ \E k \in Keys : Revoke(k) \/ Remove(k)
    \/ \E i \in Slots : Drain(i)

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ dir \in [Keys -> {None} \cup [token : Tokens, slot : Slots, pub : BOOLEAN]]
    /\ region \in [Slots -> {None} \cup [token : Tokens, state : States]]
    /\ nextToken \in 1..(MaxToken + 1)
    /\ writer \in [Writers -> {None} \cup [key : Keys, token : Tokens, slot : Slots, wrote : BOOLEAN]]
    /\ bytes \in [Slots -> 0..MaxToken]

(* A published object's slot holds exactly the bytes its attempt wrote. *)
PublishedBytesAreTheAttempts ==
    \A k \in Keys : dir[k] # None /\ dir[k].pub => bytes[dir[k].slot] = dir[k].token

(* A slot some live writer may still write is neither free nor granted to *)
(* another attempt: it is that writer's, or draining for it.               *)
DrainWaitsForTheWriter ==
    \A w \in Writers : writer[w] # None /\ ~writer[w].wrote =>
        /\ region[writer[w].slot] # None
        /\ region[writer[w].slot].token = writer[w].token

(* The directory and the regions agree: a listed object holds its slot. *)
DirectoryHoldsItsRegion ==
    \A k \in Keys : dir[k] # None =>
        /\ region[dir[k].slot] # None
        /\ region[dir[k].slot].token = dir[k].token
        /\ region[dir[k].slot].state = IF dir[k].pub THEN "published" ELSE "granted"

=============================================================================

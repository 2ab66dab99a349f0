------------------------------ MODULE Repair ------------------------------
(***************************************************************************)
(* Replica repair in the kvproto store.                                    *)
(*                                                                         *)
(* Every object was published with a requested number of replicas, each  *)
(* on its own segment.  A lost segment takes its replicas with it; the    *)
(* master then re-replicates every object left below its requested count *)
(* from a replica that is still listed.  A repair picks a listed source   *)
(* replica, allocates a region for the object on a live segment that has  *)
(* none of it, copies the object into it (one chunk a step), and only     *)
(* once the copy is complete lists the new replica: a region being        *)
(* repaired is never handed to a reader.  This is the publish rule of     *)
(* spec/Publish.tla applied to a repaired replica.                        *)
(*                                                                         *)
(* A repair whose source or destination segment is lost is cancelled (its *)
(* destination region freed), and so is every repair of a removed object. *)
(* At most MaxRepairs copies are in flight at once, so that repair        *)
(* traffic leaves the segments' bandwidth to foreground reads.            *)
(*                                                                         *)
(* Objects are not created here (spec/Publish.tla does that): each starts *)
(* published with its requested count of complete replicas.  `bytes` is  *)
(* a ghost: how many leading chunks of the object's bytes a segment's     *)
(* region holds.  A chunk copied from a source that does not hold it      *)
(* (a lost segment, an unfinished region) lands as a hole, and the        *)
(* region never becomes complete.                                         *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Keys,         \* object keys
    Segments,     \* storage segments
    MaxReplicas,  \* the most replicas an object may request
    Chunks,       \* chunks an object is copied in
    MaxRepairs    \* repair copies in flight at once (the rate limit)

ASSUME MaxReplicas \in 1..Cardinality(Segments)
ASSUME Chunks \in Nat \ {0} /\ MaxRepairs \in Nat \ {0}

VARIABLES
    requested,  \* master: key -> the replica count its put requested
    live,       \* master: segments still alive
    listed,     \* master: key -> segments whose replica readers may be handed
    repairs,    \* master and copiers: repairs in flight [key, src, dst, copied]
    region,     \* storage nodes: segment -> keys it holds a region for
    bytes,      \* ghost: segment -> key -> leading chunks of the object there
    reading     \* readers: key -> segments whose replica a reader is reading

vars == <<requested, live, listed, repairs, region, bytes, reading>>

Repair == [key : Keys, src : Segments, dst : Segments, copied : 0..Chunks]

InFlight(k) == {r \in repairs : r.key = k}

(* The object has fewer replicas, listed or being repaired, than it asked for. *)
Below(k) == Cardinality(listed[k]) + Cardinality(InFlight(k)) < requested[k]

(***************************************************************************)
(* Guards that the weakened models replace (Repair_Weak_*.cfg).            *)
(***************************************************************************)
\* A repair's new replica is listed once its copy is complete, not before.
ListedOnAllocation(k, dst) == listed[k]
\* A repair reading from a lost segment is cancelled with it.
KeepsRepair(r, s) == r.src # s
\* Readers are handed listed replicas only.
MayRead(k) == listed[k]

WeakListBeforeCopy(k, dst) == listed[k] \cup {dst}
WeakKeepsSourceOnLostSegment(r, s) == TRUE
WeakReadAnyRegion(k) == {s \in live : k \in region[s]}

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ requested \in [Keys -> 1..MaxReplicas]
    /\ listed \in [Keys -> SUBSET Segments]
    /\ \A k \in Keys : Cardinality(listed[k]) = requested[k]
    /\ live = Segments
    /\ repairs = {}
    /\ region = [s \in Segments |-> {k \in Keys : s \in listed[k]}]
    /\ bytes = [s \in Segments |-> [k \in Keys |-> IF s \in listed[k] THEN Chunks ELSE 0]]
    /\ reading = [k \in Keys |-> {}]

(* The master starts repairing an object below its requested count: from  *)
(* a listed replica, into a new region on a live segment that holds none  *)
(* of the object, while fewer than MaxRepairs copies are in flight.        *)
RepairStart(k, src, dst) ==
    /\ Below(k)
    /\ Cardinality(repairs) < MaxRepairs
    /\ src \in listed[k]
    /\ dst \in live
    /\ k \notin region[dst]
    /\ repairs' = repairs \cup {[key |-> k, src |-> src, dst |-> dst, copied |-> 0]}
    /\ region' = [region EXCEPT ![dst] = @ \cup {k}]
    /\ listed' = [listed EXCEPT ![k] = ListedOnAllocation(k, dst)]
    /\ UNCHANGED <<requested, live, bytes, reading>>

(* The copier copies the next chunk from the source into the new region.  *)
(* The chunk lands only if the source holds it.                           *)
CopyChunk(k, dst) ==
    \E r \in InFlight(k) :
        /\ r.dst = dst
        /\ r.copied < Chunks
        /\ bytes' = [bytes EXCEPT ![dst][k] =
                       IF @ = r.copied /\ bytes[r.src][k] > r.copied THEN @ + 1 ELSE @]
        /\ repairs' = (repairs \ {r}) \cup {[r EXCEPT !.copied = @ + 1]}
        /\ UNCHANGED <<requested, live, listed, region, reading>>

(* The copy is complete: the master lists the new replica. *)
ListReplica(k, dst) ==
    \E r \in InFlight(k) :
        /\ r.dst = dst
        /\ r.copied = Chunks
        /\ listed' = [listed EXCEPT ![k] = @ \cup {dst}]
        /\ repairs' = repairs \ {r}
        /\ UNCHANGED <<requested, live, region, bytes, reading>>

(* A segment dies with its bytes.  Its replicas are unlisted (their readers *)
(* fail), and the repairs reading from it or writing into it are cancelled, *)
(* their destination regions freed.                                       *)
SegmentLost(s) ==
    /\ s \in live
    /\ LET cancelled == {r \in repairs : r.dst = s \/ ~KeepsRepair(r, s)}
           freed(s2, k) == \E r \in cancelled : r.dst = s2 /\ r.key = k
       IN /\ live' = live \ {s}
          /\ listed' = [k \in Keys |-> listed[k] \ {s}]
          /\ repairs' = repairs \ cancelled
          /\ region' = [s2 \in Segments |->
                          IF s2 = s THEN {} ELSE {k \in region[s2] : ~freed(s2, k)}]
          /\ bytes' = [s2 \in Segments |-> [k \in Keys |->
                          IF s2 = s \/ freed(s2, k) THEN 0 ELSE bytes[s2][k]]]
          /\ reading' = [k \in Keys |-> reading[k] \ {s}]
    /\ UNCHANGED requested

(* The master hands a reader one replica of the object. *)
ReadBegin(k, s) ==
    /\ s \in MayRead(k)
    /\ s \notin reading[k]
    /\ reading' = [reading EXCEPT ![k] = @ \cup {s}]
    /\ UNCHANGED <<requested, live, listed, repairs, region, bytes>>

ReadEnd(k, s) ==
    /\ s \in reading[k]
    /\ reading' = [reading EXCEPT ![k] = @ \ {s}]
    /\ UNCHANGED <<requested, live, listed, repairs, region, bytes>>

(* An unread object is removed: its replicas and its repairs' regions go. *)
Remove(k) ==
    /\ listed[k] # {}
    /\ reading[k] = {}
    /\ listed' = [listed EXCEPT ![k] = {}]
    /\ repairs' = repairs \ InFlight(k)
    /\ region' = [s \in Segments |-> region[s] \ {k}]
    /\ bytes' = [s \in Segments |-> [bytes[s] EXCEPT ![k] = 0]]
    /\ UNCHANGED <<requested, live, reading>>

Next ==
    \/ \E k \in Keys, src, dst \in Segments : RepairStart(k, src, dst)
    \/ \E k \in Keys, dst \in Segments : CopyChunk(k, dst) \/ ListReplica(k, dst)
    \/ \E s \in Segments : SegmentLost(s)
    \/ \E k \in Keys, s \in Segments : ReadBegin(k, s) \/ ReadEnd(k, s)
    \/ \E k \in Keys : Remove(k)

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ requested \in [Keys -> 1..MaxReplicas]
    /\ live \subseteq Segments
    /\ listed \in [Keys -> SUBSET Segments]
    /\ repairs \subseteq Repair
    /\ region \in [Segments -> SUBSET Keys]
    /\ bytes \in [Segments -> [Keys -> 0..Chunks]]
    /\ reading \in [Keys -> SUBSET Segments]

(* Every listed replica is on a live segment and holds the object's bytes, *)
(* all of them.                                                           *)
ListedReplicasAreComplete ==
    \A k \in Keys : \A s \in listed[k] : s \in live /\ bytes[s][k] = Chunks

(* Every replica a reader is reading is listed and complete: never a      *)
(* region still being repaired.                                           *)
ReadsOnlyListedReplicas ==
    \A k \in Keys : \A s \in reading[k] : s \in listed[k] /\ bytes[s][k] = Chunks

(* Every repair in flight copies from a listed replica on a live segment. *)
RepairNeverFromALostSegment ==
    \A r \in repairs : r.src \in live /\ r.src \in listed[r.key]

(* The rate limit: at most MaxRepairs copies in flight. *)
RepairsWithinRate == Cardinality(repairs) <= MaxRepairs

(* Repair never takes an object above the count it requested, and never   *)
(* puts two of its replicas on one segment.                               *)
NeverAboveRequested ==
    \A k \in Keys : Cardinality(listed[k]) + Cardinality(InFlight(k)) <= requested[k]

OneReplicaPerSegment ==
    \A r \in repairs :
        /\ r.dst \notin listed[r.key]
        /\ \A r2 \in repairs : r2.key = r.key /\ r2.dst = r.dst => r2 = r

(* The storage nodes hold a region exactly for each listed replica and    *)
(* each repair in flight, and nothing on a lost segment: no cancelled or  *)
(* removed repair leaks its region.  No bytes lie outside a region.       *)
RegionsAccounted ==
    \A s \in Segments :
        /\ region[s] = IF s \in live
                       THEN {k \in Keys : s \in listed[k]} \cup {r.key : r \in {r2 \in repairs : r2.dst = s}}
                       ELSE {}
        /\ \A k \in Keys : k \notin region[s] => bytes[s][k] = 0

=============================================================================

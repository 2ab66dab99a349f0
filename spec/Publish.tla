------------------------------ MODULE Publish ------------------------------
(***************************************************************************)
(* The publish protocol of the kvproto store. Space allocated is not an    *)
(* object complete, and every replica written is not an object published:  *)
(* readers see an object only once its writer's own attempt published it,  *)
(* and a writer that dies after allocating neither publishes a             *)
(* half-written object nor holds its space forever.                        *)
(*                                                                         *)
(* A writer asks the master for space (PutStart); the master allocates one *)
(* region on each of ReplicaCount live segments, tells the storage nodes   *)
(* which attempt owns each region, and hands the writer a per-attempt      *)
(* token.  The writer writes every replica (WriteReplica: the storage node *)
(* checks the token) and then asks the master to publish (PutEnd).  Only   *)
(* published objects are handed to readers.  A writer may give up         *)
(* (PutRevoke) or die (WriterCrash); the master's timeout for a silent     *)
(* writer (ReclaimAbandoned) frees its space, and a stale attempt's PutEnd *)
(* is refused.  Segments can be lost with their bytes (SegmentLost).       *)
(*                                                                         *)
(* Space is counted in slots: one object takes one slot on each replica   *)
(* segment.  Readers are counted per object: ReadBegin hands out replica   *)
(* descriptors and pins the object, ReadEnd unpins it, and Remove refuses  *)
(* a pinned object.                                                        *)
(*                                                                         *)
(* Three history variables record what the processes observed, so that    *)
(* the invariants judge outcomes, not guards: which attempt's bytes each  *)
(* slot holds (content), which attempt's writer was told its put was      *)
(* published (publishedToken), and which attempts' descriptors readers    *)
(* hold (handed).                                                         *)
(*                                                                         *)
(* Repair (spec/Repair.tla has its copy and rate rules): a published       *)
(* object records the replica count its put requested.  Below that count  *)
(* after a loss, the master allocates a region for a new replica on a     *)
(* live segment that holds none of it (RepairStart, under a fresh id from *)
(* the token counter), the copier fills it from a listed replica          *)
(* (CopyReplica), and only its report of a complete copy lists it         *)
(* (ListReplica).  A repair may be cancelled (RepairCancel: its copy      *)
(* failed or timed out); a lost segment or a removed object takes its     *)
(* repairs with it.  Repair regions count in the ledger like replicas.    *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Keys,            \* object keys
    Writers,         \* writer processes
    Segments,        \* storage segments
    SlotsPerSegment, \* capacity of each segment, in slots
    ReplicaCount,    \* replicas per object
    MaxToken,        \* bound on put attempts (keeps the model finite)
    MaxReads,        \* bound on concurrent readers of one object
    None             \* model value: no object, no region, an idle writer

ASSUME ReplicaCount \in 1..Cardinality(Segments)

VARIABLES
    dir,            \* master: key -> None | object record
    free,           \* master: segment -> free slots
    live,           \* master: segments still alive
    nextToken,      \* master: the next attempt token
    store,          \* storage nodes: segment -> slot -> None | region
    writer,         \* writers: writer -> None | attempt
    publishedToken, \* history: key -> the token of the attempt whose writer was told
                    \*   its PutEnd published the key (0: none since the key was free)
    content,        \* history: segment -> slot -> the token of the attempt whose bytes
                    \*   the slot holds (0: none written since the slot was freed)
    handed          \* history: key -> token -> readers holding descriptors handed out
                    \*   for that attempt's object

vars == <<dir, free, live, nextToken, store, writer, publishedToken, content, handed>>

Slots == 1..SlotsPerSegment
Tokens == 1..MaxToken

(* A placement maps each chosen replica segment to a slot on it. *)
Placements == UNION { [S -> Slots] : S \in {S \in SUBSET Segments : Cardinality(S) = ReplicaCount} }

(* A published object keeps fewer replicas after losing a segment. *)
SomeReplicas == UNION { [S -> Slots] : S \in SUBSET Segments }
(* Repairs in flight: destination segment -> its region and the repair's id. *)
RepairRegion == [slot : Slots, id : Tokens]
SomeRepairs == UNION { [S -> RepairRegion] : S \in SUBSET Segments }
NoRepairs == [s \in {} |-> [slot |-> 1, id |-> 1]]
Object == [status : {"pending", "published"}, token : Tokens,
           replicas : SomeReplicas, requested : 1..ReplicaCount,
           repairs : SomeRepairs, reads : 0..MaxReads]
Region == [key : Keys, token : Tokens, done : BOOLEAN]
Attempt == [key : Keys, token : Tokens, replicas : Placements, written : SUBSET Segments]

Exists(k)    == dir[k] # None
Pending(k)   == Exists(k) /\ dir[k].status = "pending"
Published(k) == Exists(k) /\ dir[k].status = "published"
Busy(w)      == writer[w] # None

(* The function f with s mapped to v / with s left out. *)
Extend(f, s, v) == [x \in DOMAIN f \cup {s} |-> IF x = s THEN v ELSE f[x]]
Without(f, s) == [x \in DOMAIN f \ {s} |-> f[x]]

(* The segments holding a region of k: its replicas and its repairs. *)
SegmentsOf(k) == DOMAIN dir[k].replicas \cup DOMAIN dir[k].repairs
(* The slots of k: <<segment, slot>> of each replica and each repair. *)
SlotsOf(k) == {<<s, dir[k].replicas[s]>> : s \in DOMAIN dir[k].replicas}
              \cup {<<s, dir[k].repairs[s].slot>> : s \in DOMAIN dir[k].repairs}

(* Slot i of segment s is allocated to some object in the directory. *)
Allocated(s, i) == \E k \in Keys : Exists(k) /\ <<s, i>> \in SlotsOf(k)
UsedSlots(s) == Cardinality({k \in Keys : Exists(k) /\ s \in SegmentsOf(k)})

(* The object has fewer replicas, listed or being repaired, than it asked for. *)
Below(k) == Cardinality(SegmentsOf(k)) < dir[k].requested

(* Free every region of the objects whose keys are in ks: the master's *)
(* ledger and the storage nodes' region tables change together, and a   *)
(* freed slot holds no attempt's bytes.                                  *)
FreeObjects(ks) ==
    LET freed(s, i) == \E k \in ks : <<s, i>> \in SlotsOf(k) IN
    /\ free' = [s \in Segments |->
                  free[s] + Cardinality({k \in ks : s \in SegmentsOf(k)})]
    /\ store' = [s \in Segments |-> [i \in Slots |->
                  IF freed(s, i) THEN None ELSE store[s][i]]]
    /\ content' = [s \in Segments |-> [i \in Slots |->
                  IF freed(s, i) THEN 0 ELSE content[s][i]]]

(***************************************************************************)
(* Guards that the weakened models replace (see the Publish_Weak_*.cfg).  *)
(***************************************************************************)
\* The writer sends PutEnd only after every replica write was acknowledged.
WriterMayPutEnd(w) == writer[w].written = DOMAIN writer[w].replicas
\* The master accepts PutEnd/PutRevoke only from the attempt holding the token.
TokenOwns(k, t) == Pending(k) /\ dir[k].token = t
\* The master hands descriptors only of published objects.
Readable(k) == Published(k)
\* The master may time out a silent writer.
MayReclaim(k) == TRUE
\* The storage node accepts a write only into a region the writer's token owns.
StorageOwns(w, s, i) == store[s][i].token = writer[w].token
\* The master lists a repaired replica only on its copier's report of a complete copy.
RepairCopied(k, s) == store[s][dir[k].repairs[s].slot].done

WeakPutEndEarly(w) == TRUE
WeakAnyAttemptOwns(k, t) == Pending(k)
WeakReadPending(k) == Exists(k)
WeakNeverReclaim(k) == FALSE
WeakStorageAcceptsAny(w, s, i) == TRUE
WeakListBeforeCopy(k, s) == TRUE

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ dir = [k \in Keys |-> None]
    /\ free = [s \in Segments |-> SlotsPerSegment]
    /\ live = Segments
    /\ nextToken = 1
    /\ store = [s \in Segments |-> [i \in Slots |-> None]]
    /\ writer = [w \in Writers |-> None]
    /\ publishedToken = [k \in Keys |-> 0]
    /\ content = [s \in Segments |-> [i \in Slots |-> 0]]
    /\ handed = [k \in Keys |-> [t \in Tokens |-> 0]]

PutStart(w, k, p) ==
    /\ ~Busy(w)
    /\ ~Exists(k)
    /\ nextToken \in Tokens
    /\ DOMAIN p \subseteq live
    /\ \A s \in DOMAIN p : free[s] > 0 /\ ~Allocated(s, p[s])
    /\ dir' = [dir EXCEPT ![k] = [status |-> "pending", token |-> nextToken,
                                  replicas |-> p, requested |-> Cardinality(DOMAIN p),
                                  repairs |-> NoRepairs, reads |-> 0]]
    /\ free' = [s \in Segments |-> IF s \in DOMAIN p THEN free[s] - 1 ELSE free[s]]
    /\ store' = [s \in Segments |->
                   IF s \in DOMAIN p
                   THEN [store[s] EXCEPT ![p[s]] = [key |-> k, token |-> nextToken, done |-> FALSE]]
                   ELSE store[s]]
    /\ writer' = [writer EXCEPT ![w] = [key |-> k, token |-> nextToken,
                                        replicas |-> p, written |-> {}]]
    /\ nextToken' = nextToken + 1
    /\ UNCHANGED <<live, publishedToken, content, handed>>

(* The storage node accepts the bytes only if the region is owned by the *)
(* writer's token; the slot then holds the writer's bytes.               *)
WriteReplica(w, s) ==
    /\ Busy(w)
    /\ s \in DOMAIN writer[w].replicas \ writer[w].written
    /\ LET i == writer[w].replicas[s] IN
         /\ store[s][i] # None
         /\ StorageOwns(w, s, i)
         /\ store' = [store EXCEPT ![s][i].done = TRUE]
         /\ content' = [content EXCEPT ![s][i] = writer[w].token]
    /\ writer' = [writer EXCEPT ![w].written = @ \cup {s}]
    /\ UNCHANGED <<dir, free, live, nextToken, publishedToken, handed>>

(* The master publishes the key and tells the writer so, or refuses.    *)
PutEnd(w) ==
    /\ Busy(w)
    /\ WriterMayPutEnd(w)
    /\ LET k == writer[w].key
           t == writer[w].token IN
         IF TokenOwns(k, t)
         THEN /\ dir' = [dir EXCEPT ![k].status = "published"]
              /\ publishedToken' = [publishedToken EXCEPT ![k] = t]
         ELSE UNCHANGED <<dir, publishedToken>>      \* refused: StaleToken
    /\ writer' = [writer EXCEPT ![w] = None]
    /\ UNCHANGED <<free, live, nextToken, store, content, handed>>

PutRevoke(w) ==
    /\ Busy(w)
    /\ LET k == writer[w].key IN
         IF TokenOwns(k, writer[w].token)
         THEN /\ FreeObjects({k})
              /\ dir' = [dir EXCEPT ![k] = None]
         ELSE UNCHANGED <<dir, free, store, content>> \* refused: StaleToken
    /\ writer' = [writer EXCEPT ![w] = None]
    /\ UNCHANGED <<live, nextToken, publishedToken, handed>>

WriterCrash(w) ==
    /\ Busy(w)
    /\ writer' = [writer EXCEPT ![w] = None]
    /\ UNCHANGED <<dir, free, live, nextToken, store, publishedToken, content, handed>>

(* The master's timeout for a writer that stopped sending heartbeats.  A  *)
(* timeout cannot tell a dead writer from a slow one, so it may fire at   *)
(* any time while the attempt is pending.                                 *)
ReclaimAbandoned(k) ==
    /\ Pending(k)
    /\ MayReclaim(k)
    /\ FreeObjects({k})
    /\ dir' = [dir EXCEPT ![k] = None]
    /\ UNCHANGED <<live, nextToken, writer, publishedToken, handed>>

(* The master hands a reader the object's replica descriptors and pins it. *)
ReadBegin(k) ==
    /\ Readable(k)
    /\ dir[k].reads < MaxReads
    /\ dir' = [dir EXCEPT ![k].reads = @ + 1]
    /\ handed' = [handed EXCEPT ![k][dir[k].token] = @ + 1]
    /\ UNCHANGED <<free, live, nextToken, store, writer, publishedToken, content>>

(* A reader is done with the descriptors it was handed; the pin ends. *)
ReadEnd(k) ==
    /\ Exists(k)
    /\ dir[k].reads > 0
    /\ dir' = [dir EXCEPT ![k].reads = @ - 1]
    /\ handed' = [handed EXCEPT ![k][dir[k].token] = @ - 1]
    /\ UNCHANGED <<free, live, nextToken, store, writer, publishedToken, content>>

Remove(k) ==
    /\ Published(k)
    /\ dir[k].reads = 0
    /\ FreeObjects({k})
    /\ dir' = [dir EXCEPT ![k] = None]
    /\ publishedToken' = [publishedToken EXCEPT ![k] = 0]
    /\ UNCHANGED <<live, nextToken, writer, handed>>

(* A segment dies with its bytes.  A pending object with a replica there  *)
(* is revoked whole; a published one keeps its other replicas, and is     *)
(* gone (its readers fail, and let go of its descriptors, and its repairs  *)
(* are cancelled) when none is left.  A repair into the segment ends.     *)
SegmentLost(s) ==
    /\ s \in live
    /\ LET hit  == {k \in Keys : Exists(k) /\ s \in DOMAIN dir[k].replicas}
           gone == {k \in hit : Pending(k) \/ DOMAIN dir[k].replicas = {s}}
       IN
         /\ live' = live \ {s}
         /\ free' = [s2 \in Segments |->
                       IF s2 = s THEN 0
                       ELSE free[s2] + Cardinality({k \in gone : s2 \in SegmentsOf(k)})]
         /\ store' = [s2 \in Segments |->
                        IF s2 = s THEN [i \in Slots |-> None]
                        ELSE [i \in Slots |->
                                IF store[s2][i] # None /\ store[s2][i].key \in gone
                                THEN None ELSE store[s2][i]]]
         /\ content' = [s2 \in Segments |-> [i \in Slots |->
                          IF s2 = s \/ (store[s2][i] # None /\ store[s2][i].key \in gone)
                          THEN 0 ELSE content[s2][i]]]
         /\ dir' = [k \in Keys |->
                      IF k \in gone THEN None
                      ELSE IF Exists(k) /\ s \in SegmentsOf(k)
                      THEN [dir[k] EXCEPT !.replicas = Without(@, s), !.repairs = Without(@, s)]
                      ELSE dir[k]]
         /\ publishedToken' = [k \in Keys |-> IF k \in gone THEN 0 ELSE publishedToken[k]]
         /\ handed' = [k \in Keys |-> IF k \in gone THEN [t \in Tokens |-> 0] ELSE handed[k]]
    /\ UNCHANGED <<nextToken, writer>>

(* The master starts a repair of a published object below its requested *)
(* count: a region on a live segment holding none of the object, stamped  *)
(* with the object's token; the repair's id is a fresh token.             *)
RepairStart(k, s, i) ==
    /\ Published(k)
    /\ Below(k)
    /\ nextToken \in Tokens
    /\ s \in live \ SegmentsOf(k)
    /\ free[s] > 0
    /\ ~Allocated(s, i)
    /\ dir' = [dir EXCEPT ![k].repairs = Extend(@, s, [slot |-> i, id |-> nextToken])]
    /\ free' = [free EXCEPT ![s] = @ - 1]
    /\ store' = [store EXCEPT ![s][i] = [key |-> k, token |-> dir[k].token, done |-> FALSE]]
    /\ nextToken' = nextToken + 1
    /\ UNCHANGED <<live, writer, publishedToken, content, handed>>

(* The copier reads a listed replica (under the object's token) and writes *)
(* its bytes into the repair's region, once.                              *)
CopyReplica(k, s) ==
    /\ Published(k)
    /\ s \in DOMAIN dir[k].repairs
    /\ LET i == dir[k].repairs[s].slot IN
         /\ ~store[s][i].done
         /\ \E src \in DOMAIN dir[k].replicas :
               /\ store' = [store EXCEPT ![s][i].done = TRUE]
               /\ content' = [content EXCEPT ![s][i] = content[src][dir[k].replicas[src]]]
    /\ UNCHANGED <<dir, free, live, nextToken, writer, publishedToken, handed>>

(* The copier reported its copy complete: the master lists the replica. *)
ListReplica(k, s) ==
    /\ Published(k)
    /\ s \in DOMAIN dir[k].repairs
    /\ RepairCopied(k, s)
    /\ dir' = [dir EXCEPT ![k].replicas = Extend(@, s, dir[k].repairs[s].slot),
                          ![k].repairs = Without(@, s)]
    /\ UNCHANGED <<free, live, nextToken, store, writer, publishedToken, content, handed>>

(* A repair ends unlisted (its copy failed or timed out): its region is freed. *)
RepairCancel(k, s) ==
    /\ Published(k)
    /\ s \in DOMAIN dir[k].repairs
    /\ LET i == dir[k].repairs[s].slot IN
         /\ dir' = [dir EXCEPT ![k].repairs = Without(@, s)]
         /\ free' = [free EXCEPT ![s] = @ + 1]
         /\ store' = [store EXCEPT ![s][i] = None]
         /\ content' = [content EXCEPT ![s][i] = 0]
    /\ UNCHANGED <<live, nextToken, writer, publishedToken, handed>>

Next ==
    \/ \E w \in Writers, k \in Keys, p \in Placements : PutStart(w, k, p)
    \/ \E w \in Writers, s \in Segments : WriteReplica(w, s)
    \/ \E w \in Writers : PutEnd(w) \/ PutRevoke(w) \/ WriterCrash(w)
    \/ \E k \in Keys : ReclaimAbandoned(k) \/ ReadBegin(k) \/ ReadEnd(k) \/ Remove(k)
    \/ \E s \in Segments : SegmentLost(s)
    \/ \E k \in Keys, s \in Segments, i \in Slots : RepairStart(k, s, i)
    \/ \E k \in Keys, s \in Segments :
           CopyReplica(k, s) \/ ListReplica(k, s) \/ RepairCancel(k, s)

(* The master's timeout eventually fires for an attempt left pending. *)
Fairness == \A k \in Keys : WF_vars(ReclaimAbandoned(k))

Spec == Init /\ [][Next]_vars /\ Fairness

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ dir \in [Keys -> {None} \cup Object]
    /\ free \in [Segments -> 0..SlotsPerSegment]
    /\ live \subseteq Segments
    /\ nextToken \in 1..(MaxToken + 1)
    /\ store \in [Segments -> [Slots -> {None} \cup Region]]
    /\ writer \in [Writers -> {None} \cup Attempt]
    /\ publishedToken \in [Keys -> 0..MaxToken]
    /\ content \in [Segments -> [Slots -> 0..MaxToken]]
    /\ handed \in [Keys -> [Tokens -> 0..MaxReads]]

(* Every reader holding descriptors holds those of a published object, and *)
(* of the attempt its key still names: no descriptor outlives the object's *)
(* publication (by a remove, a reclaim or a replacement under it).         *)
OnlyPublishedReadable ==
    \A k \in Keys, t \in Tokens : handed[k][t] > 0 => Published(k) /\ dir[k].token = t

(* Every replica of a published object holds that attempt's complete bytes. *)
PublishedHasAllReplicasComplete ==
    \A k \in Keys : Published(k) =>
        \A s \in DOMAIN dir[k].replicas :
            store[s][dir[k].replicas[s]] = [key |-> k, token |-> dir[k].token, done |-> TRUE]

(* No slot belongs to two objects, and the storage nodes' region tables *)
(* agree with the master's directory.                                  *)
NoOverlappingAllocation ==
    /\ \A k1, k2 \in Keys : k1 # k2 /\ Exists(k1) /\ Exists(k2) =>
          SlotsOf(k1) \cap SlotsOf(k2) = {}
    /\ \A s \in Segments, i \in Slots :
          store[s][i] # None <=>
              \E k \in Keys : Exists(k) /\ <<s, i>> \in SlotsOf(k)
                              /\ store[s][i].key = k
                              /\ store[s][i].token = dir[k].token

(* free + allocated = capacity on live segments; nothing on lost ones.  *)
(* A repair's region counts as allocated from RepairStart until it is    *)
(* listed or cancelled.                                                  *)
SpaceAccounted ==
    \A s \in Segments :
        IF s \in live THEN free[s] + UsedSlots(s) = SlotsPerSegment
        ELSE free[s] = 0 /\ UsedSlots(s) = 0

(* The writers told their put was published are exactly the attempts of  *)
(* the published objects: a stale attempt is never told so, and no put    *)
(* told so is left unpublished.                                          *)
OneAttemptPublishes ==
    \A k \in Keys : publishedToken[k] = IF Published(k) THEN dir[k].token ELSE 0

(* Every replica of a published object holds exactly the bytes written by *)
(* the attempt whose PutEnd published it: no other attempt's write landed *)
(* in its regions.                                                        *)
PublishedBytesAreTheAttempts ==
    \A k \in Keys : Published(k) =>
        \A s \in DOMAIN dir[k].replicas : content[s][dir[k].replicas[s]] = publishedToken[k]

(* Repair never takes an object above the count its put requested, and a *)
(* replica and a repair of one object never share a segment.             *)
NeverAboveRequested ==
    \A k \in Keys : Exists(k) =>
        /\ Cardinality(DOMAIN dir[k].replicas) + Cardinality(DOMAIN dir[k].repairs)
              <= dir[k].requested
        /\ DOMAIN dir[k].replicas \cap DOMAIN dir[k].repairs = {}

(***************************************************************************)
(* Liveness                                                                *)
(***************************************************************************)
(* Every allocation is eventually published or reclaimed (under Fairness). *)
AllocationResolves == \A k \in Keys : Pending(k) ~> ~Pending(k)

=============================================================================

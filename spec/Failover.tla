------------------------------ MODULE Failover ------------------------------
(***************************************************************************)
(* Master failover of the kvproto store: fence the old master, then        *)
(* recover the directory, then open; a higher term rejects the old         *)
(* master's late requests, so two masters never allocate at once.          *)
(*                                                                         *)
(* The master (the directory) can crash, or pause and wake up later still *)
(* believing it is the master.  A new master takes over in this order:    *)
(* ObtainTerm (a higher term from the coordinator), Fence (every live      *)
(* storage node learns the term and from then on refuses any allocation, *)
(* publish or read stamped with a lower term), Recover (rebuild the        *)
(* directory from the storage nodes' own indexes: published objects on    *)
(* live nodes only; unpublished allocations of older terms are purged),   *)
(* and only then Open.  A master that is refused because of a higher term *)
(* steps down.  A paused master is not a separate action: a master that   *)
(* takes no step for a while is paused, and when it takes one again it     *)
(* acts on its old term and old directory.                                 *)
(*                                                                         *)
(* Storage nodes keep the index of what they hold: key -> allocation term, *)
(* published or not, and the term of the publish that made it visible.   *)
(* A publish or a remove is acknowledged to its client only once the      *)
(* node recorded it under the master's term; what was acknowledged is     *)
(* never undone by a term change (AcknowledgedChangesSurvive).            *)
(* A put writes one replica; a repair copies a published object from a    *)
(* live node that holds it to another live node, up to MaxCopies copies   *)
(* (the publish protocol covers the requested count).  A repaired replica *)
(* is a copy of the listed allocation: the destination records the        *)
(* source's index entry, allocation and publishing term included, not the *)
(* repairing master's term (only the fence checks that term).             *)
(* Readers hold descriptors stamped with the term of the master that      *)
(* handed them out; a refused or failed read is a miss.                   *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Masters,   \* master processes (one active at a time, others standby)
    Nodes,     \* storage nodes (one segment each)
    Keys,      \* object keys
    Readers,   \* client readers
    MaxTerm,   \* bound on terms the coordinator issues (keeps the model finite)
    MaxCopies, \* replicas a repair may bring an object up to (1: no repair)
    None       \* model value: no entry, no descriptor, no read yet

Terms == 1..MaxTerm
Phases == {"standby", "fencing", "recovered", "open"}

VARIABLES
    coordTerm,      \* coordinator: the highest term issued
    phase,          \* master -> phase
    mterm,          \* master -> its term (0 while standby)
    acked,          \* master -> storage nodes that acknowledged its fence
    dir,            \* master -> key -> None | [nodes, pub] (the replicas it lists)
    live,           \* storage nodes still alive (with their bytes)
    nodeTerm,       \* storage node -> highest term it has seen
    idx,            \* storage node -> key -> None | [term, pub, by]
    desc,           \* reader -> None | [key, node, term]
    got,            \* reader -> None | Miss | the index entry its last read returned
    promised,       \* history: storage node -> the highest term whose fence it acknowledged
    staleAccepted,  \* history: storage nodes that accepted a request stamped below a term
                    \*   whose fence they had acknowledged
    told            \* history: key -> what the last acknowledged change told its client

vars == <<coordTerm, phase, mterm, acked, dir, live, nodeTerm, idx, desc, got, promised,
          staleAccepted, told>>

DirEntry == [nodes : SUBSET Nodes, pub : BOOLEAN]
IdxEntry == [term : Terms, pub : BOOLEAN, by : 0..MaxTerm]
Descriptor == [key : Keys, node : Nodes, term : Terms]
Told == [what : {"none", "published", "removed"}, node : Nodes \cup {None}]

(* The result of a read that missed. *)
Miss == [term |-> 0, pub |-> FALSE, by |-> 0]

Max(a, b) == IF a > b THEN a ELSE b
HoldsDescriptor(r, k) == IF desc[r] = None THEN FALSE ELSE desc[r].key = k
NoDir == [k \in Keys |-> None]

(***************************************************************************)
(* Guards that the weakened models replace (see the Failover_Weak_*.cfg). *)
(***************************************************************************)
\* A storage node accepts an allocation, publish or read stamped with term t
\* only if t is not below the highest term it has seen.
NodeAccepts(n, t) == t >= nodeTerm[n]
\* Recovery starts only when every live storage node acknowledged the fence.
FenceComplete(m) == live \subseteq acked[m]
\* The live nodes that hold k published, and the highest publishing term
\* among them (the protocol publishes one allocation of k at a time).
PublishedAt(k) == {n \in live : idx[n][k] # None /\ idx[n][k].pub}
LatestBy(k) == CHOOSE b \in {idx[n][k].by : n \in PublishedAt(k)} :
                   \A n \in PublishedAt(k) : idx[n][k].by <= b
\* The recovered directory: published objects whose bytes are on a live node,
\* listed with every live node that holds the allocation of the highest
\* publishing term.
RecoveredDir(m) ==
    [k \in Keys |->
        IF PublishedAt(k) # {}
        THEN [nodes |-> {n \in PublishedAt(k) : idx[n][k].by = LatestBy(k)}, pub |-> TRUE]
        ELSE None]
\* What a repair's destination records: a copy of the source's entry.
RepairedEntry(m, s, k) == idx[s][k]

\* A publish or remove that the node refused is not acknowledged: the
\* client is told it failed (the master waits for the node's verdict).
AckWhenRefused == FALSE
\* A storage node that acknowledges a fence records its term.
FenceRecordsTerm == TRUE

WeakNodeIgnoresTerm(n, t) == TRUE
WeakAckWhenRefused == TRUE
WeakFenceForgetsTerm == FALSE
WeakNoFence(m) == TRUE
WeakStaleSnapshot(m) == dir[m]   \* the directory it last held, not reconciled with storage
WeakRepairStampsOwnTerm(m, s, k) == [term |-> mterm[m], pub |-> TRUE, by |-> mterm[m]]

(* The master learns of a higher term and goes back to standby.  It keeps *)
(* its (now stale) directory in memory; a crash loses it.                *)
StepDown(m) ==
    /\ phase' = [phase EXCEPT ![m] = "standby"]
    /\ mterm' = [mterm EXCEPT ![m] = 0]
    /\ acked' = [acked EXCEPT ![m] = {}]

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ coordTerm = 0
    /\ phase = [m \in Masters |-> "standby"]
    /\ mterm = [m \in Masters |-> 0]
    /\ acked = [m \in Masters |-> {}]
    /\ dir = [m \in Masters |-> NoDir]
    /\ live = Nodes
    /\ nodeTerm = [n \in Nodes |-> 0]
    /\ idx = [n \in Nodes |-> [k \in Keys |-> None]]
    /\ desc = [r \in Readers |-> None]
    /\ got = [r \in Readers |-> None]
    /\ promised = [n \in Nodes |-> 0]
    /\ staleAccepted = {}
    /\ told = [k \in Keys |-> [what |-> "none", node |-> None]]

(* A standby master obtains a higher term from the coordinator.  The      *)
(* coordinator may do so at any time: it cannot tell a dead master from a *)
(* paused one.                                                            *)
ObtainTerm(m) ==
    /\ phase[m] = "standby"
    /\ coordTerm < MaxTerm
    /\ coordTerm' = coordTerm + 1
    /\ phase' = [phase EXCEPT ![m] = "fencing"]
    /\ mterm' = [mterm EXCEPT ![m] = coordTerm + 1]
    /\ acked' = [acked EXCEPT ![m] = {}]
    /\ UNCHANGED <<dir, live, nodeTerm, idx, desc, got, promised, staleAccepted, told>>

(* Storage node n learns m's term and acknowledges the fence: a promise *)
(* to refuse lower terms from now on.  Or it refuses (it saw a higher).  *)
Fence(m, n) ==
    /\ phase[m] = "fencing"
    /\ n \in live \ acked[m]
    /\ IF nodeTerm[n] <= mterm[m]
       THEN /\ nodeTerm' = IF FenceRecordsTerm THEN [nodeTerm EXCEPT ![n] = mterm[m]]
                           ELSE nodeTerm
            /\ acked' = [acked EXCEPT ![m] = @ \cup {n}]
            /\ promised' = [promised EXCEPT ![n] = Max(@, mterm[m])]
            /\ UNCHANGED <<phase, mterm>>
       ELSE /\ StepDown(m)                         \* refused: StaleTerm
            /\ UNCHANGED <<nodeTerm, promised>>
    /\ UNCHANGED <<coordTerm, dir, live, idx, desc, got, staleAccepted, told>>

(* Rebuild the directory from the live storage nodes' indexes; the nodes *)
(* purge unpublished allocations of older terms and free their space.   *)
Recover(m) ==
    /\ phase[m] = "fencing"
    /\ FenceComplete(m)
    /\ IF \A n \in live : nodeTerm[n] <= mterm[m]
       THEN /\ dir' = [dir EXCEPT ![m] = RecoveredDir(m)]
            /\ idx' = [n \in Nodes |-> [k \in Keys |->
                         IF idx[n][k] # None /\ ~idx[n][k].pub /\ idx[n][k].term < mterm[m]
                         THEN None ELSE idx[n][k]]]
            /\ phase' = [phase EXCEPT ![m] = "recovered"]
            /\ UNCHANGED <<mterm, acked>>
       ELSE /\ StepDown(m)                         \* refused: StaleTerm
            /\ UNCHANGED <<dir, idx>>
    /\ UNCHANGED <<coordTerm, live, nodeTerm, desc, got, promised, staleAccepted, told>>

Open(m) ==
    /\ phase[m] = "recovered"
    /\ phase' = [phase EXCEPT ![m] = "open"]
    /\ UNCHANGED <<coordTerm, mterm, acked, dir, live, nodeTerm, idx, desc, got, promised, staleAccepted, told>>

(* The master dies and loses its in-memory directory. *)
Crash(m) ==
    /\ phase[m] # "standby"
    /\ StepDown(m)
    /\ dir' = [dir EXCEPT ![m] = NoDir]
    /\ UNCHANGED <<coordTerm, live, nodeTerm, idx, desc, got, promised, staleAccepted, told>>

(* An open master allocates key k on node n, stamped with its term. *)
Allocate(m, k, n) ==
    /\ phase[m] = "open"
    /\ dir[m][k] = None
    /\ n \in live
    /\ idx[n][k] = None
    /\ IF NodeAccepts(n, mterm[m])
       THEN /\ idx' = [idx EXCEPT ![n][k] = [term |-> mterm[m], pub |-> FALSE, by |-> 0]]
            /\ nodeTerm' = [nodeTerm EXCEPT ![n] = Max(@, mterm[m])]
            /\ dir' = [dir EXCEPT ![m][k] = [nodes |-> {n}, pub |-> FALSE]]
            /\ staleAccepted' = IF mterm[m] < promised[n] THEN staleAccepted \cup {n}
                                ELSE staleAccepted
            /\ UNCHANGED <<phase, mterm, acked>>
       ELSE /\ StepDown(m)                         \* refused: StaleTerm
            /\ UNCHANGED <<idx, nodeTerm, dir, staleAccepted>>
    /\ UNCHANGED <<coordTerm, live, desc, got, promised, told>>

(* The writer finished; the master publishes k, stamped with its term,  *)
(* and acknowledges the put once k's node recorded the publish.         *)
Publish(m, k) ==
    /\ phase[m] = "open"
    /\ dir[m][k] # None
    /\ ~dir[m][k].pub
    /\ LET n == CHOOSE x \in dir[m][k].nodes : TRUE IN   \* a put's one replica
         /\ n \in live
         /\ idx[n][k] # None
         /\ ~idx[n][k].pub
         /\ IF NodeAccepts(n, mterm[m])
            THEN /\ idx' = [idx EXCEPT ![n][k].pub = TRUE, ![n][k].by = mterm[m]]
                 /\ nodeTerm' = [nodeTerm EXCEPT ![n] = Max(@, mterm[m])]
                 /\ dir' = [dir EXCEPT ![m][k].pub = TRUE]
                 /\ staleAccepted' = IF mterm[m] < promised[n] THEN staleAccepted \cup {n}
                                     ELSE staleAccepted
                 /\ told' = [told EXCEPT ![k] = [what |-> "published", node |-> n]]
                 /\ UNCHANGED <<phase, mterm, acked>>
            ELSE /\ StepDown(m)                    \* refused: StaleTerm
                 /\ told' = IF AckWhenRefused
                            THEN [told EXCEPT ![k] = [what |-> "published", node |-> n]]
                            ELSE told
                 /\ UNCHANGED <<idx, nodeTerm, dir, staleAccepted>>
    /\ UNCHANGED <<coordTerm, live, desc, got, promised>>

(* A client removes published k: the master frees k's regions at every    *)
(* node it lists, stamped with its term, and acknowledges the remove once  *)
(* the nodes recorded it.  A node fenced by a newer term refuses; the      *)
(* master steps down and the client is told the remove failed.  No reader *)
(* may hold a descriptor of k: a remove is refused under a read pin or     *)
(* lease, also one granted by an earlier master (spec/Lease.tla,           *)
(* InheritLeases).                                                         *)
Remove(m, k) ==
    /\ phase[m] = "open"
    /\ dir[m][k] # None
    /\ dir[m][k].pub
    /\ \A r \in Readers : ~HoldsDescriptor(r, k)
    /\ LET ns == dir[m][k].nodes IN
         /\ ns \subseteq live
         /\ \A n \in ns : idx[n][k] # None
         /\ IF \A n \in ns : NodeAccepts(n, mterm[m])
            THEN /\ idx' = [n \in Nodes |-> IF n \in ns THEN [idx[n] EXCEPT ![k] = None]
                                           ELSE idx[n]]
                 /\ nodeTerm' = [n \in Nodes |-> IF n \in ns THEN Max(nodeTerm[n], mterm[m])
                                               ELSE nodeTerm[n]]
                 /\ dir' = [dir EXCEPT ![m][k] = None]
                 /\ staleAccepted' = staleAccepted \cup {n \in ns : mterm[m] < promised[n]}
                 /\ told' = [told EXCEPT ![k] = [what |-> "removed", node |-> None]]
                 /\ UNCHANGED <<phase, mterm, acked>>
            ELSE /\ StepDown(m)                    \* refused: StaleTerm
                 /\ told' = IF AckWhenRefused
                            THEN [told EXCEPT ![k] = [what |-> "removed", node |-> None]]
                            ELSE told
                 /\ UNCHANGED <<idx, nodeTerm, dir, staleAccepted>>
    /\ UNCHANGED <<coordTerm, live, desc, got, promised>>

(* A reader looks k up at a master that believes it is open (a paused old *)
(* master answers too) and gets a descriptor stamped with that master's    *)
(* term, for any replica it lists.  A failed lookup is a miss and changes  *)
(* nothing.                                                                *)
Lookup(r, m, k) ==
    /\ desc[r] = None
    /\ phase[m] = "open"
    /\ dir[m][k] # None
    /\ dir[m][k].pub
    /\ \E n \in dir[m][k].nodes :     \* any replica it lists
         desc' = [desc EXCEPT ![r] = [key |-> k, node |-> n, term |-> mterm[m]]]
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, dir, live, nodeTerm, idx, got, promised, staleAccepted, told>>

(* The reader reads from the storage node.  A dead node, a refused term or *)
(* a missing region is a miss; the reader drops the descriptor either way. *)
Read(r) ==
    /\ desc[r] # None
    /\ LET n == desc[r].node
           k == desc[r].key IN
         got' = [got EXCEPT ![r] =
                   IF n \in live /\ NodeAccepts(n, desc[r].term) /\ idx[n][k] # None
                   THEN idx[n][k] ELSE Miss]
    /\ desc' = [desc EXCEPT ![r] = None]
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, dir, live, nodeTerm, idx, promised, staleAccepted, told>>

(* An open master repairs published k: a copier reads it from a live node  *)
(* s that the master lists (under the master's term: a fenced source       *)
(* refuses, the copy fails and nothing changes) and writes it to a live    *)
(* node d that holds no entry of k; d records the copy under the master's *)
(* term (its fence) as RepairedEntry, and the master lists d.  A node     *)
(* fenced by a newer term refuses and the master steps down.              *)
Repair(m, k, s, d) ==
    /\ phase[m] = "open"
    /\ dir[m][k] # None
    /\ dir[m][k].pub
    /\ Cardinality(dir[m][k].nodes) < MaxCopies
    /\ s \in dir[m][k].nodes
    /\ {s, d} \subseteq live
    /\ d \notin dir[m][k].nodes
    /\ idx[s][k] # None /\ idx[s][k].pub
    /\ NodeAccepts(s, mterm[m])
    /\ idx[d][k] = None
    /\ IF NodeAccepts(d, mterm[m])
       THEN /\ idx' = [idx EXCEPT ![d][k] = RepairedEntry(m, s, k)]
            /\ nodeTerm' = [nodeTerm EXCEPT ![d] = Max(@, mterm[m])]
            /\ dir' = [dir EXCEPT ![m][k].nodes = @ \cup {d}]
            /\ staleAccepted' = IF mterm[m] < promised[d] THEN staleAccepted \cup {d}
                                ELSE staleAccepted
            /\ UNCHANGED <<phase, mterm, acked>>
       ELSE /\ StepDown(m)                         \* refused: StaleTerm
            /\ UNCHANGED <<idx, nodeTerm, dir, staleAccepted>>
    /\ UNCHANGED <<coordTerm, live, desc, got, promised, told>>

(* A storage node dies with its bytes and its index.  Masters that serve  *)
(* (recovered or open) notice and drop it from their entries, and an entry *)
(* with no replica left.                                                  *)
NodeLost(n) ==
    /\ n \in live
    /\ live' = live \ {n}
    /\ idx' = [idx EXCEPT ![n] = [k \in Keys |-> None]]
    /\ dir' = [m \in Masters |->
                 IF phase[m] \in {"recovered", "open"}
                 THEN [k \in Keys |->
                         IF dir[m][k] = None \/ n \notin dir[m][k].nodes THEN dir[m][k]
                         ELSE IF dir[m][k].nodes = {n} THEN None
                         ELSE [dir[m][k] EXCEPT !.nodes = @ \ {n}]]
                 ELSE dir[m]]
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, nodeTerm, desc, got, promised, staleAccepted, told>>

Next ==
    \/ \E m \in Masters : ObtainTerm(m) \/ Recover(m) \/ Open(m) \/ Crash(m)
    \/ \E m \in Masters, n \in Nodes : Fence(m, n)
    \/ \E m \in Masters, k \in Keys, n \in Nodes : Allocate(m, k, n)
    \/ \E m \in Masters, k \in Keys : Publish(m, k) \/ Remove(m, k)
    \/ \E m \in Masters, k \in Keys, s, d \in Nodes : Repair(m, k, s, d)
    \/ \E r \in Readers, m \in Masters, k \in Keys : Lookup(r, m, k)
    \/ \E r \in Readers : Read(r)
    \/ \E n \in Nodes : NodeLost(n)

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ MaxCopies \in Nat \ {0}
    /\ coordTerm \in 0..MaxTerm
    /\ phase \in [Masters -> Phases]
    /\ mterm \in [Masters -> 0..MaxTerm]
    /\ acked \in [Masters -> SUBSET Nodes]
    /\ dir \in [Masters -> [Keys -> {None} \cup DirEntry]]
    /\ live \subseteq Nodes
    /\ nodeTerm \in [Nodes -> 0..MaxTerm]
    /\ idx \in [Nodes -> [Keys -> {None} \cup IdxEntry]]
    /\ desc \in [Readers -> {None} \cup Descriptor]
    /\ got \in [Readers -> {None, Miss} \cup IdxEntry]
    /\ promised \in [Nodes -> 0..MaxTerm]
    /\ staleAccepted \subseteq Nodes
    /\ told \in [Keys -> Told]

(* The master that holds the coordinator's current term and serves. *)
Current(m) == phase[m] \in {"recovered", "open"} /\ mterm[m] = coordTerm

(* A master may allocate or publish if it is open and some live node would *)
(* accept its term.  Never two at once.                                   *)
CanMutate(m) == phase[m] = "open" /\ \E n \in live : NodeAccepts(n, mterm[m])
NoSplitBrainAllocation == \A m1, m2 \in Masters : m1 # m2 => ~(CanMutate(m1) /\ CanMutate(m2))

(* No storage node ever accepted an allocation, publish or remove stamped *)
(* with a term below one whose fence it had acknowledged: the promise a    *)
(* fencing master relies on is kept, however the node keeps its term.     *)
NoStaleTermWriteAccepted == staleAccepted = {}

(* The current master lists only objects whose bytes exist on a live node, *)
(* and lists as published only what the nodes hold as published.         *)
DirectoryOnlyListsLiveBytes ==
    \A m \in Masters : Current(m) =>
        \A k \in Keys : dir[m][k] # None =>
            /\ dir[m][k].nodes # {}
            /\ \A n \in dir[m][k].nodes :
                  /\ n \in live
                  /\ idx[n][k] # None
                  /\ dir[m][k].pub = idx[n][k].pub

(* Once a master has recovered, every unpublished allocation on a live    *)
(* node is its own (of its term, in its directory): older ones were purged.*)
UnpublishedPurgedAfterRecovery ==
    \A m \in Masters : Current(m) =>
        \A n \in live, k \in Keys : idx[n][k] # None /\ ~idx[n][k].pub =>
            /\ idx[n][k].term = mterm[m]
            /\ dir[m][k] = [nodes |-> {n}, pub |-> FALSE]

(* A read returns a miss or bytes published by the attempt that wrote them *)
(* (the publish was stamped with the allocation's term).                  *)
ReadsReturnPublishedBytesOrMiss ==
    \A r \in Readers : got[r] \in {None, Miss} \/ (got[r].pub /\ got[r].by = got[r].term)

(* A change acknowledged to a client is never undone by a term change: a *)
(* current master lists as published every object whose publish was      *)
(* acknowledged, for as long as its node lives, and none whose remove was *)
(* acknowledged.                                                          *)
AcknowledgedChangesSurvive ==
    \A m \in Masters, k \in Keys : Current(m) =>
        /\ told[k].what = "published" /\ told[k].node \in live =>
               dir[m][k] # None /\ dir[m][k].pub
        /\ told[k].what = "removed" => dir[m][k] = None \/ ~dir[m][k].pub

(* Every published copy on a live node is listed by the current master:   *)
(* a takeover lists the original and its repaired replicas alike, so none *)
(* is left out, unreadable and never freed (a leaked region).             *)
NoPublishedCopyOrphaned ==
    \A m \in Masters : Current(m) =>
        \A n \in live, k \in Keys : idx[n][k] # None /\ idx[n][k].pub =>
            dir[m][k] # None /\ n \in dir[m][k].nodes

=============================================================================

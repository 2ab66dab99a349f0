------------------------------ MODULE Timeout ------------------------------
(***************************************************************************)
(* Remote-load timeout, quarantine and drain. A timeout is the caller's    *)
(* decision, not proof that the transfer stopped: the destination stays    *)
(* quarantined until the transfer's completion or its cancel               *)
(* acknowledgement arrives, late callbacks are recognised by generation    *)
(* and dropped, and a request that ends still owns its transfers until     *)
(* they drain.                                                             *)
(*                                                                         *)
(* A client's transfer engine owns a pool of destination buffers (host     *)
(* staging buffers or GPU blocks).  A request takes a buffer (Acquire) and *)
(* issues a load into it (Issue); every transfer gets a fresh generation   *)
(* number.  The storage node / NIC moves the bytes: when a transfer        *)
(* completes its bytes land in the buffer and a completion callback is     *)
(* sent (Land).  The client applies the callback (Complete), after which  *)
(* the consumer may read the buffer (Consume).                             *)
(*                                                                         *)
(* A timeout is the caller's decision, not proof that the transfer         *)
(* stopped.  When the client gives up waiting (Timeout) the buffer is      *)
(* quarantined: it is handed to nobody until the transfer's completion     *)
(* callback (Complete) or the storage node's cancel acknowledgement        *)
(* (CancelAck) arrives.  The client asks the storage node to stop the      *)
(* transfer (Cancel, at most MaxCancels times); the storage node stops it  *)
(* if it still runs and acknowledges (StorageCancel).  A transfer whose    *)
(* cancels went unanswered may be written off (GiveUp): its buffer moves   *)
(* to a leak ledger of at most MaxLeaked buffers, still never handed out,  *)
(* and comes back when a late completion or ack arrives.                  *)
(*                                                                         *)
(* Messages are sets that are never emptied, so every callback and every   *)
(* ack can be delivered any number of times, late, after its buffer has    *)
(* been reused: Complete and CancelAck must be idempotent and must         *)
(* recognise an old generation and drop it.                                *)
(*                                                                         *)
(* A request that is cancelled ("result no longer needed",                 *)
(* RequestCancel) or finishes (RequestFinish) releases its idle buffers at *)
(* once, but still owns its quarantined buffers and their transfers: it    *)
(* is "draining" until the last one drains, and only then "ended".         *)
(*                                                                         *)
(* A transfer may write its buffer at any moment while it is running      *)
(* (Land writes it whole; a transfer stopped by a cancel may have written *)
(* part of it before it stopped), so the invariants constrain the whole   *)
(* running period, not only the landing step.                             *)
(*                                                                         *)
(* The storage node's transfer table (wire) is its memory, and it must    *)
(* stay bounded: the node forgets a transfer in the step that finishes it *)
(* (Land, or StorageCancel stopping it), and acknowledges a cancel of a   *)
(* generation it does not know without effect.  Nothing about a finished  *)
(* transfer is needed later: its callback carries its buffer, and a       *)
(* cancel of it is acknowledged unknown.  So the table holds exactly the  *)
(* transfers in progress (NodeTableBounded), which is what the runtime    *)
(* keeps.  (A separate, later forget step would add an independent       *)
(* interleaving per finished transfer -- three times the states -- and    *)
(* no behaviour the runtime has.)  The unknown ack is safe because the    *)
(* node never forgets a transfer that can still write                    *)
(* (NodeKnowsWhatMoves).  Which transfers may still write is physical     *)
(* state (moving: the NIC's operations in progress), kept apart from what *)
(* the node remembers, so that a node forgetting a running transfer is    *)
(* caught (Timeout_Weak_ForgetRunning).                                    *)
(*                                                                         *)
(* A cancel never reaches the node before its load: the client sends the  *)
(* cancel after the load on the same ordered connection, so the node has  *)
(* handled the load (Start, modelled as part of Issue) before it sees the *)
(* cancel.  A generation the node does not know when a cancel arrives has *)
(* therefore landed or been stopped and forgotten; a load lost on the way *)
(* never runs and is, to the client, a transfer stopped at once.  So no   *)
(* record of an unknown cancel ("tombstone") is needed: no load of that   *)
(* generation can arrive after it.                                        *)
(*                                                                         *)
(* A copy may also read buffers of the same pool (a save copies device     *)
(* blocks into a staging buffer): Issue names its sources, buffers the     *)
(* request holds with bytes to read.  While the request still awaits such *)
(* a copy, its sources are neither released nor loaded into (Release and  *)
(* Issue refuse them: SourceNotReassignedWhileRead), else the copy would  *)
(* read reassigned bytes and the request would take them as its own.     *)
(* Once the copy timed out (or the request ended, abandoning it) its       *)
(* bytes land only in a quarantined destination that is never consumed,   *)
(* so its sources may go, though it may still read them.                  *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Buffers,     \* the client's buffers: destinations and sources of copies
    Requests,    \* inference requests
    MaxGen,      \* bound on transfers issued: generations are 1..MaxGen
    MaxCancels,  \* cancel messages sent for one timed-out transfer before GiveUp
    MaxLeaked,   \* bound on written-off (leaked) buffers
    None         \* model value: no owner, no transfer record

ASSUME MaxGen \in Nat /\ MaxCancels \in Nat /\ MaxLeaked \in Nat

VARIABLES
    pool,      \* client: buffer -> [owner, gen, st]
    xfer,      \* client: generation -> None | [req, buf, src, st, cancels]
    req,       \* client: request -> "active" | "draining" | "ended"
    nextGen,   \* client: the next generation number
    wire,      \* storage node: its transfer table, generation -> None | [buf, st]
    moving,    \* physical: <<g, buf>> of transfers that may still write buf
    data,      \* buffer -> generation whose bytes it holds (0: none yet)
    cbs,       \* completion callbacks sent to the client: <<g, buf>>
    cancels,   \* cancel messages sent to the storage node
    acks,      \* cancel acknowledgements sent to the client
    timedOut,  \* history: generations the client stopped waiting for
    consumed   \* history: <<generation expected, generation of the bytes read>>

vars == <<pool, xfer, req, nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>
clientVars == <<pool, xfer, req>>

Gens == 1..MaxGen

BufState == {"free", "held", "loading", "ready", "used", "quarantined", "leaked"}
FreeBuf == [owner |-> None, gen |-> 0, st |-> "free"]

Tracked(g)  == xfer[g] # None
Mine(r, g)  == Tracked(g) /\ xfer[g].req = r
\* Transfers that request r still owns: in flight or timed out, not written off.
Undrained(r) == {g \in Gens : Mine(r, g) /\ xfer[g].st # "leaked"}
InFlight(r)  == {g \in Gens : Mine(r, g) /\ xfer[g].st = "inflight"}
LeakedBuffers == {b \in Buffers : pool[b].st = "leaked"}
Known(g)    == wire[g] # None
\* Transfer g is physically in progress (it may still write its buffer).
Moving(g)   == \E b \in Buffers : <<g, b>> \in moving
\* Buffer c is a source of a copy its request still awaits.
ReadBy(c)   == \E g \in Gens : Tracked(g) /\ xfer[g].st = "inflight" /\ c \in xfer[g].src

(***************************************************************************)
(* Guards and updates that the weakened models (Timeout_Weak_...) replace. *)
(***************************************************************************)
\* A timed-out transfer's buffer is quarantined, not freed.
TimedOutBuffer(b) == [pool[b] EXCEPT !.st = "quarantined"]
WeakFreeOnTimeout(b) == FreeBuf

\* The client transfer a completion callback for generation g into buffer b is
\* applied to: g itself while the client tracks it; otherwise the callback is
\* stale (or a duplicate) and is dropped.
Addressee(g, b) == IF Tracked(g) THEN g ELSE None
\* Without the generation check: whatever transfer buffer b now waits for.
WeakAddressee(g, b) == IF pool[b].gen # 0 /\ Tracked(pool[b].gen) THEN pool[b].gen ELSE None

\* The state a request moves to when it is cancelled or finishes.
EndState(r) == IF Undrained(r) = {} THEN "ended" ELSE "draining"
WeakEndState(r) == "ended"

\* The client may write off a transfer only while the leak ledger has room.
MayWriteOff == Cardinality(LeakedBuffers) < MaxLeaked
WeakWriteOffAlways == TRUE

\* A written-off transfer stays tracked, so its late completion or ack is
\* recognised and brings the buffer back.
WrittenOff(g) == [xfer EXCEPT ![g].st = "leaked"]
\* Weakened: the client forgets it; the late callback then looks stale.
WeakForgetWrittenOff(g) == [xfer EXCEPT ![g] = None]

\* What the storage node remembers of transfer g into b once it started it:
\* a running record, until the transfer finishes.
Started(g, b) == [buf |-> b, st |-> "running"]
\* Weakened: the node hands the transfer to the NIC and forgets it at once,
\* while it still runs.
WeakForgetRunning(g, b) == None

\* A buffer that an awaited copy reads may be neither released nor loaded into.
MayReassign(c) == ~ReadBy(c)
\* Weakened: the source of a copy in flight is handed back like any other.
WeakReassignRead(c) == TRUE
\* What it remembers once transfer g finished with outcome st ("landed" or
\* "stopped"): nothing.
Finished(g, st) == None
\* Weakened: the node keeps every finished transfer (its table grows by one
\* record per transfer, without bound).
WeakNeverForget(g, st) == [wire[g] EXCEPT !.st = st]

(***************************************************************************)
(* Drain: the completion or the cancel ack of a timed-out (or written-off)  *)
(* transfer arrived; it can no longer write its buffer, which goes back to *)
(* the pool; a draining request whose last transfer this was ends.         *)
(***************************************************************************)
Drain(g) ==
    LET b == xfer[g].buf
        r == xfer[g].req
    IN
    /\ xfer' = [xfer EXCEPT ![g] = None]
    /\ pool' = [pool EXCEPT ![b] = FreeBuf]
    /\ req' = IF req[r] = "draining" /\ Undrained(r) = {g}
              THEN [req EXCEPT ![r] = "ended"] ELSE req

\* A completion that arrives after the client timed the transfer out: its
\* bytes are not used; the buffer leaves quarantine.
OnLateCompletion(g) == Drain(g)
\* Weakened: the late bytes are handed to the (still active) request.
WeakAcceptLate(g) ==
    IF xfer[g].st = "timedout" /\ req[xfer[g].req] = "active"
    THEN /\ pool' = [pool EXCEPT ![xfer[g].buf] = [@ EXCEPT !.st = "ready"]]
         /\ xfer' = [xfer EXCEPT ![g] = None]
         /\ UNCHANGED req
    ELSE Drain(g)

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ pool = [b \in Buffers |-> FreeBuf]
    /\ xfer = [g \in Gens |-> None]
    /\ req = [r \in Requests |-> "active"]
    /\ nextGen = 1
    /\ wire = [g \in Gens |-> None]
    /\ moving = {}
    /\ data = [b \in Buffers |-> 0]
    /\ cbs = {}
    /\ cancels = {}
    /\ acks = {}
    /\ timedOut = {}
    /\ consumed = {}

\* An active request takes a free buffer (possibly one another request used).
Acquire(r, b) ==
    /\ req[r] = "active"
    /\ pool[b].st = "free"
    /\ pool' = [pool EXCEPT ![b] = [owner |-> r, gen |-> 0, st |-> "held"]]
    /\ UNCHANGED <<xfer, req, nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>

\* An active request gives back a buffer no transfer may write.
Release(r, b) ==
    /\ req[r] = "active"
    /\ pool[b].owner = r
    /\ pool[b].st \in {"held", "ready", "used"}
    /\ MayReassign(b)
    /\ pool' = [pool EXCEPT ![b] = FreeBuf]
    /\ UNCHANGED <<xfer, req, nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>

\* Load into a held buffer: a new generation, tracked by the client and
\* started on the storage node / NIC.  The copy reads the sources S (none
\* for a load from storage): other buffers the request holds with bytes.
Issue(r, b, S) ==
    /\ req[r] = "active"
    /\ pool[b].owner = r
    /\ pool[b].st = "held"
    /\ MayReassign(b)
    /\ b \notin S
    /\ \A c \in S : pool[c].owner = r /\ pool[c].st \in {"held", "ready", "used"}
    /\ nextGen \in Gens
    /\ pool' = [pool EXCEPT ![b] = [owner |-> r, gen |-> nextGen, st |-> "loading"]]
    /\ xfer' = [xfer EXCEPT ![nextGen] = [req |-> r, buf |-> b, src |-> S, st |-> "inflight", cancels |-> 0]]
    /\ wire' = [wire EXCEPT ![nextGen] = Started(nextGen, b)]
    /\ moving' = moving \cup {<<nextGen, b>>}
    /\ nextGen' = nextGen + 1
    /\ UNCHANGED <<req, data, cbs, cancels, acks, timedOut, consumed>>

\* Storage node / NIC: transfer g completes, possibly long after the client
\* timed it out; its bytes land in its buffer and a callback, which names
\* the buffer, is sent.  The node forgets the transfer.  (In a weakened
\* model a transfer the node already forgot may land too.)
Land(g) ==
    /\ Moving(g)
    /\ LET b == CHOOSE b \in Buffers : <<g, b>> \in moving IN
       /\ moving' = moving \ {<<g, b>>}
       /\ wire' = IF Known(g) THEN [wire EXCEPT ![g] = Finished(g, "landed")] ELSE wire
       /\ data' = [data EXCEPT ![b] = g]
       /\ cbs' = cbs \cup {<<g, b>>}
    /\ UNCHANGED <<pool, xfer, req, nextGen, cancels, acks, timedOut, consumed>>

\* Client: a completion callback (g, its buffer b) arrives, perhaps again.
Complete(g, b) ==
    /\ <<g, b>> \in cbs
    /\ LET h == Addressee(g, b) IN
         IF h = None
         THEN UNCHANGED clientVars                        \* stale or duplicate: dropped
         ELSE IF xfer[h].st = "inflight"
         THEN /\ pool' = [pool EXCEPT ![xfer[h].buf] = [@ EXCEPT !.st = "ready"]]
              /\ xfer' = [xfer EXCEPT ![h] = None]
              /\ UNCHANGED req
         ELSE OnLateCompletion(h)
    /\ UNCHANGED <<nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>

\* Client: stop waiting for an in-flight transfer.  Its buffer is quarantined.
Timeout(g) ==
    /\ Tracked(g)
    /\ xfer[g].st = "inflight"
    /\ xfer' = [xfer EXCEPT ![g].st = "timedout"]
    /\ pool' = [pool EXCEPT ![xfer[g].buf] = TimedOutBuffer(xfer[g].buf)]
    /\ timedOut' = timedOut \cup {g}
    /\ UNCHANGED <<req, nextGen, wire, moving, data, cbs, cancels, acks, consumed>>

\* Client: ask the storage node to stop a timed-out transfer (a retry resends).
Cancel(g) ==
    /\ Tracked(g)
    /\ xfer[g].st = "timedout"
    /\ xfer[g].cancels < MaxCancels
    /\ xfer' = [xfer EXCEPT ![g].cancels = @ + 1]
    /\ cancels' = cancels \cup {g}
    /\ UNCHANGED <<pool, req, nextGen, wire, moving, data, cbs, acks, timedOut, consumed>>

\* Storage node: on a cancel, stop the transfer if it still runs (it never
\* writes again), forget it, then acknowledge.  A cancel of a generation
\* the node does not know is acknowledged without effect: that transfer
\* landed (its callback is already on the way) or was stopped, and was
\* forgotten (see the head of the module for why it cannot be one whose
\* load has not reached the node yet).
StorageCancel(g) ==
    /\ g \in cancels
    /\ IF Known(g) /\ wire[g].st = "running"
       THEN /\ wire' = [wire EXCEPT ![g] = Finished(g, "stopped")]
            /\ moving' = moving \ {<<g, wire[g].buf>>}
       ELSE UNCHANGED <<wire, moving>>                    \* unknown (or, weakened, finished)
    /\ acks' = acks \cup {g}
    /\ UNCHANGED <<pool, xfer, req, nextGen, data, cbs, cancels, timedOut, consumed>>

\* Client: a cancel acknowledgement arrives, perhaps again.
CancelAck(g) ==
    /\ g \in acks
    /\ IF Tracked(g) /\ xfer[g].st \in {"timedout", "leaked"}
       THEN Drain(g)
       ELSE UNCHANGED clientVars                          \* stale or duplicate: dropped
    /\ UNCHANGED <<nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>

\* Client: every cancel went unanswered; write the transfer off.  The buffer
\* moves from the request to the leak ledger (still quarantined) and the
\* request no longer waits for it.
GiveUp(g) ==
    /\ Tracked(g)
    /\ xfer[g].st = "timedout"
    /\ xfer[g].cancels = MaxCancels
    /\ MayWriteOff
    /\ LET r == xfer[g].req IN
         /\ xfer' = WrittenOff(g)
         /\ pool' = [pool EXCEPT ![xfer[g].buf] = [owner |-> None, gen |-> g, st |-> "leaked"]]
         /\ req' = IF req[r] = "draining" /\ Undrained(r) = {g}
                   THEN [req EXCEPT ![r] = "ended"] ELSE req
    /\ UNCHANGED <<nextGen, wire, moving, data, cbs, cancels, acks, timedOut, consumed>>

\* A request ends (cancelled, or finished with nothing in flight): its
\* in-flight loads are abandoned like timeouts, buffers no transfer can
\* write go back to the pool, and it drains what remains.
EndRequest(r) ==
    LET abandoned == InFlight(r) IN
    /\ xfer' = [g \in Gens |-> IF g \in abandoned THEN [xfer[g] EXCEPT !.st = "timedout"]
                                ELSE xfer[g]]
    /\ pool' = [b \in Buffers |->
                  IF pool[b].owner # r THEN pool[b]
                  ELSE IF pool[b].st = "loading" THEN TimedOutBuffer(b)
                  ELSE IF pool[b].st = "quarantined" THEN pool[b]
                  ELSE FreeBuf]
    /\ req' = [req EXCEPT ![r] = EndState(r)]
    /\ timedOut' = timedOut \cup abandoned
    /\ UNCHANGED <<nextGen, wire, moving, data, cbs, cancels, acks, consumed>>

\* The engine no longer needs the result.
RequestCancel(r) ==
    /\ req[r] = "active"
    /\ EndRequest(r)

\* The request is done with its loads (none still awaited).
RequestFinish(r) ==
    /\ req[r] = "active"
    /\ InFlight(r) = {}
    /\ EndRequest(r)

\* The consumer reads a loaded buffer.
Consume(r, b) ==
    /\ req[r] = "active"
    /\ pool[b].owner = r
    /\ pool[b].st = "ready"
    /\ pool' = [pool EXCEPT ![b].st = "used"]
    /\ consumed' = consumed \cup {<<pool[b].gen, data[b]>>}
    /\ UNCHANGED <<xfer, req, nextGen, wire, moving, data, cbs, cancels, acks, timedOut>>

Next ==
    \/ \E r \in Requests, b \in Buffers :
          \/ Acquire(r, b) \/ Release(r, b) \/ Consume(r, b)
          \/ \E S \in SUBSET Buffers : Issue(r, b, S)
    \/ \E g \in Gens :
          \/ Land(g) \/ Timeout(g) \/ Cancel(g)
          \/ StorageCancel(g) \/ CancelAck(g) \/ GiveUp(g)
    \/ \E g \in Gens, b \in Buffers : Complete(g, b)
    \/ \E r \in Requests : RequestCancel(r) \/ RequestFinish(r)

(* The environment is fair: a running transfer eventually completes unless *)
(* a cancel stops it first, the storage node eventually answers a cancel,  *)
(* and every callback and ack sent is eventually delivered (and processed). *)
(* Nothing else is asked of the client: it may never cancel, never give up.*)
Fairness ==
    /\ \A g \in Gens :
        /\ WF_vars(Land(g))
        /\ WF_vars(StorageCancel(g))
        /\ WF_vars(CancelAck(g))
    /\ \A g \in Gens, b \in Buffers : WF_vars(Complete(g, b))

Spec == Init /\ [][Next]_vars /\ Fairness

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ pool \in [Buffers -> [owner : Requests \cup {None}, gen : 0..MaxGen, st : BufState]]
    /\ xfer \in [Gens -> {None} \cup [req : Requests, buf : Buffers, src : SUBSET Buffers,
                                      st : {"inflight", "timedout", "leaked"},
                                      cancels : 0..MaxCancels]]
    /\ req \in [Requests -> {"active", "draining", "ended"}]
    /\ nextGen \in 1..(MaxGen + 1)
    /\ wire \in [Gens -> {None} \cup [buf : Buffers, st : {"running", "landed", "stopped"}]]
    /\ moving \subseteq Gens \X Buffers
    /\ data \in [Buffers -> 0..MaxGen]
    /\ cbs \subseteq Gens \X Buffers /\ cancels \subseteq Gens /\ acks \subseteq Gens
    /\ timedOut \subseteq Gens
    /\ consumed \subseteq Gens \X (0..MaxGen)

(* The buffer a transfer may still write is reserved for that transfer:    *)
(* not free in the pool, not held by any request for anything else, not    *)
(* waiting for another generation.                                         *)
NoWriteIntoReassignedBuffer ==
    \A m \in moving :
        /\ pool[m[2]].gen = m[1]
        /\ pool[m[2]].st \in {"loading", "quarantined", "leaked"}

(* A copy the request still awaits reads what the request holds: while it *)
(* may still read them, its sources stay held by its request, with bytes,  *)
(* not released, not reassigned, not being loaded into.                    *)
SourceNotReassignedWhileRead ==
    \A g \in Gens : Tracked(g) /\ xfer[g].st = "inflight" /\ Moving(g) =>
        \A c \in xfer[g].src :
            /\ pool[c].owner = xfer[g].req
            /\ pool[c].st \in {"held", "ready", "used"}

(* The storage node forgets only transfers that can no longer write: every *)
(* transfer in progress is one the node knows as running, into its buffer.*)
(* So a cancel of a generation the node does not know may be acknowledged: *)
(* nothing of that generation can write any more.                          *)
NodeKnowsWhatMoves ==
    \A m \in moving : Known(m[1]) /\ wire[m[1]] = [buf |-> m[2], st |-> "running"]

(* The storage node's table does not leak: it holds only transfers still in *)
(* progress, so it is bounded by the transfers in flight, not by the       *)
(* transfers ever served.                                                  *)
NodeTableBounded ==
    \A g \in Gens : Known(g) => wire[g].st = "running" /\ <<g, wire[g].buf>> \in moving

(* A callback from an older generation changes nothing: a buffer is ready *)
(* only once its own generation's bytes landed in it, and the consumer     *)
(* reads the generation it expects.                                       *)
StaleCallbacksHaveNoEffect ==
    /\ \A b \in Buffers : pool[b].st \in {"ready", "used"} => data[b] = pool[b].gen
    /\ \A p \in consumed : p[1] = p[2]

(* Data of a transfer the client stopped waiting for is never consumed,   *)
(* even when it lands later.                                               *)
NoConsumeOfTimedOutData ==
    /\ \A b \in Buffers : pool[b].st \in {"ready", "used"} => pool[b].gen \notin timedOut
    /\ \A p \in consumed : p[1] \notin timedOut /\ p[2] \notin timedOut

(* A request has ended only when it holds no buffer and owns no transfer  *)
(* that has not drained (a written-off transfer belongs to the ledger).    *)
RequestEndsOnlyAfterDrain ==
    \A r \in Requests : req[r] = "ended" =>
        /\ \A b \in Buffers : pool[b].owner # r
        /\ \A g \in Gens : Mine(r, g) => xfer[g].st = "leaked"

(* A failed clean-up is bounded: at most MaxLeaked buffers are written off, *)
(* and a request lingers (draining) only while it holds a quarantined      *)
(* buffer, so lingering requests never outnumber the pool.                 *)
LeakBounded ==
    /\ Cardinality(LeakedBuffers) <= MaxLeaked
    /\ \A r \in Requests : req[r] = "draining" =>
          \E b \in Buffers : pool[b].owner = r /\ pool[b].st = "quarantined"

(* A failed clean-up is observable: every buffer out of the free pool is  *)
(* held by a request that has not ended, or is on the leak ledger with the *)
(* written-off transfer the client still tracks, so a late completion or   *)
(* ack brings it back.  A quarantined buffer's transfer is tracked.        *)
BuffersAccounted ==
    \A b \in Buffers :
        \/ pool[b] = FreeBuf
        \/ /\ pool[b].owner # None
           /\ req[pool[b].owner] # "ended"
           /\ pool[b].st \in {"held", "ready", "used"} => pool[b].gen = 0 \/ ~Tracked(pool[b].gen)
           /\ pool[b].st \in {"loading", "quarantined"} =>
                 /\ Tracked(pool[b].gen)
                 /\ xfer[pool[b].gen].buf = b
                 /\ xfer[pool[b].gen].req = pool[b].owner
        \/ /\ pool[b].st = "leaked"
           /\ pool[b].owner = None
           /\ Tracked(pool[b].gen)
           /\ xfer[pool[b].gen].st = "leaked"
           /\ xfer[pool[b].gen].buf = b

(***************************************************************************)
(* Liveness                                                                *)
(***************************************************************************)
Quarantined(b) == pool[b].st \in {"quarantined", "leaked"}

(* Under Fairness a quarantined (or written-off) buffer is eventually back *)
(* in the pool ...                                                         *)
QuarantineResolves == \A b \in Buffers : Quarantined(b) ~> pool[b].st = "free"

(* ... and a draining request eventually ends. *)
RequestsDrain == \A r \in Requests : req[r] = "draining" ~> req[r] = "ended"

=============================================================================

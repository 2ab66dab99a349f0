------------------------------ MODULE Tenancy ------------------------------
(***************************************************************************)
(* Tenants, namespaces, read grants, quotas and the upgrade lifecycle of   *)
(* a shared store (design atlas D13).                                       *)
(*                                                                         *)
(* Tenants.  Every request is made by the tenant its credential            *)
(* authenticates; a request whose credential authenticates no tenant is    *)
(* refused before any step here (Unauthorized) and changes nothing, so it  *)
(* is not modelled.                                                         *)
(*                                                                         *)
(* Namespaces.  Tenant t's namespaces are <<t, 1>>, <<t, 2>>, ...: one per *)
(* model or format generation; the first is live from the start.  An      *)
(* object is named by its namespace AND its key: the same key string in    *)
(* two namespaces names two objects.  A namespace is an isolation label,   *)
(* not access control: only its owner writes it, and a tenant reads it     *)
(* only as its owner or under a read grant from the owner (GrantRead,      *)
(* RevokeRead).  That check is separate and always runs.                   *)
(*                                                                         *)
(* Reads.  A read goes Begin (the master checks the grant and gives the    *)
(* reader a lease, expiring at now + TTL, with a ticket naming the reader  *)
(* and the object's location) -> Fetch (the storage node serves the bytes  *)
(* only under such a ticket, before it expires) -> Release.  Renew extends *)
(* the lease, rechecking the grant.  The reader's own check of late bytes  *)
(* and clock error are spec/Lease.tla's; here time is the master's.        *)
(*                                                                         *)
(* Revocation.  RevokeRead ends new reads at once: Begin and Renew check   *)
(* the grant.  A read already granted is not cut off: it may still be      *)
(* served under its lease, which cannot be renewed and so expires at most  *)
(* TTL after the revocation (the read's field `cut` records when its grant *)
(* was revoked).  After that the node serves the reader nothing more.      *)
(*                                                                         *)
(* Quotas (per tenant).  Stored bytes (objects published or being written, *)
(* counted from the allocation: Held), write bandwidth (a token bucket of  *)
(* WriteBurst tokens refilled by WriteRate per tick; a write spends one),  *)
(* and transfers in flight (writes not yet published and reads not yet    *)
(* released: InFlight).  A request over quota is refused and     *)
(* changes nothing.  Every object is one unit of bytes.                    *)
(*                                                                         *)
(* Eviction.  Memory holds Capacity units; when it is full a tenant's      *)
(* write may evict an unleased object (Evict): its own, or another         *)
(* tenant's only while the writer holds less than its Reserve and the      *)
(* victim's owner holds more than its own.  A tenant over its reserve has  *)
(* borrowed memory and only ever evicts its own bytes.                     *)
(*                                                                         *)
(* Upgrade lifecycle of namespace n = <<t, g>> (g > 1), next to the live   *)
(* <<t, g - 1>>: Create (canary: a fraction of the writes go to n) ->      *)
(* PreWarm (hot prefixes are recomputed into n) -> Switch (n is live; the  *)
(* old one is retiring: no writes, AgeOut takes its objects).  On trouble, *)
(* RouteBack (from canary, warming or after the switch): the old namespace *)
(* is live again, n is held: no writes (those in progress are abandoned),  *)
(* its objects kept for inspection, never evicted; Drop lets it retire.    *)
(***************************************************************************)
EXTENDS Integers, FiniteSets

CONSTANTS
    Tenants,       \* tenants
    Generations,   \* namespaces per tenant (model or format generations)
    Upgraders,     \* tenants that may upgrade (the others keep one namespace)
    Keys,          \* object keys (the same key in every namespace)
    Capacity,      \* memory, in units; one object is one unit
    StoreQuota,    \* per tenant: units held (stored or being written)
    Reserve,       \* per tenant: units no other tenant's write evicts it below
    WriteRate,     \* per tenant: write tokens added per tick
    WriteBurst,    \* per tenant: write tokens at most
    TransferQuota, \* per tenant: transfers in flight at most
    TTL,           \* read lease duration, in ticks
    MaxTime,       \* bound on the clock (keeps the model finite)
    None           \* model value: no read, no revocation, no object

ASSUME /\ Generations \in Nat \ {0} /\ Upgraders \subseteq Tenants
       /\ {Capacity, StoreQuota, Reserve, WriteRate, WriteBurst, TransferQuota, TTL, MaxTime}
            \subseteq Nat

VARIABLES
    now,     \* the master's clock
    dir,     \* namespace -> key -> "none" | "pending" | "published"
    phase,   \* namespace -> its lifecycle phase
    grants,  \* namespace -> tenants its owner granted reads to
    tokens,  \* tenant -> write tokens left in its bucket
    read,    \* tenant -> None | its read in progress (one per tenant)
    kept,    \* ghost: namespace -> keys it held when it was routed back from
    robbed   \* ghost: tenants that lost an object to an unfair eviction

vars == <<now, dir, phase, grants, tokens, read, kept, robbed>>

Namespaces == Tenants \X (1..Generations)
Owner(n) == n[1]
Times == 0..MaxTime
Phases == {"none", "canary", "warming", "live", "retiring", "held"}
Writable == {"canary", "warming", "live"}
ReadRec == [ns : Namespaces, key : Keys, src : Namespaces, exp : 0..(MaxTime + TTL),
            ph : {"granted", "served"}, auth : BOOLEAN, cut : Times \cup {None}]

Min(a, b) == IF a < b THEN a ELSE b

CanRead(t, n) == Owner(n) = t \/ t \in grants[n]
Stored(n) == {k \in Keys : dir[n][k] # "none"}
Held(t) == Cardinality(UNION {{n} \X Stored(n) : n \in {m \in Namespaces : Owner(m) = t}})
Used == Cardinality(UNION {{n} \X Stored(n) : n \in Namespaces})
Pending(t) == {<<n, k>> \in Namespaces \X Keys : Owner(n) = t /\ dir[n][k] = "pending"}
InFlight(t) == Cardinality(Pending(t)) + (IF read[t] # None THEN 1 ELSE 0)
Leased(n, k) == \E t \in Tenants : read[t] # None /\ read[t].src = n /\ read[t].key = k
                                   /\ now < read[t].exp
Previous(n) == <<Owner(n), n[2] - 1>>

(***************************************************************************)
(* Guards that the weakened models (Tenancy_Weak_*.cfg) replace.           *)
(***************************************************************************)
\* The object a read of key k in namespace n finds: only n's own.
Lookup(n, k) == IF dir[n][k] = "published" THEN n ELSE None
WeakLookupByKey(n, k) ==
    IF \E m \in Namespaces : dir[m][k] = "published"
    THEN CHOOSE m \in Namespaces : dir[m][k] = "published" ELSE None

\* The storage node serves location <<n, k>> to t only under t's unexpired ticket for it.
NodeAdmits(t, n, k) == /\ read[t] # None /\ read[t].ph = "granted"
                       /\ read[t].src = n /\ read[t].key = k /\ now < read[t].exp
WeakNodeAdmitsAny(t, n, k) == IF read[t] = None THEN TRUE ELSE read[t].ph = "granted"

\* A renewal rechecks the grant.
RenewAdmits(t) == CanRead(t, read[t].ns)
WeakRenewAdmitsAny(t) == TRUE

\* A write is admitted only if the allocation itself stays within every quota.
AdmitWrite(t) == Held(t) < StoreQuota /\ tokens[t] >= 1 /\ InFlight(t) < TransferQuota
WeakAdmitStoredLater(t) == tokens[t] >= 1 /\ InFlight(t) < TransferQuota

\* Eviction for t's write takes t's own object, or one of a tenant over its
\* reserve while t is under its own.
FairEviction(t, n) == Owner(n) = t \/ (Held(t) < Reserve /\ Held(Owner(n)) > Reserve)
MayEvictFor(t, n) == FairEviction(t, n)
WeakEvictAny(t, n) == TRUE

\* Routing back keeps the new namespace's published objects.
DirAfterRouteBack(n) == [k \in Keys |-> IF dir[n][k] = "pending" THEN "none" ELSE dir[n][k]]
WeakRouteBackDeletes(n) == [k \in Keys |-> "none"]

(***************************************************************************)
(* Actions                                                                 *)
(***************************************************************************)
Init ==
    /\ now = 0
    /\ dir = [n \in Namespaces |-> [k \in Keys |-> "none"]]
    /\ phase = [n \in Namespaces |-> IF n[2] = 1 THEN "live" ELSE "none"]
    /\ grants = [n \in Namespaces |-> {}]
    /\ tokens = [t \in Tenants |-> WriteBurst]
    /\ read = [t \in Tenants |-> None]
    /\ kept = [n \in Namespaces |-> {}]
    /\ robbed = {}

(* The clock advances one tick; every bucket gains WriteRate tokens. *)
Tick ==
    /\ now < MaxTime
    /\ now' = now + 1
    /\ tokens' = [t \in Tenants |-> Min(WriteBurst, tokens[t] + WriteRate)]
    /\ UNCHANGED <<dir, phase, grants, read, kept, robbed>>

(* The owner of n grants t reads of n. *)
GrantRead(n, t) ==
    /\ phase[n] # "none"
    /\ Owner(n) # t
    /\ t \notin grants[n]
    /\ grants' = [grants EXCEPT ![n] = @ \cup {t}]
    /\ read' = IF read[t] # None /\ read[t].ns = n
               THEN [read EXCEPT ![t].cut = None] ELSE read
    /\ UNCHANGED <<now, dir, phase, tokens, kept, robbed>>

(* The owner of n revokes t's grant: new reads end now; t's read of n in   *)
(* progress keeps its lease and records when its grant ended.              *)
RevokeRead(n, t) ==
    /\ t \in grants[n]
    /\ grants' = [grants EXCEPT ![n] = @ \ {t}]
    /\ read' = IF read[t] # None /\ read[t].ns = n
               THEN [read EXCEPT ![t].cut = now] ELSE read
    /\ UNCHANGED <<now, dir, phase, tokens, kept, robbed>>

(* The master grants t a read of key k in namespace n: t owns n or holds a *)
(* grant, the transfer fits t's in-flight quota, and n has the object (a   *)
(* miss changes nothing).                                                  *)
Begin(t, n, k) ==
    /\ read[t] = None
    /\ phase[n] # "none"
    /\ CanRead(t, n)
    /\ InFlight(t) < TransferQuota
    /\ Lookup(n, k) # None
    /\ read' = [read EXCEPT ![t] = [ns |-> n, key |-> k, src |-> Lookup(n, k), exp |-> now + TTL,
                                    ph |-> "granted", auth |-> CanRead(t, n), cut |-> None]]
    /\ UNCHANGED <<now, dir, phase, grants, tokens, kept, robbed>>

(* A storage node serves the bytes at location <<n, k>> to t. *)
Fetch(t, n, k) ==
    /\ NodeAdmits(t, n, k)
    /\ dir[n][k] = "published"
    /\ read' = [read EXCEPT ![t] =
                  IF read[t] # None /\ read[t].src = n /\ read[t].key = k
                  THEN [read[t] EXCEPT !.ph = "served"]
                  ELSE [ns |-> n, key |-> k, src |-> n, exp |-> now, ph |-> "served",
                        auth |-> CanRead(t, n), cut |-> None]]
    /\ UNCHANGED <<now, dir, phase, grants, tokens, kept, robbed>>

(* t renews its unexpired lease before the bytes are served. *)
Renew(t) ==
    /\ read[t] # None
    /\ read[t].ph = "granted"
    /\ now < read[t].exp
    /\ RenewAdmits(t)
    /\ read' = [read EXCEPT ![t].exp = now + TTL]
    /\ UNCHANGED <<now, dir, phase, grants, tokens, kept, robbed>>

(* t is done with its read (served or abandoned); its lease ends. *)
Release(t) ==
    /\ read[t] # None
    /\ read' = [read EXCEPT ![t] = None]
    /\ UNCHANGED <<now, dir, phase, grants, tokens, kept, robbed>>

(* The owner starts writing key k into n: n takes writes, k is absent,     *)
(* memory has room and the allocation is within t's quotas.               *)
WriteStart(t, n, k) ==
    /\ Owner(n) = t
    /\ phase[n] \in Writable
    /\ dir[n][k] = "none"
    /\ Used < Capacity
    /\ AdmitWrite(t)
    /\ dir' = [dir EXCEPT ![n][k] = "pending"]
    /\ tokens' = [tokens EXCEPT ![t] = @ - 1]
    /\ UNCHANGED <<now, phase, grants, read, kept, robbed>>

(* The write is published (spec/Publish.tla's PutEnd). *)
WriteEnd(n, k) ==
    /\ dir[n][k] = "pending"
    /\ dir' = [dir EXCEPT ![n][k] = "published"]
    /\ UNCHANGED <<now, phase, grants, tokens, read, kept, robbed>>

(* The write is abandoned (spec/Publish.tla's PutRevoke or                *)
(* ReclaimAbandoned): its allocation is freed.                             *)
WriteAbort(n, k) ==
    /\ dir[n][k] = "pending"
    /\ dir' = [dir EXCEPT ![n][k] = "none"]
    /\ UNCHANGED <<now, phase, grants, tokens, read, kept, robbed>>

(* The owner removes an unleased object; a held namespace keeps its own. *)
Remove(n, k) ==
    /\ dir[n][k] = "published"
    /\ phase[n] # "held"
    /\ ~Leased(n, k)
    /\ dir' = [dir EXCEPT ![n][k] = "none"]
    /\ UNCHANGED <<now, phase, grants, tokens, read, kept, robbed>>

(* Memory is full and t could write: an unleased object is evicted for t. *)
Evict(t, n, k) ==
    /\ Used = Capacity
    /\ AdmitWrite(t)
    /\ dir[n][k] = "published"
    /\ phase[n] # "held"
    /\ ~Leased(n, k)
    /\ MayEvictFor(t, n)
    /\ dir' = [dir EXCEPT ![n][k] = "none"]
    /\ robbed' = IF FairEviction(t, n) THEN robbed ELSE robbed \cup {Owner(n)}
    /\ UNCHANGED <<now, phase, grants, tokens, read, kept>>

(* A retiring namespace ages out: its unleased objects go. *)
AgeOut(n, k) ==
    /\ phase[n] = "retiring"
    /\ dir[n][k] = "published"
    /\ ~Leased(n, k)
    /\ dir' = [dir EXCEPT ![n][k] = "none"]
    /\ UNCHANGED <<now, phase, grants, tokens, read, kept, robbed>>

(* An upgrading tenant creates the next generation's namespace as a canary. *)
Create(n) ==
    /\ Owner(n) \in Upgraders
    /\ n[2] > 1
    /\ phase[n] = "none"
    /\ phase[Previous(n)] = "live"
    /\ phase' = [phase EXCEPT ![n] = "canary"]
    /\ UNCHANGED <<now, dir, grants, tokens, read, kept, robbed>>

(* The canary is healthy: hot prefixes are recomputed into n. *)
PreWarm(n) ==
    /\ phase[n] = "canary"
    /\ phase' = [phase EXCEPT ![n] = "warming"]
    /\ UNCHANGED <<now, dir, grants, tokens, read, kept, robbed>>

(* n takes all the traffic; the previous namespace retires. *)
Switch(n) ==
    /\ phase[n] = "warming"
    /\ phase' = [phase EXCEPT ![n] = "live", ![Previous(n)] = "retiring"]
    /\ UNCHANGED <<now, dir, grants, tokens, read, kept, robbed>>

(* Trouble: traffic goes back to the previous namespace; n takes no more   *)
(* writes (those in progress are abandoned) and keeps its objects.         *)
RouteBack(n) ==
    /\ n[2] > 1
    /\ \/ phase[n] \in {"canary", "warming"} /\ phase[Previous(n)] = "live"
       \/ phase[n] = "live" /\ phase[Previous(n)] = "retiring"
    /\ phase' = [phase EXCEPT ![n] = "held", ![Previous(n)] = "live"]
    /\ dir' = [dir EXCEPT ![n] = DirAfterRouteBack(n)]
    /\ kept' = [kept EXCEPT ![n] = {k \in Keys : dir[n][k] = "published"}]
    /\ UNCHANGED <<now, grants, tokens, read, robbed>>

(* Inspection is over: the held namespace retires and ages out. *)
Drop(n) ==
    /\ phase[n] = "held"
    /\ phase' = [phase EXCEPT ![n] = "retiring"]
    /\ kept' = [kept EXCEPT ![n] = {}]
    /\ UNCHANGED <<now, dir, grants, tokens, read, robbed>>

Next ==
    \/ Tick
    \/ \E n \in Namespaces, t \in Tenants : GrantRead(n, t) \/ RevokeRead(n, t)
    \/ \E t \in Tenants, n \in Namespaces, k \in Keys :
          Begin(t, n, k) \/ Fetch(t, n, k) \/ WriteStart(t, n, k) \/ Evict(t, n, k)
    \/ \E t \in Tenants : Renew(t) \/ Release(t)
    \/ \E n \in Namespaces, k \in Keys : WriteEnd(n, k) \/ WriteAbort(n, k) \/ Remove(n, k) \/ AgeOut(n, k)
    \/ \E n \in Namespaces : Create(n) \/ PreWarm(n) \/ Switch(n) \/ RouteBack(n) \/ Drop(n)

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants                                                              *)
(***************************************************************************)
TypeOK ==
    /\ now \in Times
    /\ dir \in [Namespaces -> [Keys -> {"none", "pending", "published"}]]
    /\ phase \in [Namespaces -> Phases]
    /\ grants \in [Namespaces -> SUBSET Tenants]
    /\ \A n \in Namespaces : Owner(n) \notin grants[n]
    /\ tokens \in [Tenants -> Int]
    /\ read \in [Tenants -> {None} \cup ReadRec]
    /\ kept \in [Namespaces -> SUBSET Keys]
    /\ robbed \subseteq Tenants
    /\ Used <= Capacity
    \* every tenant has exactly one live namespace
    /\ \A t \in Tenants : Cardinality({n \in Namespaces : Owner(n) = t /\ phase[n] = "live"}) = 1

(* Every read was authorized when the store let it start: its tenant owned *)
(* the namespace or held a grant on it.                                    *)
NoReadWithoutGrant == \A t \in Tenants : read[t] # None => read[t].auth

(* A read of a namespace its tenant may no longer read was granted before  *)
(* the revocation, and its lease ends no later than TTL after it: no byte  *)
(* of that namespace is served to the tenant after that.                   *)
RevokedGrantsEndReads ==
    \A t \in Tenants : read[t] # None /\ ~CanRead(t, read[t].ns) =>
        read[t].cut # None /\ read[t].exp <= read[t].cut + TTL

(* Held bytes, write tokens and transfers in flight stay within quota. *)
QuotasNeverExceeded ==
    \A t \in Tenants : Held(t) <= StoreQuota /\ tokens[t] >= 0 /\ InFlight(t) <= TransferQuota

(* No tenant lost an object to an eviction for another tenant's write      *)
(* unless it held more than its reserve and the writer less than its own.  *)
EvictionRespectsTenants == robbed = {}

(* A read of namespace n finds only n's objects, whatever the keys. *)
NamespacesNeverCross == \A t \in Tenants : read[t] # None => read[t].src = read[t].ns

(* A namespace routed back from takes no writes and keeps every object it  *)
(* had.                                                                    *)
RouteBackKeepsObjects ==
    \A n \in Namespaces : phase[n] = "held" =>
        {k \in Keys : dir[n][k] = "published"} = kept[n] /\ \A k \in Keys : dir[n][k] # "pending"

(* An unexpired lease's object stays (the lease rule of spec/Lease.tla). *)
NoReclaimUnderLease ==
    \A t \in Tenants : read[t] # None /\ now < read[t].exp => dir[read[t].src][read[t].key] = "published"

=============================================================================

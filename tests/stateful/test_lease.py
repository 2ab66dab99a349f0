"""Read leases far beyond what TLC enumerates: a dozen readers whose requests
queue, whose replies and transfers take random numbers of ticks, whose clocks
are off by any amount within the bound, who renew or not; objects of different
sizes put into and reclaimed from shared regions; clients removing objects; and
eviction by the watermark policy whenever usage passes it. Every invariant of
spec/Lease.tla is checked after every step, every refusal is checked to change
nothing, and every accepted transfer is checked against the master's clock: its
lease was still unexpired when it completed."""

from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto import errors
from kvproto.statemachines import lease as L

KEYS = [f"k{i}" for i in range(12)]
SLOTS = [f"s{i}" for i in range(8)]
READERS = [f"r{i}" for i in range(12)]
SLOT_BYTES = 8
CAPACITY = SLOT_BYTES * len(SLOTS)


class LeaseSystem(RuleBasedStateMachine):
    @initialize(ttl=st.integers(1, 40), max_skew=st.integers(0, 6))
    def start(self, ttl, max_skew):
        self.sys = L.System.initial(KEYS, SLOTS, READERS, ttl, max_skew)
        self.accepted = self.rejected = self.evicted = self.refused_leased = self.clobbered = 0
        self.takeovers = self.refused_inherited = 0
        self.old_leases = {}      # ghost: expiry of leases granted before the last takeover

    # -- helpers -----------------------------------------------------------

    def master(self, ev):
        """Step the master inside the system; a refusal must change nothing."""
        before = self.sys
        after, effects = before.master(ev)
        refused = bool(effects) and isinstance(effects[0], L.Refused)
        if refused:
            assert len(effects) == 1 and after is before
        self.sys = after
        return effects, refused

    def readers_in(self, *phases):
        return [r for r, x in self.sys.readers.items() if x is not None and x.phase in phases]

    def pick(self, data, *phases):
        readers = self.readers_in(*phases)
        return data.draw(st.sampled_from(readers)) if readers else None

    def idle(self):
        return [r for r, x in self.sys.readers.items() if x is None]

    # -- time ----------------------------------------------------------------

    @rule(dt=st.integers(1, 8))
    def tick(self, dt):
        before = self.sys.table
        self.sys = L.sys_tick(self.sys, before.now + dt)
        now = self.sys.table.now
        assert now == before.now + dt
        assert all(l.expires > now for l in self.sys.table.leases.values())
        ended = {h for h, l in before.leases.items() if l.expires <= now}
        assert ended.isdisjoint(self.sys.table.leases)
        assert self.sys.table.objects == before.objects      # expiry deletes nothing

    @rule()
    def clock_never_goes_back(self):
        now = self.sys.table.now
        if now:
            _, refused = self.master(L.Tick(now - 1))
            assert refused

    # -- objects -------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), slot=st.sampled_from(SLOTS),
          size=st.integers(SLOT_BYTES // 2, SLOT_BYTES), data=st.data())
    def put(self, key, slot, size, data):
        """Mostly into a free slot, sometimes anywhere (refused if taken)."""
        t = self.sys.table
        free = self.sys.free_slots()
        if free and data.draw(st.integers(0, 3)):
            slot = data.draw(st.sampled_from(free))
        effects, refused = self.master(L.Put(key, slot, size))
        assert refused == (key in t.objects or slot in t.regions)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        t = self.sys.table
        effects, refused = self.master(L.Remove(key))
        if key not in t.objects:
            assert refused and isinstance(effects[0].error, errors.KeyNotFound)
        elif L.is_leased(t, key):
            assert refused and isinstance(effects[0].error, errors.ObjectLeased)
            self.refused_leased += 1
        else:
            assert not refused and key not in self.sys.table.objects

    @rule()
    def takeover(self):
        """A new master takes over: it knows no lease of the old one, keeps
        every object, and refuses to reclaim any of them for one TTL."""
        before = self.sys.table
        self.old_leases.update((h, l.expires) for h, l in before.leases.items())
        self.sys = L.sys_takeover(self.sys)
        t = self.sys.table
        assert not t.leases and set(t.objects) == set(before.objects)
        assert all(L.is_leased(t, k) for k in t.objects)
        assert t.quiet_until == t.now + t.ttl
        self.takeovers += 1

    @rule(key=st.sampled_from(KEYS))
    def inherited_object_is_not_reclaimed_while_quiet(self, key):
        t = self.sys.table
        obj = t.objects.get(key)
        if obj is None or not obj.inherited or not L.inherited_quiet(t):
            return
        for ev in (L.Remove(key), L.Evict(key)):
            effects, refused = self.master(ev)
            assert refused and isinstance(effects[0].error, errors.ObjectLeased)
        self.refused_inherited += 1

    @rule(data=st.data())
    def evicting_a_leased_object_is_refused(self, data):
        if not self.sys.table.by_key:
            return
        key = data.draw(st.sampled_from(sorted(self.sys.table.by_key)))
        effects, refused = self.master(L.Evict(key))
        assert refused and isinstance(effects[0].error, errors.ObjectLeased)

    @rule(hw=st.sampled_from([0.5, 0.75, 0.9]), frac=st.sampled_from([0.05, 0.2, 0.5]))
    def memory_pressure(self, hw, frac):
        """The watermark policy picks LRU unleased objects; evicting them succeeds."""
        t = self.sys.table
        plan = L.plan_eviction(t.used, CAPACITY, L.eviction_candidates(t),
                               high_watermark=hw, free_fraction=frac)
        if not L.over_watermark(t.used, CAPACITY, hw):
            assert plan.keys == ()
            return
        for key in plan.keys:
            assert not L.is_leased(self.sys.table, key)
            effects, refused = self.master(L.Evict(key))
            assert not refused and effects[0].evicted
            self.evicted += 1
        if plan.short:
            assert list(L.eviction_candidates(self.sys.table)) == []
        else:
            assert self.sys.table.used <= (hw - frac) * CAPACITY + 1e-9

    @rule(key=st.sampled_from(KEYS))
    def evict_when_full(self, key):
        """The spec's Evict: any unleased object, once no slot is free."""
        if self.sys.free_slots():
            assert L.sys_evict(self.sys, key) is None
            return
        new = L.sys_evict(self.sys, key)
        assert (new is not None) == (key in self.sys.table.objects
                                     and not L.is_leased(self.sys.table, key))
        if new is not None:
            self.sys = new

    # -- readers -------------------------------------------------------------

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def request(self, data, key):
        """Mostly of a cached key (a hit), sometimes of any (perhaps a miss)."""
        idle = self.idle()
        if not idle:
            return
        r = data.draw(st.sampled_from(idle))
        cached = sorted(self.sys.table.objects)
        if cached and data.draw(st.integers(0, 3)):
            key = data.draw(st.sampled_from(cached))
        self.sys = L.sys_request(self.sys, r, key)

    def do_grant(self, r):
        key = self.sys.readers[r].key
        cached = key in self.sys.table.objects
        self.old_leases.pop(r, None)
        self.sys = L.sys_grant(self.sys, r)
        if cached:
            lease = self.sys.table.leases[r]
            assert lease.expires == self.sys.table.now + self.sys.table.ttl
            assert self.sys.readers[r].region == lease.region
        else:
            assert self.sys.readers[r] is None and r not in self.sys.table.leases

    def do_reply(self, r):
        base = self.sys.readers[r].base
        self.sys = L.sys_reply(self.sys, r)
        assert self.sys.readers[r].base == base     # the deadline runs from the send

    def do_renew(self, r):
        held = r in self.sys.table.leases
        new = L.sys_renew(self.sys, r)
        assert (new is not None) == held
        if new is None:
            _, refused = self.master(L.Renew(r))
            assert refused
        else:
            assert new.table.leases[r].expires == new.table.now + new.table.ttl
            assert new.readers[r].base == new.table.now
            self.sys = new

    def do_complete(self, r, d):
        self.sys = L.sys_complete(self.sys, r, d)
        read = self.sys.readers[r]
        if read.phase is L.Phase.ACCEPTED:
            # The master's truth: the lease was unexpired when the transfer
            # completed (granted by this master, or by one it took over from).
            lease = self.sys.table.leases.get(r)
            expires = lease.expires if lease is not None else self.old_leases.get(r, 0)
            assert expires > self.sys.table.now
            assert not read.clobbered
            self.accepted += 1
        else:
            self.rejected += 1
            self.clobbered += read.clobbered

    def do_release(self, r):
        objects = self.sys.table.objects
        self.sys = L.sys_release(self.sys, r)
        assert self.sys.readers[r] is None and r not in self.sys.table.leases
        assert self.sys.table.objects == objects     # release deletes nothing

    @rule(data=st.data())
    def grant(self, data):
        r = self.pick(data, L.Phase.ASKED)
        if r is not None:
            self.do_grant(r)

    @rule(data=st.data())
    def reply(self, data):
        r = self.pick(data, L.Phase.GRANTED)
        if r is not None:
            self.do_reply(r)

    @rule(data=st.data())
    def renew(self, data):
        r = self.pick(data, L.Phase.TRANSFERRING)
        if r is not None:
            self.do_renew(r)

    @rule(data=st.data())
    def complete(self, data):
        r = self.pick(data, L.Phase.TRANSFERRING)
        if r is not None:
            self.do_complete(r, self.clock_error(data))

    @rule(data=st.data())
    def release(self, data):
        r = self.pick(data, L.Phase.ACCEPTED, L.Phase.REJECTED)
        if r is not None:
            self.do_release(r)

    def clock_error(self, data):
        return data.draw(st.integers(-self.sys.max_skew, self.sys.max_skew), label="clock error")

    @rule(data=st.data(), queued=st.integers(0, 6), replied=st.integers(0, 4),
          transfer=st.lists(st.sampled_from(["tick", "renew", "remove"]), max_size=30),
          release=st.booleans())
    def whole_read(self, data, queued, replied, transfer, release):
        """One read from request to release, ticking while it queues, while its
        reply travels and while it transfers, during which it may renew and a
        client may try to remove the object (refused while the lease is
        unexpired); the invariants are checked after every step."""
        idle, cached = self.idle(), sorted(self.sys.table.objects)
        if not idle or not cached:
            return
        r, key = data.draw(st.sampled_from(idle)), data.draw(st.sampled_from(cached))
        self.sys = L.sys_request(self.sys, r, key)
        self.ticks(queued)
        self.do_grant(r)
        self.ticks(replied)
        self.do_reply(r)
        for step in transfer:
            if step == "tick":
                self.ticks(1)
            elif step == "renew":
                self.do_renew(r)
            else:
                self.remove(key)
            self.spec_invariants_hold()
        self.do_complete(r, self.clock_error(data))
        self.spec_invariants_hold()
        if release:
            self.do_release(r)

    def ticks(self, n):
        for _ in range(n):
            self.tick(1)
            self.spec_invariants_hold()

    @invariant()
    def spec_invariants_hold(self):
        assert L.BINDING.violated(self.sys) == []

    def teardown(self):
        event(f"accepted {min(self.accepted, 5)}")
        event(f"rejected {min(self.rejected, 5)}")
        event(f"evicted {min(self.evicted, 5)}")
        event(f"rejected with the region reclaimed {min(self.clobbered, 2)}")
        event(f"remove refused under lease {min(self.refused_leased, 5)}")
        event(f"takeovers {min(self.takeovers, 2)}")
        event(f"inherited object kept while quiet {min(self.refused_inherited, 2)}")


TestLeaseSystem = LeaseSystem.TestCase

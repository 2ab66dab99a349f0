"""The publish protocol far beyond what TLC enumerates: dozens of keys, writers
that crash or stall at any point, timeouts that fire on slow writers, objects of
different sizes, and segments lost with their bytes. Every invariant of
spec/Publish.tla is checked after every step, and every refusal is checked to
change nothing."""

from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvproto import errors
from kvproto.statemachines import publish as P

KEYS = [f"key-{i}".encode() for i in range(24)]
WRITERS = [f"w{i}" for i in range(6)]
SEGMENTS = [f"s{i}" for i in range(5)]
CAPACITY = 64


def free_offset(sys: P.System, segment: str, length: int):
    """First fit over the directory's extents: what an allocator could choose."""
    spans = sorted((r.offset, r.offset + r.length)
                   for rec in sys.directory.objects.values()
                   for r in rec.replicas if r.segment == segment)
    cursor = 0
    for start, end in spans:
        if start - cursor >= length:
            return cursor
        cursor = max(cursor, end)
    return cursor if CAPACITY - cursor >= length else None


class PublishSystem(RuleBasedStateMachine):
    @initialize(replicas=st.integers(1, 3))
    def start(self, replicas):
        self.replicas = replicas
        self.sys = P.System.initial({s: CAPACITY for s in SEGMENTS}, WRITERS)
        self.published = 0
        self.steps = 0
        self.most_objects = 0

    def busy(self):
        return [w for w, a in self.sys.writers.items() if a is not None]

    @rule(w=st.sampled_from(WRITERS), key=st.sampled_from(KEYS),
          length=st.integers(1, 12), data=st.data())
    def put_start(self, w, key, length, data):
        live = [s for s in SEGMENTS if self.sys.directory.segments[s].live]
        if self.sys.writers[w] is not None or len(live) < self.replicas:
            return
        segs = data.draw(st.lists(st.sampled_from(live), min_size=self.replicas,
                                  max_size=self.replicas, unique=True))
        placement = []
        for s in segs:
            offset = free_offset(self.sys, s, length)
            if offset is None:
                return
            placement.append(P.Replica(s, offset, length))
        new = P.sys_put_start(self.sys, w, key, tuple(placement))
        if new is None:
            assert key in self.sys.directory.objects
        else:
            assert new.directory.objects[key].status is P.Status.PENDING
            self.sys = new

    @rule(w=st.sampled_from(WRITERS), key=st.sampled_from(KEYS),
          length=st.integers(1, 12), data=st.data())
    def whole_put(self, w, key, length, data):
        """A writer that keeps going: PutStart, every WriteReplica, PutEnd."""
        if self.sys.writers[w] is not None:
            return
        self.put_start(w, key, length, data)
        attempt = self.sys.writers[w]
        if attempt is None:
            return
        for r in attempt.replicas:
            self.sys = P.sys_write_replica(self.sys, w, r.segment)
        self.sys = P.sys_put_end(self.sys, w)
        assert self.sys.directory.objects[key].status is P.Status.PUBLISHED
        self.published += 1

    @precondition(lambda self: self.busy())
    @rule(data=st.data())
    def write_replica(self, data):
        w = data.draw(st.sampled_from(self.busy()))
        attempt = self.sys.writers[w]
        segment = data.draw(st.sampled_from([r.segment for r in attempt.replicas]))
        new = P.sys_write_replica(self.sys, w, segment)
        if new is not None:
            self.sys = new

    @precondition(lambda self: self.busy())
    @rule(data=st.data())
    def put_end(self, data):
        w = data.draw(st.sampled_from(self.busy()))
        attempt = self.sys.writers[w]
        new = P.sys_put_end(self.sys, w)
        if new is None:
            assert not P.writer_may_put_end(attempt)
            return
        record = new.directory.objects.get(attempt.key)
        if record is not None and record.token == attempt.token:
            assert record.status is P.Status.PUBLISHED
            self.published += 1
        self.sys = new

    @precondition(lambda self: self.busy())
    @rule(data=st.data(), crash=st.booleans())
    def writer_gives_up(self, data, crash):
        w = data.draw(st.sampled_from(self.busy()))
        action = P.sys_writer_crash if crash else P.sys_put_revoke
        self.sys = action(self.sys, w)
        assert self.sys.writers[w] is None

    @rule(key=st.sampled_from(KEYS))
    def reclaim_abandoned(self, key):
        new = P.sys_reclaim_abandoned(self.sys, key)
        if new is not None:
            assert key not in new.directory.objects
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def read_begin(self, key):
        new = P.sys_read_begin(self.sys, key)
        record = self.sys.directory.objects.get(key)
        readable = record is not None and record.status is P.Status.PUBLISHED
        assert (new is not None) == readable
        if new is not None:
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def read_end(self, key):
        new = P.sys_read_end(self.sys, key)
        if new is not None:
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        new = P.sys_remove(self.sys, key)
        if new is not None:
            assert key not in new.directory.objects
            self.sys = new

    @precondition(lambda self: sum(l.live for l in self.sys.directory.segments.values()) > 3)
    @rule(segment=st.sampled_from(SEGMENTS))
    def segment_lost(self, segment):
        new = P.sys_segment_lost(self.sys, segment)
        if new is not None:
            assert not new.directory.segments[segment].live
            self.sys = new

    @rule(key=st.sampled_from(KEYS), token=st.integers(0, 50))
    def stale_events_change_nothing(self, key, token):
        """Refused master events return the same directory and one Refused effect."""
        d = self.sys.directory
        record = d.objects.get(key)
        if record is not None and record.token == token:
            return
        for event in (P.PutEnd(key, token), P.PutRevoke(key, token),
                      P.ReclaimAbandoned(key, token), P.ReadEnd(key, token)):
            new, effects = P.master_step(d, event)
            assert new is d
            assert len(effects) == 1 and isinstance(effects[0], P.Refused)
            assert isinstance(effects[0].error, errors.StaleToken)

    @invariant()
    def spec_invariants_hold(self):
        assert P.BINDING.violated(self.sys) == []
        self.steps += 1
        self.most_objects = max(self.most_objects, len(self.sys.directory.objects))

    def teardown(self):
        # Shown by --hypothesis-show-statistics: how far the runs got.
        event(f"steps >= {self.steps // 25 * 25}")
        event(f"objects at once >= {self.most_objects // 5 * 5}")
        event(f"publishes >= {self.published // 5 * 5}")


TestPublishSystem = PublishSystem.TestCase

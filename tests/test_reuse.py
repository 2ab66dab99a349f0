"""The contiguous-reuse rule: the usable prefix is the longest run
of chunks from the start whose every rank loaded; anything after the first gap
is recomputed, and loads that did not finish fall under the quarantine rule."""

import pytest
from hypothesis import given, strategies as st

from kvproto.statemachines import timeout as T
from kvproto.statemachines.reuse import (
    UNFINISHED, Outcome, RankLoad, chunk_loaded, plan_reuse)

OUTCOMES = list(Outcome)


@st.composite
def chunk_loads(draw, max_chunks=10):
    """(chunks, ranks): each chunk a RankLoad (ranks == 1, sometimes) or a
    {rank: RankLoad} with some ranks possibly absent; every buffer distinct."""
    ranks = draw(st.integers(1, 4))
    n = draw(st.integers(0, max_chunks))
    # Bias towards loaded so that long prefixes occur.
    outcome = st.one_of(st.just(Outcome.LOADED), st.sampled_from(OUTCOMES))
    chunks = []
    for i in range(n):
        loads = {}
        for r in range(ranks):
            if draw(st.integers(0, 9)) == 0:
                continue  # this rank's object is missing altogether
            o = draw(outcome)
            buffer = None if o is Outcome.MISSING and draw(st.booleans()) else (i, r)
            loads[r] = RankLoad(o, buffer)
        if ranks == 1 and 0 in loads and draw(st.booleans()):
            chunks.append(loads[0])
        else:
            chunks.append(loads)
    return chunks, ranks


def as_ranks(chunk):
    return {0: chunk} if isinstance(chunk, RankLoad) else chunk


def buffers_of(chunks):
    return {l.buffer for c in chunks for l in as_ranks(c).values() if l.buffer is not None}


@given(chunk_loads())
def test_prefix_holds_only_chunks_whose_every_rank_loaded(case):
    chunks, ranks = case
    plan = plan_reuse(chunks, ranks)
    for i in range(plan.usable):
        loads = as_ranks(chunks[i])
        assert set(loads) == set(range(ranks)), "a chunk with a missing rank was used"
        assert all(l.outcome is Outcome.LOADED for l in loads.values())


@given(chunk_loads())
def test_prefix_never_crosses_a_gap_and_is_maximal(case):
    chunks, ranks = case
    plan = plan_reuse(chunks, ranks)
    gaps = [i for i, c in enumerate(chunks) if not chunk_loaded(as_ranks(c), ranks)]
    assert plan.usable == (gaps[0] if gaps else len(chunks))
    assert plan.recompute == tuple(range(plan.usable, len(chunks)))


@given(chunk_loads(), st.data())
def test_successes_after_a_gap_never_count(case, data):
    """Whatever happens after the first gap, the usable prefix is the same."""
    chunks, ranks = case
    plan = plan_reuse(chunks, ranks)
    if plan.usable >= len(chunks):
        return
    changed = list(chunks)
    for i in range(plan.usable + 1, len(chunks)):
        changed[i] = {r: RankLoad(Outcome.LOADED, ("other", i, r)) for r in range(ranks)}
    assert plan_reuse(changed, ranks).usable == plan.usable


@given(chunk_loads(), st.data())
def test_a_load_that_succeeds_never_shrinks_the_prefix(case, data):
    chunks, ranks = case
    if not chunks:
        return
    i = data.draw(st.integers(0, len(chunks) - 1))
    r = data.draw(st.integers(0, ranks - 1))
    better = list(chunks)
    loads = dict(as_ranks(chunks[i]))
    loads[r] = RankLoad(Outcome.LOADED, ("new", i, r))
    better[i] = loads
    assert plan_reuse(better, ranks).usable >= plan_reuse(chunks, ranks).usable


@given(chunk_loads())
def test_every_buffer_has_exactly_one_fate(case):
    chunks, ranks = case
    plan = plan_reuse(chunks, ranks)
    assert plan.keep | plan.release | plan.quarantine == buffers_of(chunks)
    assert not (plan.keep & plan.release or plan.keep & plan.quarantine
                or plan.release & plan.quarantine)
    unfinished = {l.buffer for c in chunks for l in as_ranks(c).values()
                  if l.outcome in UNFINISHED}
    assert plan.quarantine == unfinished, "a load that may still write was not quarantined"
    kept = {l.buffer for c in chunks[:plan.usable] for l in as_ranks(c).values()}
    assert plan.keep == kept


def test_chunk_2_fails_chunk_3_succeeds():
    """Chunk 2 fails to load and chunk 3 succeeds: only chunks 0 and 1 are
    reused; chunk 3's loaded buffer is released, chunks 2 and 3 recomputed."""
    L, F = Outcome.LOADED, Outcome.FAILED
    chunks = [RankLoad(L, "b0"), RankLoad(L, "b1"), RankLoad(F, "b2"), RankLoad(L, "b3")]
    plan = plan_reuse(chunks)
    assert plan.usable == 2 and plan.tokens(256) == 512
    assert plan.recompute == (2, 3)
    assert plan.keep == {"b0", "b1"} and plan.release == {"b2", "b3"} and not plan.quarantine


def test_chunk_2_times_out_chunk_3_succeeds():
    """A timed-out chunk's buffer is quarantined, not released: the load may
    still complete into it."""
    L = Outcome.LOADED
    chunks = [RankLoad(L, "b0"), RankLoad(L, "b1"), RankLoad(Outcome.TIMED_OUT, "b2"),
              RankLoad(L, "b3"), RankLoad(Outcome.IN_FLIGHT, "b4")]
    plan = plan_reuse(chunks)
    assert plan.usable == 2
    assert plan.quarantine == {"b2", "b4"} and plan.release == {"b3"}


def test_one_rank_missing_stops_the_prefix():
    """A chunk stored as 4 per-rank objects with one missing is not
    reusable, nor is anything after it, even though 3 of 4 objects exist."""
    L = Outcome.LOADED
    full = lambda i: {r: RankLoad(L, f"c{i}r{r}") for r in range(4)}
    holed = {r: RankLoad(L, f"c1r{r}") for r in (0, 1, 3)}
    plan = plan_reuse([full(0), holed, full(2)], ranks=4)
    assert plan.usable == 1
    assert plan.recompute == (1, 2)
    assert plan.release == {f"c1r{r}" for r in (0, 1, 3)} | {f"c2r{r}" for r in range(4)}


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        plan_reuse([{5: RankLoad(Outcome.LOADED, "b")}], ranks=2)
    with pytest.raises(ValueError):
        plan_reuse([RankLoad(Outcome.LOADED, "b"), RankLoad(Outcome.LOADED, "b")])
    with pytest.raises(ValueError):
        plan_reuse([RankLoad(Outcome.LOADED)])
    with pytest.raises(ValueError):
        plan_reuse([], ranks=0)


def test_outcomes_read_from_the_pool_machine():
    """The pool's buffer states give the outcomes: a timed-out load's buffer
    is quarantined by the plan and by the pool alike."""
    pool = T.new_pool(["b0", "b1", "b2", "b3"])
    pool, _ = T.pool_step(pool, T.StartRequest("r"))
    gens = []
    for b in ["b0", "b1", "b2", "b3"]:
        pool, _ = T.pool_step(pool, T.Acquire("r", b))
        pool, (issued,) = T.pool_step(pool, T.Issue("r", b))
        gens.append(issued.gen)
    for g in (gens[0], gens[1], gens[3]):
        pool, _ = T.pool_step(pool, T.Complete(g, pool.transfers[g].buffer))
    pool, _ = T.pool_step(pool, T.Timeout(gens[2]))
    chunks = [RankLoad(T.load_outcome(pool, b), b) for b in ["b0", "b1", "b2", "b3"]]
    plan = plan_reuse(chunks)
    assert plan.usable == 2 and plan.quarantine == {"b2"} and plan.release == {"b3"}
    _, effects = T.pool_step(pool, T.Acquire("r", "b2"))
    assert isinstance(effects[0].error, T.errors.BufferQuarantined)

"""Prefix identity and namespaces: chained chunk keys, per-rank and
per-layer-group objects, the contiguous usable prefix, and namespaces whose
keys never meet."""

import attrs
import pytest
from hypothesis import assume, given, strategies as st

from kvproto.engines.prefix import (
    MAX_TOKEN, Chunk, Namespace, chain, chunk_hashes, usable_chunks, usable_tokens)
from kvproto.gpu.layout import KVLayout

tokens_st = st.lists(st.integers(0, MAX_TOKEN), max_size=40)
text = st.text(max_size=6)
namespaces = st.builds(Namespace, model=st.text(min_size=1, max_size=6), revision=text,
                       layout=text, tenant=text, salt=text, ranks=st.integers(1, 3),
                       layer_groups=st.integers(1, 3))
FIELDS = ("model", "revision", "layout", "tenant", "salt", "ranks", "layer_groups")

NS = Namespace("llama-3-8b", "rev-a", KVLayout(32, 8, 128).tag(rank=False))


def all_keys(ns, tokens, chunk_size=4):
    return {k for c in ns.chunks(tokens, chunk_size) for k in ns.object_keys(c)}


# --- the chained hash ----------------------------------------------------------

@given(tokens_st, st.integers(1, 8))
def test_chunks_cover_the_tokens_in_order(tokens, size):
    chunks = NS.chunks(tokens, size)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [t for c in chunks for t in tokens[c.start:c.end]] == tokens
    assert all(c.tokens == size for c in chunks[:-1])
    full = chunk_hashes(NS, tokens, size, partial=False)
    assert full == [c for c in chunks if c.tokens == size]
    assert len(full) == len(tokens) // size


@given(tokens_st, tokens_st, st.integers(1, 8))
def test_a_chunk_key_is_its_whole_prefix(a, b, size):
    """Chunk i of two sequences has the same key exactly when the sequences
    agree up to its end (and the chunk has the same length)."""
    ca, cb = NS.chunks(a, size), NS.chunks(b, size)
    for x, y in zip(ca, cb):
        assert (x.digest == y.digest) == (a[:x.end] == b[:y.end])


@given(tokens_st, st.integers(1, 8))
def test_a_partial_chunk_never_names_a_full_one(tokens, size):
    """The tail's token count is hashed: a prompt ending mid-chunk and a
    longer prompt sharing those tokens have different keys for that chunk."""
    assume(len(tokens) % size)
    short = NS.chunks(tokens, size)
    longer = NS.chunks(tokens + [0] * size, size)
    assert short[-1].tokens < size
    assert short[-1].digest != longer[len(short) - 1].digest
    assert short[:-1] == longer[:len(short) - 1]


def test_chain_is_reproducible_and_checks_its_input():
    c = NS.chunks(range(300))
    assert [x.end for x in c] == [256, 300]          # default chunk size 256, partial tail
    assert c[0].digest == chain(NS.digest, list(range(256)))
    assert c[1].digest == chain(c[0].digest, list(range(256, 300)))
    with pytest.raises(ValueError):
        NS.chunks([MAX_TOKEN + 1])
    with pytest.raises(ValueError):
        NS.chunks([-1])
    with pytest.raises(ValueError):
        NS.chunks([1], chunk_size=0)
    with pytest.raises(ValueError):
        chain(b"short", [1])


# --- namespaces ------------------------------------------------------------------

@given(namespaces, namespaces, tokens_st, tokens_st)
def test_distinct_namespaces_have_disjoint_keys(a, b, ta, tb):
    assume(a != b)
    assert a.digest != b.digest and a.label != b.label
    assert not all_keys(a, ta) & all_keys(b, tb)
    assert a.engine_key("k") != b.engine_key("k")


@given(namespaces, st.sampled_from(FIELDS), st.data())
def test_changing_any_field_changes_every_key(ns, field, data):
    value = getattr(ns, field)
    if isinstance(value, int):
        new = data.draw(st.integers(1, 4).filter(lambda v: v != value))
    else:
        new = data.draw(st.text(max_size=6).filter(lambda v: v != value and (field != "model" or v)))
    other = attrs.evolve(ns, **{field: new})
    tokens = data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=20))
    old = all_keys(ns, tokens)
    assert old and not old & all_keys(other, tokens)
    # the new namespace reads nothing of the old one
    assert usable_chunks(other, other.chunks(tokens, 4), old) == 0


def test_the_namespace_encoding_is_injective_across_field_boundaries():
    """Moving text between adjacent fields is a different namespace."""
    assert Namespace("ab", "c", "x").digest != Namespace("a", "bc", "x").digest
    assert Namespace("m", "", "x", tenant="t", salt="").digest != \
        Namespace("m", "", "x", tenant="", salt="t").digest


LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", tp_size=2)


def test_peer_failure_per_request_salt_is_in_the_key():
    tokens = list(range(512))
    plain = Namespace.of("m", "r1", LAYOUT)
    salted = plain.with_salt("request-secret")
    assert not all_keys(plain, tokens, 256) & all_keys(salted, tokens, 256)
    assert all_keys(salted, tokens, 256) != all_keys(plain.with_salt("other"), tokens, 256)


def test_peer_failure_model_revision_is_in_the_namespace():
    tokens = list(range(512))
    assert not all_keys(Namespace.of("m", "r1", LAYOUT), tokens, 256) & \
        all_keys(Namespace.of("m", "r2", LAYOUT), tokens, 256)


def test_peer_failure_dtype_is_in_the_key():
    tokens = list(range(512))
    fp16 = attrs.evolve(LAYOUT, dtype="float16")
    assert LAYOUT.tag(rank=False) != fp16.tag(rank=False)
    assert not all_keys(Namespace.of("m", "r1", LAYOUT), tokens, 256) & \
        all_keys(Namespace.of("m", "r1", fp16), tokens, 256)


@pytest.mark.parametrize("change", [dict(version=2), dict(num_layers=16), dict(num_kv_heads=4),
                                    dict(head_dim=64), dict(block_size=32), dict(tp_size=4)])
def test_every_layout_field_is_in_the_namespace(change):
    other = attrs.evolve(LAYOUT, **change)
    assert Namespace.of("m", "r", LAYOUT).digest != Namespace.of("m", "r", other).digest


def test_layout_tag_with_and_without_rank():
    lay = KVLayout(32, 8, 128, "float16", 16, tp_rank=1, tp_size=2)
    assert lay.tag() == "kvl1:L32:H8:D128:fp16:B16:tp1/2"
    assert lay.tag(rank=False) == "kvl1:L32:H8:D128:fp16:B16:tp*/2"
    assert attrs.evolve(lay, tp_rank=0).tag(rank=False) == lay.tag(rank=False)


# --- objects of a chunk and the usable prefix -------------------------------------

def test_object_keys_one_per_rank_and_layer_group():
    ns = Namespace.of("m", "r", LAYOUT, layer_groups=3)
    chunk = ns.chunks(range(10), 4)[0]
    keys = ns.object_keys(chunk)
    assert len(keys) == len(set(keys)) == 6 == ns.parts
    assert keys[0] == ns.object_key(chunk, 0, 0) and keys[-1] == ns.object_key(chunk, 1, 2)
    assert all(k.startswith(ns.label + "/") for k in keys)
    with pytest.raises(ValueError):
        ns.object_key(chunk, rank=2)
    with pytest.raises(ValueError):
        ns.object_key(chunk, group=3)
    with pytest.raises(TypeError):
        ns.object_key("not a chunk")


def test_one_missing_rank_object_ends_the_usable_prefix():
    """A chunk stored as per-rank objects with one missing."""
    ns = Namespace.of("m", "r", attrs.evolve(LAYOUT, tp_size=4))
    chunks = ns.chunks(range(40), 10)
    present = {k for c in chunks for k in ns.object_keys(c)}
    assert usable_chunks(ns, chunks, present) == 4
    assert usable_tokens(ns, chunks, present) == 40
    present.discard(ns.object_key(chunks[2], rank=3))
    assert usable_chunks(ns, chunks, present) == 2            # chunk 3 after the gap never counts
    assert usable_tokens(ns, chunks, present.__contains__) == 20
    assert usable_tokens(ns, chunks, set()) == 0


@given(st.integers(1, 3), st.integers(1, 2), st.lists(st.lists(st.booleans(), min_size=6, max_size=6),
                                                       max_size=6))
def test_usable_prefix_is_the_first_incomplete_chunk(ranks, groups, grid):
    ns = Namespace("m", "r", "layout", ranks=ranks, layer_groups=groups)
    chunks = [Chunk(i, i, i + 1, chain(ns.digest, [i])) for i in range(len(grid))]
    present = {ns.object_keys(c)[p] for c, row in zip(chunks, grid)
               for p in range(ns.parts) if row[p]}
    complete = [all(row[:ns.parts]) for row in grid]
    expect = complete.index(False) if False in complete else len(grid)
    assert usable_chunks(ns, chunks, present) == expect


def test_namespace_fields_are_checked():
    with pytest.raises(ValueError):
        Namespace("", "r", "l")
    with pytest.raises(TypeError):
        Namespace("m", 3, "l")
    with pytest.raises(ValueError):
        Namespace("m", "r", "l", ranks=0)

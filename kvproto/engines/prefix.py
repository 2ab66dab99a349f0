"""Prefix identity and namespaces, pure: no I/O, no clocks.

*Prefix identity* answers "is this the same computed state": chunk ``i`` of a
token sequence is named by a chained hash

    h(-1) = the namespace digest
    h(i)  = H(h(i-1) || n_i || t_0 .. t_{n_i - 1})      (this chunk's n_i tokens)

so a chunk's key depends on every token before it and on the namespace, never
on its position alone. Chunks hold ``chunk_size`` tokens (default 256). The
*last* chunk may be partial (``partial=True``, the default): it is keyed like
any other, and because its token count is hashed, it never names the same
state as a full chunk that starts with the same tokens; it is reusable only by
a sequence that has exactly those tokens at its end of the same chunk, and
nothing chains from it. With ``partial=False`` the tail tokens that do not fill
a chunk are not keyed at all (the engine recomputes them).

A *namespace* is everything that decides how the bytes are interpreted or who
may read them: model id, model revision, KV layout tag
(:meth:`kvproto.gpu.layout.KVLayout.tag` with ``rank=False``: layout version,
dtype, layers, KV heads, head dim, block size, tensor-parallel size), tenant,
cache salt, and how a chunk is split into objects (``ranks`` x
``layer_groups``). A new revision, layout version, dtype, tenant or salt is a
new namespace, whose keys are disjoint from every other namespace's: old
objects can never be read by it. A namespace is an isolation label, not
access control.

One chunk is stored as one object per (tensor-parallel rank, layer group):
:meth:`Namespace.object_key`. A chunk is *complete* only when all of its
objects exist, and the usable prefix is the longest contiguous run of complete
chunks from the start (:func:`usable_chunks`, which asks
:func:`kvproto.statemachines.reuse.plan_reuse`, the one place that rule lives).

Hash and collisions: BLAKE2b with a 32-byte digest and a distinct
personalisation per use (namespace, chunk). The inputs are encoded injectively
(fixed-width parent digest, token count and 32-bit token ids; length-prefixed
UTF-8 namespace fields in a fixed order), so two different inputs differ as
byte strings and can share a digest only by a BLAKE2b-256 collision: among
``n`` chunks the chance of any collision is below ``n**2 / 2**257`` (for
``n = 2**40`` chunks, under ``2**-177``). Keys print the digests in hex.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, Union

import attrs

from kvproto.statemachines.reuse import Outcome, RankLoad, plan_reuse

#: tokens per chunk unless the caller says otherwise
DEFAULT_CHUNK_SIZE = 256
#: token ids are hashed as unsigned 32-bit integers
MAX_TOKEN = (1 << 32) - 1
#: the version of the key format; a new format is a new key space
KEY_VERSION = "kvp1"

_DIGEST = 32
_NS_PERSON = b"kvproto.ns.v1"
_CHUNK_PERSON = b"kvproto.chunk.v1"


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    return value


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    return value


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@attrs.frozen
class Namespace:
    """The isolation label every key of one kind of KV state lives under."""

    model: str = attrs.field(validator=lambda _i, a, v: _text(v, a.name))
    revision: str = attrs.field(validator=lambda _i, a, v: _text(v, a.name))
    layout: str = attrs.field(validator=lambda _i, a, v: _text(v, a.name))
    tenant: str = attrs.field(default="default", validator=lambda _i, a, v: _text(v, a.name))
    salt: str = attrs.field(default="", validator=lambda _i, a, v: _text(v, a.name))
    ranks: int = attrs.field(default=1, validator=lambda _i, a, v: _count(v, a.name))
    layer_groups: int = attrs.field(default=1, validator=lambda _i, a, v: _count(v, a.name))
    digest: bytes = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must not be empty")
        h = hashlib.blake2b(digest_size=_DIGEST, person=_NS_PERSON)
        for text in (self.model, self.revision, self.layout, self.tenant, self.salt):
            h.update(_field(text.encode("utf-8")))
        h.update(struct.pack(">II", self.ranks, self.layer_groups))
        object.__setattr__(self, "digest", h.digest())

    @classmethod
    def of(cls, model: str, revision: str, layout, *, tenant: str = "default", salt: str = "",
           layer_groups: int = 1) -> "Namespace":
        """The namespace of ``layout`` (a :class:`~kvproto.gpu.layout.KVLayout`):
        its rank-free tag, one object per tensor-parallel rank and layer group."""
        return cls(model, revision, layout.tag(rank=False), tenant, salt,
                   ranks=layout.tp_size, layer_groups=layer_groups)

    def with_salt(self, salt: str) -> "Namespace":
        """The same namespace under a per-request cache salt."""
        return attrs.evolve(self, salt=salt)

    @property
    def label(self) -> str:
        """The key prefix shared by every key of this namespace (``kvp1/<hex>``):
        what an operator removes to let a namespace age out."""
        return f"{KEY_VERSION}/{self.digest[:16].hex()}"

    @property
    def parts(self) -> int:
        """Objects per chunk."""
        return self.ranks * self.layer_groups

    def chunks(self, tokens: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE,
               partial: bool = True) -> list["Chunk"]:
        """The chunks of ``tokens`` in this namespace: see :func:`chunk_hashes`."""
        return chunk_hashes(self, tokens, chunk_size, partial)

    def object_key(self, chunk: "Chunk", rank: int = 0, group: int = 0) -> str:
        """The key of ``rank``'s part of ``chunk`` for layer ``group``."""
        if not isinstance(chunk, Chunk):
            raise TypeError(f"not a Chunk: {chunk!r}")
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in 0..{self.ranks - 1}")
        if not 0 <= group < self.layer_groups:
            raise ValueError(f"layer group {group} is not in 0..{self.layer_groups - 1}")
        return f"{self.label}/{chunk.digest.hex()}/r{rank}g{group}"

    def object_keys(self, chunk: "Chunk") -> tuple[str, ...]:
        """Every object key of ``chunk``, rank by rank, layer group by layer group."""
        return tuple(self.object_key(chunk, r, g)
                     for r in range(self.ranks) for g in range(self.layer_groups))

    def engine_key(self, key: str) -> str:
        """An engine's own chunk key (already a prefix hash, e.g. LMCache's or
        SGLang's) placed inside this namespace, so that keys of different
        namespaces stay disjoint whatever the engine puts in its key."""
        return f"{self.label}/e/{_text(key, 'key')}"


@attrs.frozen
class Chunk:
    """Chunk ``index``: tokens ``[start, end)`` of its sequence, and its chained hash."""

    index: int
    start: int
    end: int
    digest: bytes = attrs.field(repr=lambda d: d.hex()[:16])

    @property
    def tokens(self) -> int:
        return self.end - self.start


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """``H(parent || n || tokens)``: the digest of a chunk of ``tokens`` after ``parent``."""
    if len(parent) != _DIGEST:
        raise ValueError(f"a parent digest has {_DIGEST} bytes, not {len(parent)}")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN:
            raise ValueError(f"a token id must be an int in [0, {MAX_TOKEN}], not {t!r}")
    h = hashlib.blake2b(digest_size=_DIGEST, person=_CHUNK_PERSON)
    h.update(parent)
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    return h.digest()


def chunk_hashes(namespace: Namespace, tokens: Sequence[int],
                 chunk_size: int = DEFAULT_CHUNK_SIZE, partial: bool = True) -> list[Chunk]:
    """The chained chunks of ``tokens`` in ``namespace``: full chunks of
    ``chunk_size`` tokens, then the partial tail as one more chunk when
    ``partial`` (with ``partial=False`` the tail is not keyed)."""
    _count(chunk_size, "chunk_size")
    tokens = list(tokens)
    out: list[Chunk] = []
    parent = namespace.digest
    for start in range(0, len(tokens), chunk_size):
        end = min(start + chunk_size, len(tokens))
        if end - start < chunk_size and not partial:
            break
        parent = chain(parent, tokens[start:end])
        out.append(Chunk(len(out), start, end, parent))
    return out


Present = Union[Container[str], Callable[[str], bool]]


def usable_chunks(namespace: Namespace, chunks: Iterable[Chunk], present: Present) -> int:
    """How many chunks from the start are complete: every object of each one
    is ``present`` (a set of keys, or a predicate), with no gap before it.

    The rule is :func:`~kvproto.statemachines.reuse.plan_reuse`'s: an object
    that exists counts as loaded, a missing one as missing."""
    has = present if callable(present) else present.__contains__
    loads = []
    for chunk in chunks:
        keys = namespace.object_keys(chunk)
        loads.append({p: RankLoad(Outcome.LOADED, key) if has(key) else RankLoad(Outcome.MISSING)
                      for p, key in enumerate(keys)})
    return plan_reuse(loads, ranks=namespace.parts).usable


def usable_tokens(namespace: Namespace, chunks: Sequence[Chunk], present: Present) -> int:
    """The reusable prefix in tokens (the end of the last complete chunk of the run)."""
    n = usable_chunks(namespace, chunks, present)
    return chunks[n - 1].end if n else 0

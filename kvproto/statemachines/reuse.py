"""The contiguous-reuse rule as a pure function.

A remote hit is only a candidate: KV state may be used only after its load
succeeded. When part of a prefix fails to load, the usable range is the longest
*contiguous* run of chunks from the start that loaded; a chunk loaded after a
gap never counts, because attention over it would need the missing chunk's KV.
When a chunk is split across ranks (one object per tensor-parallel rank),
it is loaded only when *every* rank's part loaded: completeness is judged at
the model-state layer, not by "an object exists".

:func:`plan_reuse` takes the per-chunk (and per-rank) load outcomes at the
moment the engine decides, and says which chunks to use, which to recompute,
and what to do with each destination buffer:

* ``keep``: the buffers of the usable prefix (the consumer reads these);
* ``release``: buffers whose load finished (loaded or failed) but lie after the
  first gap: nothing can still write them, so they go back to the pool now;
* ``quarantine``: buffers whose load did not finish (timed out or still in
  flight). The engine will not wait for them (their chunks are recomputed), so
  it times them out, and the quarantine rule of ``spec/Timeout.tla`` applies:
  they are handed to no one until the transfer's completion or the storage
  node's cancel acknowledgement arrives. Recompute writes into *other* buffers.

Pure: no I/O, no clocks, no randomness.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from typing import Optional, Union

import attrs


class Outcome(str, enum.Enum):
    LOADED = "loaded"        # the completion arrived: the bytes are in the buffer
    FAILED = "failed"        # the completion arrived with an error: nothing will write
    TIMED_OUT = "timed_out"  # the caller stopped waiting: the transfer may still write
    IN_FLIGHT = "in_flight"  # still awaited
    MISSING = "missing"      # no load: a lookup miss, or never issued (no buffer)


#: Outcomes whose transfer may still write its buffer.
UNFINISHED = frozenset({Outcome.TIMED_OUT, Outcome.IN_FLIGHT})


@attrs.frozen
class RankLoad:
    """The load of one rank's part of a chunk into ``buffer``."""

    outcome: Outcome
    buffer: Optional[Hashable] = None


#: One chunk: a single load, or rank -> load when the chunk is split across ranks.
ChunkLoads = Union[RankLoad, Mapping[int, RankLoad]]


@attrs.frozen
class ReusePlan:
    usable: int                   # chunks [0, usable) are reused
    recompute: tuple[int, ...]    # chunks [usable, n) are recomputed
    keep: frozenset               # buffers of the usable prefix
    release: frozenset            # finished loads after the gap: free now
    quarantine: frozenset         # unfinished loads: quarantined until they drain

    def tokens(self, chunk_tokens: int) -> int:
        """The reusable prefix length in tokens, for chunks of ``chunk_tokens``."""
        return self.usable * chunk_tokens


def _ranks_of(chunk: ChunkLoads, ranks: int, index: int) -> dict[int, RankLoad]:
    loads = {0: chunk} if isinstance(chunk, RankLoad) else dict(chunk)
    for rank, load in loads.items():
        if not (isinstance(rank, int) and 0 <= rank < ranks):
            raise ValueError(f"chunk {index}: rank {rank!r} outside 0..{ranks - 1}")
        if not isinstance(load, RankLoad):
            raise TypeError(f"chunk {index} rank {rank}: not a RankLoad: {load!r}")
        if load.outcome is not Outcome.MISSING and load.buffer is None:
            raise ValueError(f"chunk {index} rank {rank}: a {load.outcome.value} load needs a buffer")
    return loads


def chunk_loaded(loads: Mapping[int, RankLoad], ranks: int) -> bool:
    """Every one of ``ranks`` ranks' parts loaded."""
    return all(r in loads and loads[r].outcome is Outcome.LOADED for r in range(ranks))


def plan_reuse(chunks: Sequence[ChunkLoads], ranks: int = 1) -> ReusePlan:
    """The longest loaded prefix, what to recompute, and each buffer's fate.

    ``chunks[i]`` is chunk ``i``'s load outcome (a :class:`RankLoad`) or, for a
    chunk split across ``ranks`` ranks, ``{rank: RankLoad}``; a rank absent from
    the mapping is missing. Every buffer may appear once.
    """
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    per_chunk = [_ranks_of(c, ranks, i) for i, c in enumerate(chunks)]
    usable = 0
    while usable < len(per_chunk) and chunk_loaded(per_chunk[usable], ranks):
        usable += 1
    keep, release, quarantine, seen = set(), set(), set(), set()
    for i, loads in enumerate(per_chunk):
        for load in loads.values():
            if load.buffer is None:
                continue
            if load.buffer in seen:
                raise ValueError(f"buffer {load.buffer!r} appears twice")
            seen.add(load.buffer)
            if i < usable:
                keep.add(load.buffer)
            elif load.outcome in UNFINISHED:
                quarantine.add(load.buffer)
            else:
                release.add(load.buffer)
    return ReusePlan(usable, tuple(range(usable, len(per_chunk))),
                     frozenset(keep), frozenset(release), frozenset(quarantine))

"""Small value types shared by the front-ends."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ._errors import InvalidArgumentError


class BlockSizes(NamedTuple):
    """Tile sizes of the flash loop (positive multiples of 16).

    Tuning knobs only: results do not change beyond float rounding. 128 x 128
    is the measured best on every case of docs/PERFORMANCE.md; smaller tiles
    waste less at the edges of very narrow masks.
    """

    q: int = 128
    kv: int = 128


class SegmentIds(NamedTuple):
    """Document ids of packed sequences: a query attends only to keys of its document.

    ``q``: int32 ``[B, q_len]``, ``kv``: int32 ``[B, kv_len]`` (``[q_len]`` /
    ``[kv_len]`` for unbatched JAX calls). The names follow JAX's splash attention.
    """

    q: Any
    kv: Any


def as_block_sizes(block_sizes) -> BlockSizes:
    """BlockSizes from None (the default), BlockSizes or a pair; checked here, so a
    JAX kernel refuses bad sizes when it is made rather than when XLA runs it."""
    if block_sizes is None:
        return BlockSizes()
    try:
        q, kv = (int(b) for b in block_sizes)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"block_sizes: expected BlockSizes(q, kv) or a (q, kv) pair, got {block_sizes!r}"
        ) from None
    for name, size in (("q", q), ("kv", kv)):
        if size <= 0 or size % 16 != 0:
            raise InvalidArgumentError(
                f"block_sizes.{name}: expected a positive multiple of 16, got {size}"
            )
    return BlockSizes(q, kv)


def as_num_threads(num_threads) -> int:
    """None -> 0 (the library's default: every core this process may use)."""
    if num_threads is None:
        return 0
    n = int(num_threads)
    if n < 0:
        raise InvalidArgumentError(f"num_threads: expected >= 0 (0: all cores), got {num_threads}")
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1

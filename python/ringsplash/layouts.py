"""Sequence layouts of the ring: which global token positions each rank holds.

A ring of ``N`` ranks splits a global sequence of ``S`` tokens into ``N``
equal slices. The *layout* decides which tokens go to which rank (SPEC §4);
queries and keys/values use the same layout:

============  ==========================================  ===================
layout        rank ``r`` holds                            divisibility
============  ==========================================  ===================
contiguous    tokens ``[r*S/N, (r+1)*S/N)``               ``S % N == 0``
zigzag        chunks ``r`` and ``2N-1-r`` of ``2N`` equal  ``S % (2N) == 0``
              chunks
striped       tokens ``t`` with ``t % N == r``            ``S % N == 0``
============  ==========================================  ===================

Within a rank, local rows are the rank's global positions in increasing
order. :func:`permutation` lists the global positions rank after rank, so
``x[:, permutation(...)]`` cut into ``N`` contiguous blocks gives rank ``r``
block ``r``; that is what :func:`shard` does (and what a plain
``PartitionSpec(None, ring_axis)`` sharding needs), and :func:`unshard` is its
inverse.

Pure NumPy: the JAX and PyTorch front-ends build on these functions.
"""

from __future__ import annotations

import numpy as np

from ._errors import InvalidArgumentError

__all__ = [
    "LAYOUTS",
    "check_divisible",
    "divisor",
    "inverse_permutation",
    "permutation",
    "positions",
    "shard",
    "unshard",
]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(
            f"unknown sequence layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout


def _check_num_ranks(num_ranks) -> int:
    if isinstance(num_ranks, (bool, np.bool_)) or not isinstance(num_ranks, (int, np.integer)):
        raise InvalidArgumentError(
            f"the number of ranks must be an integer, got {num_ranks!r}")
    if num_ranks < 1:
        raise InvalidArgumentError(f"the number of ranks must be >= 1, got {num_ranks}")
    return int(num_ranks)


def divisor(layout: str, num_ranks: int) -> int:
    """The number a global sequence length must be a multiple of:
    ``2 * num_ranks`` for zigzag, ``num_ranks`` otherwise."""
    _check_layout(layout)
    n = _check_num_ranks(num_ranks)
    return 2 * n if layout == "zigzag" else n


def check_divisible(layout: str, seq_len: int, num_ranks: int, what: str = "sequence") -> None:
    """Raise :class:`ringsplash.InvalidArgumentError` unless ``layout`` can
    split a global ``what`` of ``seq_len`` tokens over ``num_ranks`` ranks."""
    d = divisor(layout, num_ranks)
    if isinstance(seq_len, (bool, np.bool_)) or not isinstance(seq_len, (int, np.integer)):
        raise InvalidArgumentError(f"the {what} length must be an integer, got {seq_len!r}")
    if seq_len < 0:
        raise InvalidArgumentError(f"the {what} length must be >= 0, got {seq_len}")
    if seq_len % d != 0:
        if layout == "zigzag":
            why = (f"2 * {num_ranks} ranks = {d} (the zigzag layout cuts it into 2 equal "
                   f"chunks per rank)")
        else:
            why = (f"the number of ranks, {num_ranks} (the {layout} layout gives every rank an "
                   f"equal share)")
        raise InvalidArgumentError(
            f"{layout} layout over {num_ranks} ranks: the global {what} length {seq_len} must "
            f"be divisible by {why}; pad the sequence (padding tokens can be masked out with "
            f"segment ids)")


def positions(layout: str, seq_len: int, rank: int, num_ranks: int) -> np.ndarray:
    """Global positions (int64, increasing) of rank ``rank``'s local rows."""
    check_divisible(layout, seq_len, num_ranks)
    n = int(num_ranks)
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) \
            or not 0 <= rank < n:
        raise InvalidArgumentError(f"rank must be an integer in [0, {n}), got {rank!r}")
    r = int(rank)
    local = seq_len // n
    if layout == "contiguous":
        return np.arange(r * local, (r + 1) * local, dtype=np.int64)
    if layout == "striped":
        return np.arange(r, seq_len, n, dtype=np.int64)
    chunk = local // 2  # zigzag
    first = np.arange(r * chunk, (r + 1) * chunk, dtype=np.int64)
    second = np.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk, dtype=np.int64)
    return np.concatenate([first, second])


def permutation(layout: str, seq_len: int, num_ranks: int) -> np.ndarray:
    """Global positions rank after rank (int64 [seq_len]): ``x[:, perm]`` cut
    into ``num_ranks`` contiguous blocks gives rank ``r`` block ``r``."""
    check_divisible(layout, seq_len, num_ranks)
    n = int(num_ranks)
    if seq_len == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([positions(layout, seq_len, r, n) for r in range(n)])


def inverse_permutation(layout: str, seq_len: int, num_ranks: int) -> np.ndarray:
    """The inverse of :func:`permutation`: ``x_sharded[:, inv]`` is ``x``."""
    perm = permutation(layout, seq_len, num_ranks)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=np.int64)
    return inv


def _axis(x, axis: int) -> int:
    nd = np.ndim(x)
    if not -nd <= axis < nd:
        raise InvalidArgumentError(
            f"axis {axis} is out of range for an array of rank {nd} (shape {np.shape(x)})")
    return axis % nd


def shard(x, layout: str, num_ranks: int, axis: int = 1) -> np.ndarray:
    """Reorder ``x`` along ``axis`` so that contiguous equal blocks are the
    ranks' slices in ``layout`` (block ``r`` = rank ``r``)."""
    x = np.asarray(x)
    ax = _axis(x, axis)
    perm = permutation(layout, x.shape[ax], num_ranks)
    return np.take(x, perm, axis=ax)


def unshard(x, layout: str, num_ranks: int, axis: int = 1) -> np.ndarray:
    """Inverse of :func:`shard`: back to global token order along ``axis``."""
    x = np.asarray(x)
    ax = _axis(x, axis)
    inv = inverse_permutation(layout, x.shape[ax], num_ranks)
    return np.take(x, inv, axis=ax)

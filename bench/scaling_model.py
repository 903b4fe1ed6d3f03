#!/usr/bin/env python3
"""Scaling model of ringsplash's ring attention, checked against measured runs.

docs/SCALING.md explains the model; this file is it, as functions, plus three modes (NumPy
needed: run it with /usr/bin/python3 on Debian):

  bench/scaling_model.py predict  [--speeds 0.1,1,10,100] [--bandwidths 25,100,400]
                                  [--seqs 1048576,4194304] [--ulysses 8,16] [--out FILE]
      Efficiency of the 1-D ring and of 2-D (Ulysses groups of U ranks x a ring of N/U groups)
      for N = 8, 16, ..., 4096 ranks at the stated per-rank speeds (TFLOP/s) and link
      bandwidths (GB/s), from exact tile counts of each layout and mask; a table of layouts
      and masks side by side; the crossover rows per rank. Markdown on stdout.

  bench/scaling_model.py validate [--ringsplash PATH] [--out docs/perf/scaling.jsonl]
                                  [--ranks 2,4,8] [--seq S[,S...]] [--heads H[,H...]]
      Runs `ringsplash bench` on an in-process ring of N thread ranks (f32) with the emulated
      link RINGSPLASH_LINK=LATENCY_US,GBPS (include/ringsplash/comm.h, LinkModel) at links
      chosen from a no-link run of the same configuration so that some runs are
      compute-bound, some balanced and some transfer-bound; calibrates each configuration
      from its no-link run and one latency-only run; predicts the wall time of the other
      link runs; writes one JSON line per run (measured, predicted, ratio) to --out and
      prints a Markdown table. A benchmark, not a test: its numbers depend on the machine
      and on its load (~8 minutes on 2 cores).

  bench/scaling_model.py tiles    [--ringsplash PATH]
      Checks the model's exact tile counts against the `computed_blocks` / `skipped_blocks`
      the bench reports (no timing; exit status 1 on a mismatch).

The model (ring of N ranks, each holding L = S/N rows; step t, rank r, source (r - t) mod N):
  work W[t, r]   = computed tiles (full + partial), counted from the global positions of
                   rank r's q blocks and of the k/v blocks of the source exactly as the
                   kernel's block map classifies them, x rows x cols x 2 (D + Dv) x B x H
                   (x 2.5 for the backward)
  compute c[t]   = max over ranks of W[t, r] / speed (steps synchronise: the slowest rank)
  transfer T     = latency + bytes / bandwidth per message; forward: one k/v slice per step;
                   backward: the k/v slice and, one step behind, the f32 dk/dv accumulator
                   of the same rows on the same link (one message at a time)
  step           = max(c[t], T) + o in the forward, the last step c + o (the backward:
                   an exact recurrence of its two messages, backward_time)
  total          = sum over steps; efficiency = useful FLOPs / (N x speed x total)
On this machine the ranks share 2 cores; validate's calibration models that (calibrate).
"""
import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

try:
    import numpy as np
except ImportError:  # the model needs NumPy (Debian: /usr/bin/python3 has it)
    sys.exit("bench/scaling_model.py needs NumPy: run it with a Python that has it "
             "(e.g. /usr/bin/python3 bench/scaling_model.py ...)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------
# The problem
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One attention call over the GLOBAL sequence (bench's flags)."""
    seq: int                 # S = Sq = Skv, global
    heads: int = 1           # H query heads
    kv_heads: int = 0        # Hkv (0: = heads)
    head_dim: int = 64       # D
    v_head_dim: int = 0      # Dv (0: = head_dim)
    batch: int = 1
    mask: str = "causal"
    layout: str = "zigzag"
    dtype_bytes: int = 4     # f32 4, bf16 2
    block_q: int = 128
    block_kv: int = 128
    segments: bool = False   # kv segment ids travel with the slice

    @property
    def hkv(self):
        return self.kv_heads or self.heads

    @property
    def dv(self):
        return self.v_head_dim or self.head_dim


# ---------------------------------------------------------------------------------------
# Masks: the structured leaves of src/mask/leaf_classify.h, ANDed ('&' only).
# A leaf allows a pair (q, kv) by d = kv - q alone:
#   full: always; causal[:OFF]: d <= OFF; local:L,R[,OFF]: OFF-L <= d <= OFF+R (an empty L
#   or R is unbounded on that side).
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    lo: float  # allowed d >= lo (-inf: unbounded)
    hi: float  # allowed d <= hi (+inf: unbounded)


def parse_mask(text):
    """Leaves of a mask text ('full', 'causal', 'causal:-5', 'local:1024,0', 'causal & local:4096,')."""
    leaves = []
    for term in text.split("&"):
        term = term.strip()
        if term == "full":
            continue
        m = re.fullmatch(r"causal(?::\s*(-?\d+))?", term)
        if m:
            leaves.append(Leaf(-math.inf, int(m.group(1) or 0)))
            continue
        m = re.fullmatch(r"local:\s*(\d*)\s*,\s*(\d*)\s*(?:,\s*(-?\d+))?", term)
        if m:
            off = int(m.group(3) or 0)
            lo = off - int(m.group(1)) if m.group(1) else -math.inf
            hi = off + int(m.group(2)) if m.group(2) else math.inf
            leaves.append(Leaf(lo, hi))
            continue
        raise ValueError(f"mask '{text}': the model handles full, causal[:OFF], local:L,R[,OFF] "
                         f"and '&' of them, not '{term}'")
    return leaves


def allowed_pairs(mask, seq):
    """(q, kv) pairs of an S x S problem the mask allows (one head): the useful work."""
    leaves = parse_mask(mask)
    q = np.arange(seq, dtype=np.float64)
    lo = np.zeros(seq)
    hi = np.full(seq, seq - 1.0)
    for leaf in leaves:  # kv in [q + leaf.lo, q + leaf.hi]
        if leaf.lo > -math.inf:
            lo = np.maximum(lo, q + leaf.lo)
        if leaf.hi < math.inf:
            hi = np.minimum(hi, q + leaf.hi)
    return float(np.clip(hi - lo + 1, 0, None).sum())


# ---------------------------------------------------------------------------------------
# Layouts (src/ring/layout.cc LayoutPositions) and the block ranges the kernel classifies
# ---------------------------------------------------------------------------------------


def positions(layout, seq, rank, n):
    local = seq // n
    if layout == "contiguous":
        return rank * local + np.arange(local, dtype=np.int64)
    if layout == "zigzag":
        chunk = seq // (2 * n)
        i = np.arange(chunk, dtype=np.int64)
        return np.concatenate([rank * chunk + i, (2 * n - 1 - rank) * chunk + i])
    if layout == "striped":
        return rank + n * np.arange(local, dtype=np.int64)
    raise ValueError(f"layout: expected contiguous, zigzag or striped, got '{layout}'")


def block_ranges(pos, block):
    """Per block of `block` consecutive local rows: (min, max, rows), as BlockRanges::Of."""
    nb = -(-len(pos) // block)
    lo = np.empty(nb, dtype=np.int64)
    hi = np.empty(nb, dtype=np.int64)
    size = np.empty(nb, dtype=np.int64)
    for b in range(nb):
        part = pos[b * block:(b + 1) * block]
        lo[b], hi[b], size[b] = part.min(), part.max(), len(part)
    return lo, hi, size


def count_tiles(q, kv, leaves, shifts):
    """Tile kinds of q blocks vs kv blocks whose positions are moved by each of `shifts`.

    q, kv: block_ranges(); kv's positions are increasing, so each leaf's 'full' tiles of a q
    block are an interval of kv blocks and its 'empty' ones a prefix plus a suffix: counted
    by binary search, as the kernel's BlockMap builder finds them (leaf_classify.h: with
    d in [kv_lo - q_hi, kv_hi - q_lo], full iff that range lies in [lo, hi], empty iff it
    misses it; an '&' is empty if any leaf is, full if all are).
    Returns, per shift: (full tiles, partial tiles, rows x cols summed over computed tiles).
    """
    qlo, qhi, qsz = q
    klo, khi, ksz = kv
    nkv = len(klo)
    kcum = np.concatenate([[0], np.cumsum(ksz)])  # cols of kv blocks [0, j)
    shifts = np.asarray(shifts, dtype=np.float64)
    # Thresholds per (shift, q block): positions of the moved kv are k + shift.
    qlo_s = qlo[None, :] - shifts[:, None]
    qhi_s = qhi[None, :] - shifts[:, None]
    full_a = np.zeros(qlo_s.shape, dtype=np.int64)     # full: kv blocks [full_a, full_b)
    full_b = np.full(qlo_s.shape, nkv, dtype=np.int64)
    empty_pre = np.zeros(qlo_s.shape, dtype=np.int64)  # empty: [0, empty_pre) and [empty_suf, nkv)
    empty_suf = np.full(qlo_s.shape, nkv, dtype=np.int64)
    for leaf in leaves:
        if leaf.lo > -math.inf:
            # full needs kv_lo - q_hi >= lo; empty if kv_hi - q_lo < lo
            full_a = np.maximum(full_a, np.searchsorted(klo, qhi_s + leaf.lo, "left"))
            empty_pre = np.maximum(empty_pre, np.searchsorted(khi, qlo_s + leaf.lo, "left"))
        if leaf.hi < math.inf:
            # full needs kv_hi - q_lo <= hi; empty if kv_lo - q_hi > hi
            full_b = np.minimum(full_b, np.searchsorted(khi, qlo_s + leaf.hi, "right"))
            empty_suf = np.minimum(empty_suf, np.searchsorted(klo, qhi_s + leaf.hi, "right"))
    full_b = np.maximum(full_b, full_a)
    empty_suf = np.maximum(empty_suf, empty_pre)
    n_full = (full_b - full_a)
    n_computed = empty_suf - empty_pre
    cols_full = kcum[full_b] - kcum[full_a]
    cols_computed = kcum[empty_suf] - kcum[empty_pre]
    full = n_full.sum(axis=1)
    partial = (n_computed - n_full).sum(axis=1)
    elems = (cols_computed * qsz[None, :]).sum(axis=1)
    del cols_full
    return full, partial, elems


@dataclass
class StepWork:
    """Per step t, per rank r (arrays [N, N], t first): computed tiles and their rows x cols
    (one batch element, one head); plus the useful pairs of the whole problem."""
    tiles: np.ndarray
    full: np.ndarray
    elems: np.ndarray


def _pair_tables(p, n):
    """Work of a q range vs a kv range as a function of their offset, for the layouts whose
    pairs are translates of one another (exact: the mask depends on kv - q only).
    Returns (kind, table) where table maps an offset index to (full, partial, elems)."""
    leaves = parse_mask(p.mask)
    if p.layout == "contiguous":
        unit = p.seq // n
        pos = positions("contiguous", p.seq, 0, n)
    elif p.layout == "striped":
        unit = 1
        pos = positions("striped", p.seq, 0, n)
    else:  # zigzag: chunks of S/2N; blocks must not straddle the rank's two chunks
        unit = p.seq // (2 * n)
        pos = np.arange(unit, dtype=np.int64)
    q = block_ranges(pos, p.block_q)
    kv = block_ranges(pos, p.block_kv)
    span = 2 * n if p.layout == "zigzag" else n
    offsets = np.arange(-(span - 1), span)
    full, partial, elems = count_tiles(q, kv, leaves, offsets * unit)
    return span, full, partial, elems


def step_work(p, n):
    """Exact per-(step, rank) tile work of a ring of n ranks (see StepWork)."""
    local = p.seq // n
    parts = 2 * n if p.layout == "zigzag" else n
    if p.seq % parts:
        raise ValueError(f"S = {p.seq} does not split over {n} ranks ({p.layout})")
    t = np.arange(n)[:, None]
    r = np.arange(n)[None, :]
    s = (r - t) % n  # source rank of the slice rank r processes at step t
    zig_straddles = p.layout == "zigzag" and (
        (p.seq // (2 * n)) % p.block_q or (p.seq // (2 * n)) % p.block_kv)
    if zig_straddles:
        if n > 64:
            raise ValueError("zigzag with chunks S/2N not a multiple of the block: "
                             "only N <= 64 is counted (directly)")
        return _step_work_direct(p, n)
    span, full, partial, elems = _pair_tables(p, n)
    if p.layout in ("contiguous", "striped"):
        idx = (s - r) + (span - 1)
        tab = lambda a: a[idx]
        tot_full, tot_part, tot_elems = tab(full), tab(partial), tab(elems)
    else:
        # rank r holds chunks r and 2N-1-r; the four chunk pairs' offsets (kv - q)
        a = [r, 2 * n - 1 - r]
        k = [s, 2 * n - 1 - s]
        tot_full = tot_part = tot_elems = 0
        for qa in a:
            for kb in k:
                idx = (kb - qa) + (span - 1)
                tot_full = tot_full + full[idx]
                tot_part = tot_part + partial[idx]
                tot_elems = tot_elems + elems[idx]
    del local
    return StepWork(tiles=np.asarray(tot_full + tot_part, dtype=np.float64),
                    full=np.asarray(tot_full, dtype=np.float64),
                    elems=np.asarray(tot_elems, dtype=np.float64))


def _step_work_direct(p, n):
    leaves = parse_mask(p.mask)
    blocks_q = [block_ranges(positions(p.layout, p.seq, r, n), p.block_q) for r in range(n)]
    blocks_kv = [block_ranges(positions(p.layout, p.seq, r, n), p.block_kv) for r in range(n)]
    tiles = np.zeros((n, n))
    full = np.zeros((n, n))
    elems = np.zeros((n, n))
    for t in range(n):
        for r in range(n):
            f, pa, e = count_tiles(blocks_q[r], blocks_kv[(r - t) % n], leaves, [0])
            tiles[t, r], full[t, r], elems[t, r] = f[0] + pa[0], f[0], e[0]
    return StepWork(tiles=tiles, full=full, elems=elems)


_SUMMARY_CACHE = {}


def step_summary(p, n):
    """(slowest rank's computed elements per step [N], each rank's total [N], computed
    tiles of all ranks) — what predict needs, without N x N arrays for large N. Cached."""
    key = (p, n)
    if key in _SUMMARY_CACHE:
        return _SUMMARY_CACHE[key]
    if n <= 256:
        w = step_work(p, n)
        res = (w.elems.max(axis=1), w.elems.sum(axis=0), float(w.tiles.sum()))
    else:
        span, full, partial, elems = _pair_tables(p, n)
        tiles_tab = full + partial
        step_max = np.empty(n)
        rank_tot = np.zeros(n)
        tiles = 0.0
        r = np.arange(n)
        for t in range(n):
            s = (r - t) % n
            if p.layout == "zigzag":
                e = np.zeros(n)
                ti = np.zeros(n)
                for qa in (r, 2 * n - 1 - r):
                    for kb in (s, 2 * n - 1 - s):
                        idx = kb - qa + span - 1
                        e += elems[idx]
                        ti += tiles_tab[idx]
            else:
                idx = s - r + span - 1
                e = elems[idx].astype(np.float64)
                ti = tiles_tab[idx]
            step_max[t] = e.max()
            rank_tot += e
            tiles += float(ti.sum())
        res = (step_max, rank_tot, tiles)
    _SUMMARY_CACHE[key] = res
    return res


def forward_flops_per_elem(p):
    """Kernel FLOPs of one computed (q, kv) element of one head: QK^T 2D + PV 2Dv."""
    return 2.0 * (p.head_dim + p.dv)


BACKWARD_FACTOR = 2.5  # backward FLOPs / forward FLOPs (the FlashAttention-2 convention)


# ---------------------------------------------------------------------------------------
# Bytes (src/ring/ring_common.cc SliceLayout; ring_backward.cc accumulators)
# ---------------------------------------------------------------------------------------


def _align64(x):
    return (x + 63) // 64 * 64


def slice_bytes(p, n, heads_kv=None, rows=None):
    """One travelling k/v slice: k, v (dtype), kv segment ids (i32), poison flags."""
    rows = p.seq // n if rows is None else rows
    hkv = p.hkv if heads_kv is None else heads_kv
    r = p.batch * rows * hkv
    b = _align64(r * p.head_dim * p.dtype_bytes)
    b = _align64(b + r * p.dv * p.dtype_bytes)
    b = _align64(b + (p.batch * rows * 4 if p.segments else 0))
    return _align64(b + 1 + r)


def acc_bytes(p, n, heads_kv=None, rows=None):
    """The backward's travelling dk/dv accumulator of a slice: f32 [B, L, Hkv, D + Dv]."""
    rows = p.seq // n if rows is None else rows
    hkv = p.hkv if heads_kv is None else heads_kv
    return p.batch * rows * hkv * (p.head_dim + p.dv) * 4


def memory_per_rank(p, n, backward=True, ulysses=1):
    """Bytes a rank holds during the ring (inputs, outputs, slices, accumulators).
    f32 accumulators; with ulysses U, the a2a buffers (send + receive) are added."""
    u = ulysses
    rows = p.seq // (n // u)             # rows of the rank's ring shard after the a2a
    h, hkv = p.heads // u, max(1, p.hkv // u)
    e = p.dtype_bytes
    d, dv = p.head_dim, p.dv
    q = rows * h * d * e
    kv = rows * hkv * (d + dv) * e
    out = rows * h * dv * 4 + rows * h * 4          # f32 out + lse accumulators
    slices = 2 * slice_bytes(p, n // u, hkv, rows)
    total = q + kv + out + slices
    if backward:
        total += rows * h * dv * e                   # dout
        total += rows * h * d * 4                    # dq accumulator
        total += 3 * acc_bytes(p, n // u, hkv, rows)  # 2 travelling accumulators + part
        total += rows * h * 4 * 2                    # delta, lse32
    if u > 1:
        total += 2 * (q + kv + rows * h * dv * e)    # a2a send/receive copies
    return total * p.batch


# ---------------------------------------------------------------------------------------
# Time: link, steps, processor sharing
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    latency_s: float = 0.0
    bandwidth: float = 0.0  # bytes/s; 0 = unlimited

    def occupy(self, nbytes):
        return nbytes / self.bandwidth if self.bandwidth > 0 else 0.0

    def message(self, nbytes):
        return self.latency_s + self.occupy(nbytes)

    @property
    def active(self):
        return self.latency_s > 0 or self.bandwidth > 0

    def env(self):
        """RINGSPLASH_LINK text (microseconds, GB/s)."""
        lat = f"{self.latency_s * 1e6:g}"
        return lat if self.bandwidth <= 0 else f"{lat},{self.bandwidth / 1e9:g}"


def forward_time(c, kv_bytes, link, overhead=0.0, wake=0.0):
    """Forward ring of len(c) steps; c[t] = the slowest rank's compute at step t.
    Step t < N-1 posts its slice's shift, computes, waits for the shift:
    max(c, T + wake) + o; the last step c + o. `wake`: how late a rank blocked on a
    delayed message notices its arrival (0 on dedicated cores; measured on this machine).
    Returns (total seconds, per-step seconds, exposed transfer seconds)."""
    n = len(c)
    t_msg = link.message(kv_bytes) + (wake if link.active else 0.0) if n > 1 else 0.0
    steps = np.empty(n)
    for t in range(n):
        steps[t] = (max(c[t], t_msg) if t < n - 1 else c[t]) + overhead
    exposed = float(np.sum(np.maximum(0.0, t_msg - np.asarray(c[:-1])))) if n > 1 else 0.0
    return float(steps.sum()), steps, exposed


def backward_time(c, kv_bytes, accum_bytes, link, overhead=0.0, wake=0.0):
    """Backward ring (ring_backward.cc) as an exact recurrence on one representative rank
    (all ranks synchronised; c[t] = the slowest rank's compute at step t):
      t: post kv shift t; compute; t > 0: wait acc shift t-1; post acc shift t; wait kv t;
      after the last step wait acc shift N-1.
    The link to rank+1 carries kv_t then acc_t, one message at a time: a message starts at
    max(posted, link free), holds the link for bytes/bandwidth, arrives latency later (and
    is noticed `wake` after that by a rank blocked on it).
    Returns (total, per-step, exposed transfer)."""
    n = len(c)
    if n == 1:
        return float(c[0] + overhead), np.array([c[0] + overhead]), 0.0
    wake = wake if link.active else 0.0
    now = 0.0
    free = 0.0
    acc_arrival = None
    steps = np.empty(n)
    exposed = 0.0
    for t in range(n):
        start = now
        kv_arrival = None
        if t < n - 1:
            s = max(now, free)
            free = s + link.occupy(kv_bytes)
            kv_arrival = free + link.latency_s + wake
        done = now + c[t]
        if acc_arrival is not None and acc_arrival > done:
            exposed += acc_arrival - done
            done = acc_arrival
        s = max(done, free)
        free = s + link.occupy(accum_bytes)
        acc_arrival = free + link.latency_s + wake
        end = done
        if kv_arrival is not None:
            end = max(end, kv_arrival)
        if t == n - 1:
            end = max(end, acc_arrival)
        exposed += end - done
        now = end + overhead
        steps[t] = now - start
    return float(now), steps, exposed


def ps_finish(works, cores):
    """Processor sharing: jobs of `works` (core-seconds) start together on `cores` cores, each
    using at most one core (one kernel thread per rank); every running job gets
    min(1, cores / running). Returns each job's finish time."""
    works = np.asarray(works, dtype=np.float64)
    order = np.argsort(works)
    finish = np.zeros(len(works))
    t = 0.0
    done_work = 0.0
    running = int(np.count_nonzero(works > 0))
    for i in order:
        w = works[i]
        if w <= 0:
            continue
        rate = min(1.0, cores / running)
        t += (w - done_work) / rate
        done_work = w
        finish[i] = t
        running -= 1
    return finish


# ---------------------------------------------------------------------------------------
# Prediction of a ring (1-D) and of 2-D (Ulysses x ring)
# ---------------------------------------------------------------------------------------


@dataclass
class Prediction:
    n: int
    ulysses: int
    forward_s: float
    backward_s: float
    compute_fwd_s: float        # sum over steps of the slowest rank's compute
    compute_bwd_s: float
    a2a_s: float                # all-to-alls (2-D), forward + backward
    exposed_fwd_s: float
    exposed_bwd_s: float
    useful_flops: float         # forward + backward, all ranks
    efficiency: float           # useful FLOPs / (N x speed x (forward + backward))
    imbalance: float            # max / mean of per-rank kernel FLOPs
    ratio_fwd: float            # median compute per step / transfer per step (forward)
    ratio_bwd: float
    memory_bytes: float
    extra: dict = field(default_factory=dict)


def predict_ring(p, n, speed, link, ulysses=1, overhead=0.0, a2a_link=None,
                 bwd_speed=None):
    """Wall time of forward and backward on N ranks with per-rank `speed` (FLOP/s, forward
    kernel; backward at bwd_speed, default the same) — 1-D when ulysses == 1, else 2-D:
    an all-to-all within groups of U ranks gives each rank S/(N/U) rows of H/U heads, the
    ring runs over the G = N/U groups, and an all-to-all returns out (the backward:
    dout/out/q/k/v/lse before, dq/dk/dv after)."""
    u = ulysses
    if n % u or p.heads % u:
        raise ValueError(f"U = {u} must divide N = {n} and H = {p.heads}")
    g = n // u
    h = p.heads // u
    hkv = max(1, p.hkv // u)  # kv heads per rank; Hkv < U replicates kv heads (1 each)
    step_max, rank_elems, _ = step_summary(p, g)
    fpe = forward_flops_per_elem(p) * p.batch * h
    bwd_speed = speed if bwd_speed is None else bwd_speed
    c_f = step_max * fpe / speed               # the slowest rank's forward kernel seconds
    c_b = BACKWARD_FACTOR * step_max * fpe / bwd_speed
    rows = p.seq // g
    kvb = slice_bytes(p, g, hkv, rows)
    accb = acc_bytes(p, g, hkv, rows)
    fwd, _, exp_f = forward_time(c_f, kvb, link, overhead)
    bwd, _, exp_b = backward_time(c_b, kvb, accb, link, overhead)
    a2a = 0.0
    if u > 1:
        al = a2a_link or link
        local = p.seq // n  # rows per rank before the a2a (sequence shard, all heads)
        e = p.dtype_bytes
        def a2a_time(elems_per_row_bytes):
            vol = local * elems_per_row_bytes * p.batch * (u - 1) / u
            return (u - 1) * al.latency_s + al.occupy(vol)
        # Hkv < U: every rank of the group needs the kv head of its query heads, so
        # the k/v heads sent are max(Hkv, U) (replicated), not Hkv.
        qkv = p.heads * p.head_dim * e + max(p.hkv, u) * (p.head_dim + p.dv) * e
        out = p.heads * p.dv * e
        # forward: q, k, v in; out back. backward: q, k, v, out, dout, lse in; dq, dk, dv back
        a2a_f = a2a_time(qkv) + a2a_time(out)
        a2a_b = a2a_time(qkv + 2 * out + p.heads * 4) + a2a_time(qkv)
        a2a = a2a_f + a2a_b
        fwd += a2a_f
        bwd += a2a_b
    useful = allowed_pairs(p.mask, p.seq) * 2.0 * (p.head_dim + p.dv) * p.batch * p.heads
    useful_total = useful * (1 + BACKWARD_FACTOR)
    ideal = useful / (n * speed) + BACKWARD_FACTOR * useful / (n * bwd_speed)
    rank_flops = rank_elems
    t_msg = link.message(kvb)
    ratio_f = float(np.median(c_f[:-1]) / t_msg) if g > 1 and t_msg > 0 else math.inf
    t_bwd = link.occupy(kvb) + link.occupy(accb) + link.latency_s
    ratio_b = float(np.median(c_b[:-1]) / t_bwd) if g > 1 and t_bwd > 0 else math.inf
    return Prediction(
        n=n, ulysses=u, forward_s=fwd, backward_s=bwd,
        compute_fwd_s=float(c_f.sum()), compute_bwd_s=float(c_b.sum()), a2a_s=a2a,
        exposed_fwd_s=exp_f, exposed_bwd_s=exp_b, useful_flops=useful_total,
        efficiency=ideal / (fwd + bwd),
        imbalance=float(rank_flops.max() / rank_flops.mean()) if rank_flops.mean() > 0 else 1.0,
        ratio_fwd=ratio_f, ratio_bwd=ratio_b,
        memory_bytes=memory_per_rank(p, n, True, u),
        extra={"slice_bytes": kvb, "acc_bytes": accb})


def crossover_rows(p, speed, bandwidth, latency=0.0, backward=False):
    """Smallest rows per rank L = S/N at which a BALANCED step's compute covers its transfer
    (compute >= transfer), solved from rho * 2 * L^2 * H * (D + Dv) * B / speed
    >= latency + bytes(L) / bandwidth, where rho = the fraction of a step's tiles computed
    (full 1, causal zigzag ~1/2). Returns L for the mask's typical rho."""
    rho = {"full": 1.0}.get(p.mask.strip(), 0.5)
    e = p.dtype_bytes
    fl = 2.0 * p.batch * p.heads * (p.head_dim + p.dv) * rho
    by = p.batch * p.hkv * (p.head_dim + p.dv) * e
    if backward:  # 2.5 x the FLOPs; the k/v slice and its f32 dk/dv accumulator
        fl *= BACKWARD_FACTOR
        by += p.batch * p.hkv * (p.head_dim + p.dv) * 4
    # fl * L^2 / speed - by * L / bw - latency = 0
    a, b, c = fl / speed, -by / bandwidth, -latency
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


# ---------------------------------------------------------------------------------------
# predict mode
# ---------------------------------------------------------------------------------------

PREDICT_N = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def predict_main(args):
    speeds = [float(x) * 1e12 for x in args.speeds.split(",")]
    bws = [float(x) * 1e9 for x in args.bandwidths.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    us = [int(x) for x in args.ulysses.split(",") if x]
    lat = args.latency_us * 1e-6
    over = args.overhead_us * 1e-6
    dtype_bytes = 2 if args.dtype == "bf16" else 4
    out = open(args.out, "w") if args.out else None

    def problem(seq, mask="causal", layout="zigzag"):
        return Problem(seq=seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                       mask=mask, layout=layout, dtype_bytes=dtype_bytes, block_q=args.block,
                       block_kv=args.block)

    def cell(p, n, sp, bw, u=1):
        try:
            pr = predict_ring(p, n, sp, Link(lat, bw), u, overhead=over)
        except ValueError as e:
            print(f"# {e}", file=sys.stderr)
            return "n/a"
        exposed = pr.exposed_fwd_s + pr.exposed_bwd_s > 0.02 * (pr.forward_s + pr.backward_s)
        if out:
            out.write(json.dumps({
                "seq": p.seq, "heads": p.heads, "kv_heads": p.hkv, "head_dim": p.head_dim,
                "dtype": args.dtype, "mask": p.mask, "layout": p.layout, "ulysses": u, "ranks": n,
                "tflops_per_rank": sp / 1e12, "gb_per_s": bw / 1e9,
                "latency_us": args.latency_us, "overhead_us": args.overhead_us,
                "forward_s": pr.forward_s, "backward_s": pr.backward_s,
                "efficiency": pr.efficiency, "imbalance": pr.imbalance,
                "exposed_s": pr.exposed_fwd_s + pr.exposed_bwd_s, "a2a_s": pr.a2a_s,
                "compute_over_transfer_fwd": pr.ratio_fwd,
                "compute_over_transfer_bwd": pr.ratio_bwd,
                "memory_gib": pr.memory_bytes / 2**30}) + "\n")
        return f"{pr.efficiency * 100:.0f}%" + ("*" if exposed else "")

    desc = (f"H = {args.heads}, Hkv = {args.kv_heads or args.heads}, D = {args.head_dim}, "
            f"{args.dtype}, blocks {args.block}, latency {args.latency_us:g} us, "
            f"overhead {args.overhead_us:g} us per step")
    print(f"# Efficiency = useful FLOPs / (N x speed x (forward + backward time)); "
          f"* = communication exposed (> 2 % of the time). {desc}.")
    cols = [f"{sp / 1e12:g}T/{bw / 1e9:g}G" for sp in speeds for bw in bws]
    for seq in seqs:
        for u in [1] + us:
            p = problem(seq)
            print(f"\n## S = {seq:,}, causal, zigzag, "
                  + ("1-D ring" if u == 1 else f"2-D: Ulysses U = {u} x ring of N/{u}")
                  + " (columns: TFLOP/s per rank / GB/s per link)\n")
            print("| N | rows/rank | " + " | ".join(cols) + " |")
            print("|---|---|" + "---|" * len(cols))
            for n in PREDICT_N:
                if n < u or seq % (2 * n):
                    continue
                cells = [cell(p, n, sp, bw, u) for sp in speeds for bw in bws]
                print(f"| {n} | {seq // n:,} | " + " | ".join(cells) + " |")
    # Layouts and masks side by side at one speed and bandwidth.
    sp, bw = args.compare_speed * 1e12, args.compare_bandwidth * 1e9
    cases = [("causal", "zigzag", 1), ("causal", "striped", 1), ("causal", "contiguous", 1),
             ("full", "zigzag", 1), (args.window_mask, "contiguous", 1),
             (args.window_mask, "zigzag", 1)] + [("causal", "zigzag", u) for u in us]
    for seq in seqs:
        print(f"\n## S = {seq:,}: layouts and masks at {args.compare_speed:g} TFLOP/s per rank, "
              f"{args.compare_bandwidth:g} GB/s\n")
        names = [f"{m} {l}" + ("" if u == 1 else f" 2-D U={u}") for m, l, u in cases]
        print("| N | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for n in PREDICT_N:
            cells = []
            for mask, layout, u in cases:
                if n < u or seq % ((2 if layout == "zigzag" else 1) * n):
                    cells.append("")
                    continue
                cells.append(cell(problem(seq, mask, layout), n, sp, bw, u))
            print(f"| {n} | " + " | ".join(cells) + " |")
    # Where the ring stops hiding its transfer: rows per rank of a balanced step.
    print("\n## Crossover: rows per rank L* = S/N below which a step's transfer is exposed "
          f"(forward / backward; causal zigzag, {desc})\n")
    print("| TFLOP/s per rank | " + " | ".join(f"{b / 1e9:g} GB/s" for b in bws) + " |")
    print("|---|" + "---|" * len(bws))
    p = problem(seqs[0])
    for sp in speeds:
        row = []
        for b in bws:
            f = crossover_rows(p, sp, b, lat)
            bk = crossover_rows(p, sp, b, lat, backward=True)
            row.append(f"{f:,.0f} / {bk:,.0f}")
        print(f"| {sp / 1e12:g} | " + " | ".join(row) + " |")
    if out:
        out.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    pr = sub.add_parser("predict", help="efficiency tables for 8 ... 4096 ranks")
    pr.add_argument("--speeds", default="0.1,1,10,100", help="TFLOP/s per rank")
    pr.add_argument("--bandwidths", default="25,100,400", help="GB/s per link")
    pr.add_argument("--latency-us", type=float, default=5.0)
    pr.add_argument("--overhead-us", type=float, default=20.0, help="per ring step")
    pr.add_argument("--seqs", default="1048576,4194304")
    pr.add_argument("--heads", type=int, default=32)
    pr.add_argument("--kv-heads", type=int, default=0, help="0: = heads (MHA)")
    pr.add_argument("--head-dim", type=int, default=128)
    pr.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    pr.add_argument("--block", type=int, default=128)
    pr.add_argument("--ulysses", default="8,16")
    pr.add_argument("--window-mask", default="local:4096,0")
    pr.add_argument("--compare-speed", type=float, default=10.0, help="TFLOP/s, layout table")
    pr.add_argument("--compare-bandwidth", type=float, default=25.0, help="GB/s, layout table")
    pr.add_argument("--out", default="", help="also write one JSON line per cell here")
    va = sub.add_parser("validate", help="measured runs with the emulated link vs the model")
    va.add_argument("--ringsplash", default=os.path.join(ROOT, "build", "ringsplash"),
                    help="the CLI (a copy of your own: a rebuild mid-run changes the numbers)")
    va.add_argument("--out", default=os.path.join(ROOT, "docs", "perf", "scaling.jsonl"))
    va.add_argument("--ranks", default="2,4,8")
    va.add_argument("--seq", default="",
                    help="global S, one value or one per --ranks value (default: 8192 for "
                         "N < 8, 16384 for N >= 8)")
    va.add_argument("--heads", default="",
                    help="H, one value or one per --ranks value (default: 4 for N < 8, 2 for "
                         "N >= 8)")
    va.add_argument("--passes", default="fwd,bwd", help="which passes to run (fwd,bwd)")
    va.add_argument("--targets", default="0.5,1,2.5",
                    help="transfer / compute per step of the link runs")
    va.add_argument("--latency-us", type=float, default=50.0)
    va.add_argument("--wake-latency", type=float, default=1.5,
                    help="latency of the latency-only calibration link, x compute per step")
    va.add_argument("--iters", type=int, default=2, help="timed iterations per run (median)")
    va.add_argument("--repeats", type=int, default=3, help="runs per setting (best kept)")
    va.add_argument("--quick", action="store_true", help="fewer configurations")
    va.add_argument("--cases", default="", help="only these MASK:LAYOUT, e.g. full:zigzag")
    ti = sub.add_parser("tiles", help="the model's tile counts vs the bench's")
    ti.add_argument("--ringsplash", default=os.path.join(ROOT, "build", "ringsplash"))
    args = ap.parse_args()
    if args.mode == "predict":
        predict_main(args)
        return
    # The measuring modes live beside this file (they import the model from it).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import scaling_validate
    {"validate": scaling_validate.validate_main, "tiles": scaling_validate.tiles_main}[args.mode](args)


if __name__ == "__main__":
    main()

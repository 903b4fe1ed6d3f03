"""Ring splash attention for JAX: a kernel called inside ``jax.shard_map``.

``make_ring_attention(mask, ring_axis=...)`` returns a kernel that each device
calls on its slice of the sequence (SPEC §4, §7)::

    mesh = jax.make_mesh((n,), ("ring",))
    kernel = ringsplash.jax.make_ring_attention(CausalMask((S, S)), ring_axis="ring")
    q, k, v = (ringsplash.jax.shard_sequence(x, n) for x in (q, k, v))   # zigzag order
    out = jax.shard_map(kernel, mesh=mesh, in_specs=P(None, "ring"),
                        out_specs=P(None, "ring"))(q, k, v)
    out = ringsplash.jax.unshard_sequence(out, n)

The ring is JAX's own: rank ``r = lax.axis_index(ring_axis)`` holds, at step
``t``, the key/value slice of source rank ``(r - t) mod N``. Every step is one
XLA FFI call of the block-sparse kernel on the local queries against that
slice, with the **global** positions of both slices passed as (traced) operands
-- computed here from the layout formula and the traced rank, so one
compilation serves every rank and every step. Partial (out, lse) are merged in
f32 with the guarded log-sum-exp merge of SPEC §2; K/V and the kv segment ids
move to rank ``r + 1`` with ``lax.ppermute`` (issued before the step's compute,
so XLA may overlap them; no send after the last step). Sinks join once, at the
end. The mask and its block metadata are built once, by the mask object.

The backward (``jax.custom_vjp``) is a second ring: ``dq`` accumulates
locally; f32 ``dk``/``dv`` accumulators travel with their K/V slice and one
more ``ppermute`` after the last step brings them home; ``dsinks`` is computed
once per rank from (out, dout, lse) and summed over the ring once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .. import layouts as _layouts
from .._errors import DTypeError, InvalidArgumentError
from .._types import as_block_sizes
from ._ffi import cotangent_like as _cotangent_like
from ._ffi import to_varying as _to_varying
from ._ffi import varying as _varying
from .splash import check_arrays

__all__ = ["make_ring_attention", "RingAttentionKernel", "shard_sequence", "unshard_sequence"]


# --------------------------------------------------------------------------
# Layouts on jax arrays.

def _check_layout(layout: str) -> str:
    if layout not in _layouts.LAYOUTS:
        raise InvalidArgumentError(
            f"unknown sequence layout {layout!r}; expected one of "
            f"{', '.join(_layouts.LAYOUTS)}")
    return layout


def _zigzag_chunk_order(n: int) -> np.ndarray:
    """Chunk order of the zigzag layout: rank r's chunks r and 2n-1-r, rank by rank."""
    return np.array([c for r in range(n) for c in (r, 2 * n - 1 - r)], dtype=np.int32)


def _permute_sequence(x, num_shards: int, layout: str, axis: int, inverse: bool):
    x = jnp.asarray(x)
    _check_layout(layout)
    if not -x.ndim <= axis < x.ndim:
        raise InvalidArgumentError(
            f"axis {axis} is out of range for an array of rank {x.ndim} (shape {x.shape})")
    axis %= x.ndim
    s = x.shape[axis]
    _layouts.check_divisible(layout, s, num_shards)
    n = int(num_shards)
    pre, post = x.shape[:axis], x.shape[axis + 1:]
    if layout == "contiguous" or n == 1:
        return x
    if layout == "striped":
        # sharded[r * (s/n) + j] = x[j * n + r]: a transpose of an [s/n, n] grid.
        grid = (s // n, n) if not inverse else (n, s // n)
        y = x.reshape(pre + grid + post)
        y = jnp.swapaxes(y, axis, axis + 1)
        return y.reshape(x.shape)
    # zigzag: 2n equal chunks, reordered.
    order = _zigzag_chunk_order(n)
    if inverse:
        order = np.argsort(order).astype(np.int32)
    y = x.reshape(pre + (2 * n, s // (2 * n)) + post)
    y = jnp.take(y, jnp.asarray(order), axis=axis)
    return y.reshape(x.shape)


def shard_sequence(x, num_shards: int, layout: str = "zigzag", axis: int = 1):
    """Reorder a global array along ``axis`` (the sequence) so that a plain
    ``PartitionSpec(..., ring_axis)`` sharding over ``num_shards`` devices gives
    each device the rows of ``layout`` (device ``r`` gets contiguous block
    ``r``). Inverse: :func:`unshard_sequence`. Use ``axis=0`` for 1-D
    (unbatched) segment ids."""
    return _permute_sequence(x, num_shards, layout, axis, inverse=False)


def unshard_sequence(x, num_shards: int, layout: str = "zigzag", axis: int = 1):
    """Inverse of :func:`shard_sequence`: back to global token order."""
    return _permute_sequence(x, num_shards, layout, axis, inverse=True)


def _positions(layout: str, local_len: int, rank, n: int):
    """Global positions (int32 [local_len]) of the rows rank ``rank`` holds;
    ``rank`` may be traced. Same formula as ringsplash.layouts.positions."""
    i = jnp.arange(local_len, dtype=jnp.int32)
    rank = jnp.asarray(rank, dtype=jnp.int32)
    if layout == "contiguous":
        return rank * local_len + i
    if layout == "striped":
        return i * n + rank
    c = local_len // 2  # zigzag: chunks rank and 2n-1-rank of 2n chunks of c rows
    return jnp.where(i < c, rank * c + i, (2 * n - 1 - rank) * c + (i - c))


# --------------------------------------------------------------------------
# Merging partial results (SPEC §2), guarded against empty (lse = -inf) parts.

def _lse_rows(lse):
    """[B, H, S] -> [B, S, H, 1], to scale out [B, S, H, Dv]."""
    return jnp.swapaxes(lse, 1, 2)[..., None]


def _merge(out_a, lse_a, out_b, lse_b):
    a_empty = lse_a == -jnp.inf
    b_empty = lse_b == -jnp.inf
    d = jnp.where(a_empty | b_empty, 0.0, lse_b - lse_a)
    lse = jnp.where(a_empty, lse_b, jnp.where(b_empty, lse_a, lse_a + jax.nn.softplus(d)))
    w = jnp.where(a_empty, 1.0, jnp.where(b_empty, 0.0, jax.nn.sigmoid(d)))
    out = out_a + _lse_rows(w) * (out_b - out_a)
    return out, lse


def _add_sinks(out, lse, sinks):
    """Join the sink logit once per row: lse' = logaddexp(lse, sink[h]),
    out' = out * exp(lse - lse') (0 where lse' is -inf: a -inf sink, no keys)."""
    sink = sinks.astype(jnp.float32)[None, :, None]
    lse_final = jnp.logaddexp(lse, sink)
    finite = lse_final != -jnp.inf
    factor = jnp.where(finite, jnp.exp(lse - jnp.where(finite, lse_final, 0.0)), 0.0)
    return out * _lse_rows(factor), lse_final


def _sink_probability(sinks, lse):
    """exp(sink[h] - lse[b, h, i]), 0 where the row is empty (lse = -inf)."""
    sink = sinks.astype(jnp.float32)[None, :, None]
    finite = lse != -jnp.inf
    return jnp.where(finite, jnp.exp(sink - jnp.where(finite, lse, 0.0)), 0.0)


# --------------------------------------------------------------------------
# The kernel.

class _Plan(NamedTuple):
    """Static per-call facts (hashable: a custom_vjp non-differentiable argument)."""
    n: int              # ring size
    lq: int             # local query rows
    lkv: int            # local key/value rows
    scale: float
    threads: int


def _axis_size(axis_name) -> int:
    try:
        if hasattr(lax, "axis_size"):
            return int(lax.axis_size(axis_name))
        return int(lax.psum(1, axis_name))  # older JAX
    except NameError:
        raise InvalidArgumentError(
            f"ring axis {axis_name!r} does not exist here: call the ring attention kernel "
            f"inside jax.shard_map over a mesh that has an axis named {axis_name!r} (the "
            f"kernel's ring_axis), with q, k and v sharded on the sequence over it") from None


def _segment_pair(segment_ids):
    if segment_ids is None:
        return None, None
    try:
        qs, ks = segment_ids.q, segment_ids.kv
    except AttributeError:
        try:
            qs, ks = segment_ids
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                "segment_ids must be a ringsplash.SegmentIds(q, kv) (or a (q, kv) pair)"
            ) from None
    if (qs is None) != (ks is None):
        raise InvalidArgumentError("segment_ids: give both q and kv segment ids or neither")
    return qs, ks


def _local_segments(seg, batch: int, local_len: int, what: str):
    seg = jnp.asarray(seg)
    if not jnp.issubdtype(seg.dtype, jnp.integer):
        raise DTypeError(f"{what} segment ids must be integers, got {seg.dtype}")
    if seg.ndim == 1:
        if seg.shape[0] != local_len:
            raise InvalidArgumentError(
                f"{what} segment ids have {seg.shape[0]} local entries, the local {what} "
                f"slice has {local_len} rows")
        seg = jnp.broadcast_to(seg, (batch, local_len))
    elif seg.ndim != 2 or seg.shape != (batch, local_len):
        raise InvalidArgumentError(
            f"{what} segment ids must be [B, S_local] = [{batch}, {local_len}] (or "
            f"[S_local]) on each device, got shape {tuple(seg.shape)}")
    return seg.astype(jnp.int32)


class RingAttentionKernel:
    """A ring splash attention kernel; see :func:`make_ring_attention`.

    ``kernel(q, k, v, segment_ids=None, sinks=None) -> out`` and
    ``kernel.with_lse(...) -> (out, lse)``, called inside ``jax.shard_map``
    with q [B, Sq/N, H, D], k [B, Skv/N, Hkv, D], v [B, Skv/N, Hkv, Dv] (this
    device's rows in the kernel's layout), segment ids this device's [B, S/N]
    (or [S/N]) slices, sinks the full f32 [H]. ``lse`` is [B, H, Sq/N] f32.
    Differentiable in q, k, v and sinks (and through ``lse``).
    """

    def __init__(self, mask, *, ring_axis, layout="zigzag", scale=None, logits_soft_cap=None,
                 block_sizes=None, num_threads=None):
        from ..masks import as_mask

        if ring_axis is None:
            raise InvalidArgumentError("make_ring_attention: ring_axis is required")
        self.ring_axis = ring_axis
        self.layout = _check_layout(layout)
        self.mask = as_mask(mask)
        self.scale = None if scale is None else float(scale)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise InvalidArgumentError(
                f"logits_soft_cap must be positive, got {logits_soft_cap!r}")
        self.block_sizes = as_block_sizes(block_sizes)
        if num_threads is not None and (not isinstance(num_threads, (int, np.integer))
                                        or num_threads < 1):
            raise InvalidArgumentError(
                f"num_threads: expected an integer >= 1 or None, got {num_threads!r}")
        self.num_threads = num_threads

        ring = jax.custom_vjp(self._ring, nondiff_argnums=(0,))
        ring.defvjp(self._ring_fwd, self._ring_bwd, symbolic_zeros=True)
        self._ring_vjp = ring

    def __repr__(self):
        return (f"RingAttentionKernel(mask={self.mask!r}, ring_axis={self.ring_axis!r}, "
                f"layout={self.layout!r})")

    # -- public entry points ----------------------------------------------

    def __call__(self, q, k, v, segment_ids=None, sinks=None):
        return self.with_lse(q, k, v, segment_ids, sinks)[0]

    def with_lse(self, q, k, v, segment_ids=None, sinks=None):
        plan, args = self._prepare(q, k, v, segment_ids, sinks)
        return self._ring_vjp(plan, *args)

    # -- validation ---------------------------------------------------------

    def _prepare(self, q, k, v, segment_ids, sinks):
        from ._ffi import default_num_threads

        n = _axis_size(self.ring_axis)
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        # Ranks, dtypes, GQA heads, sinks: the single-device kernel's checks.
        check_arrays(q, k, v, None, sinks)
        b, lq, h, d = q.shape
        lkv = k.shape[1]
        sq, skv = lq * n, lkv * n
        _layouts.check_divisible(self.layout, sq, n, "query sequence")
        _layouts.check_divisible(self.layout, skv, n, "key/value sequence")
        mshape = getattr(self.mask, "shape", None)
        if mshape is not None and tuple(mshape[-2:]) != (sq, skv):
            raise InvalidArgumentError(
                f"mask shape {tuple(mshape)} does not match the global sequence lengths "
                f"(Sq, Skv) = ({sq}, {skv}) (local q/kv rows {lq}/{lkv} x {n} ranks on ring "
                f"axis {self.ring_axis!r}); ring masks are built for the whole sequence")
        if mshape is not None and len(mshape) == 3 and mshape[0] != h:
            raise InvalidArgumentError(
                f"mask has {mshape[0]} heads (shape {tuple(mshape)}), q has {h} heads")
        qs, ks = _segment_pair(segment_ids)
        if qs is not None:
            qs = _local_segments(qs, b, lq, "query")
            ks = _local_segments(ks, b, lkv, "key/value")
        if sinks is not None:
            sinks = jnp.asarray(sinks)
            if not jnp.issubdtype(sinks.dtype, jnp.floating):
                raise DTypeError(f"sinks: expected floating point, got {sinks.dtype}")
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d)
        threads = self.num_threads if self.num_threads is not None else default_num_threads()
        plan = _Plan(n=n, lq=lq, lkv=lkv, scale=float(scale), threads=int(threads))
        return plan, (q, k, v, qs, ks, sinks)

    # -- one ring step --------------------------------------------------------

    def _common(self, plan, q_segments):
        return dict(mask=self.mask, scale=plan.scale, logits_soft_cap=self.logits_soft_cap,
                    sinks=None, q_segment_ids=q_segments, block_sizes=self.block_sizes,
                    num_threads=plan.threads)

    def _shift(self, plan, tree):
        n = plan.n
        return lax.ppermute(tree, self.ring_axis, perm=[(i, (i + 1) % n) for i in range(n)])

    # -- forward ring -----------------------------------------------------------

    def _forward(self, plan, q, k, v, qs, ks, sinks):
        from ._ffi import forward_call

        n, layout = plan.n, self.layout
        rank = lax.axis_index(self.ring_axis)
        vma = frozenset().union(*(_varying(x) for x in (q, k, v, qs, ks)), _varying(rank))
        q, qs = _to_varying(q, vma), _to_varying(qs, vma)
        q_pos = _to_varying(_positions(layout, plan.lq, rank, n), vma)
        common = self._common(plan, qs)
        out = lse = None
        k_cur, v_cur, ks_cur = (_to_varying(x, vma) for x in (k, v, ks))
        for t in range(n):
            if t < n - 1:  # the slice leaves for rank r+1 while this step computes
                nxt = self._shift(plan, (k_cur, v_cur, ks_cur))
            src = (rank - t) % n
            kv_pos = _to_varying(_positions(layout, plan.lkv, src, n), vma)
            o, l = forward_call(q, k_cur, v_cur, kv_segment_ids=ks_cur, q_positions=q_pos,
                                kv_positions=kv_pos, out_dtype=jnp.float32, **common)
            out, lse = (o, l) if out is None else _merge(out, lse, o, l)
            if t < n - 1:
                k_cur, v_cur, ks_cur = nxt
        if sinks is not None:
            out, lse = _add_sinks(out, lse, sinks)
        return out.astype(q.dtype), lse

    def _ring(self, plan, q, k, v, qs, ks, sinks):
        return self._forward(plan, q, k, v, qs, ks, sinks)

    def _ring_fwd(self, plan, q, k, v, qs, ks, sinks):
        q, k, v, qs, ks, sinks = jax.tree_util.tree_map(
            lambda p: p.value, (q, k, v, qs, ks, sinks))
        out, lse = self._forward(plan, q, k, v, qs, ks, sinks)
        return (out, lse), (q, k, v, qs, ks, sinks, out, lse)

    # -- backward ring ----------------------------------------------------------

    def _ring_bwd(self, plan, res, cts):
        from ._ffi import backward_call

        q, k, v, qs, ks, sinks, out, lse = res
        dout, dlse = cts
        n, layout = plan.n, self.layout
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(out.shape, out.dtype)
        dout = dout.astype(out.dtype)
        with_dlse = not isinstance(dlse, SymbolicZero)

        rank = lax.axis_index(self.ring_axis)
        vma = frozenset().union(*(_varying(x) for x in (q, k, v, qs, ks, out, lse, dout)),
                                _varying(dlse) if with_dlse else frozenset(), _varying(rank))
        q_primal = q
        q, qs, out, lse, dout = (_to_varying(x, vma) for x in (q, qs, out, lse, dout))

        # D_i = dout_i . out_i (f32); a cotangent of lse enters as D_i - dlse_i
        # (d lse_i / d s_ij = p_ij), in every step's kernel (backward_call's dlse)
        # and in dsinks.
        d_rows = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        dlse_run = None
        if with_dlse:
            dlse_run = _to_varying(dlse.astype(jnp.float32), vma)
            d_rows = d_rows - jnp.swapaxes(dlse_run, 1, 2)

        q_pos = _to_varying(_positions(layout, plan.lq, rank, n), vma)
        common = self._common(plan, qs)
        dq = dk = dv = None
        k_cur, v_cur, ks_cur = (_to_varying(x, vma) for x in (k, v, ks))
        for t in range(n):
            if t < n - 1:
                nxt = self._shift(plan, (k_cur, v_cur, ks_cur))
            src = (rank - t) % n
            kv_pos = _to_varying(_positions(layout, plan.lkv, src, n), vma)
            dq_t, dk_t, dv_t, _ = backward_call(
                q, k_cur, v_cur, out, lse, dout, dlse=dlse_run, kv_segment_ids=ks_cur,
                q_positions=q_pos, kv_positions=kv_pos, grad_dtype=jnp.float32, **common)
            dq = dq_t if dq is None else dq + dq_t
            # dK/dV of the visiting slice: its accumulators travel with it; the
            # shift after the last step sends them home (slice r+1 is here then).
            dk = dk_t if dk is None else dk + dk_t
            dv = dv_t if dv is None else dv + dv_t
            if n > 1:
                dk, dv = self._shift(plan, (dk, dv))
            if t < n - 1:
                k_cur, v_cur, ks_cur = nxt

        dsinks = None
        if sinks is not None:
            # dsinks[h] = -sum_{b,i} exp(sink[h] - lse[b,h,i]) D[b,i,h], over this
            # rank's rows; the sum over the ring happens once, in _cotangent_like
            # (a psum over every axis the rows vary over but sinks do not).
            p_sink = _sink_probability(sinks, lse)                     # [B, H, Sq]
            dsinks = -jnp.einsum("bhi,bih->h", p_sink, d_rows)
            dsinks = _cotangent_like(dsinks, sinks).astype(sinks.dtype)

        dq = _cotangent_like(dq, q_primal).astype(q.dtype)
        dk = _cotangent_like(dk, k).astype(k.dtype)
        dv = _cotangent_like(dv, v).astype(v.dtype)
        return dq, dk, dv, None, None, dsinks


def make_ring_attention(mask, *, ring_axis, layout: str = "zigzag", scale=None,
                        logits_soft_cap=None, block_sizes=None,
                        num_threads=None) -> RingAttentionKernel:
    """Ring splash attention over the mesh axis ``ring_axis`` (SPEC §4).

    Args:
      mask: a ringsplash mask object over the GLOBAL sequence (shape
        (Sq, Skv) or (H, Sq, Skv)), a dense bool array, a mask string, or None
        (full attention). Evaluated on global positions on every step.
      ring_axis: name of the ``jax.shard_map`` mesh axis the sequence is
        sharded over.
      layout: "zigzag" (default; balanced causal work), "contiguous" or
        "striped". The global arrays must be permuted with
        :func:`shard_sequence` (same layout) before sharding them with
        ``PartitionSpec(None, ring_axis)``.
      scale: logit scale, default 1/sqrt(head_dim).
      logits_soft_cap: optional soft cap ``cap * tanh(s / cap)``.
      block_sizes: ringsplash.BlockSizes or a (q, kv) pair.
      num_threads: kernel threads per device (default: ringsplash's per-device
        share of the cores).

    Returns:
      A :class:`RingAttentionKernel` kernel.
    """
    return RingAttentionKernel(mask, ring_axis=ring_axis, layout=layout, scale=scale,
                         logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
                         num_threads=num_threads)

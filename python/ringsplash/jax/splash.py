"""Single-device splash attention for JAX: ``make_splash_attention``.

The kernel is one XLA FFI call forward and one backward (``jax.custom_vjp``),
so it works under ``jit``, ``grad`` (q, k, v and sinks), ``vmap`` and with
float32 and bfloat16 arrays. Arrays are ``[B, S, H, D]`` as everywhere in
ringsplash; unbatched ``[S, H, D]`` arrays (splash attention's per-example
convention, under ``vmap`` over the batch) are taken too.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from .._errors import DTypeError, InvalidArgumentError
from .._types import SegmentIds, as_block_sizes
from ..masks import as_mask
from . import _ffi

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class _Config:
    """What a kernel fixes when it is made (static to every trace)."""

    def __init__(self, mask, scale, logits_soft_cap, block_sizes, num_threads):
        self.mask = as_mask(mask)
        self.scale = None if scale is None else float(scale)
        if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
            raise InvalidArgumentError(
                f"logits_soft_cap: expected a value > 0 or None, got {logits_soft_cap}"
            )
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.block_sizes = as_block_sizes(block_sizes)
        if num_threads is not None and int(num_threads) < 1:
            raise InvalidArgumentError(f"num_threads: expected >= 1 or None, got {num_threads}")
        self.num_threads = None if num_threads is None else int(num_threads)

    def threads(self) -> int:
        return self.num_threads if self.num_threads is not None else _ffi.default_num_threads()

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


def check_arrays(q, k, v, segment_ids, sinks):
    """Shapes and dtypes of a kernel call, checked at trace time (clear errors before XLA's)."""
    for name, x, dims in (
        ("q", q, "[B, q_seq_len, H, D]"),
        ("k", k, "[B, kv_seq_len, H_kv, D]"),
        ("v", v, "[B, kv_seq_len, H_kv, Dv]"),
    ):
        if jnp.ndim(x) != 4:
            raise InvalidArgumentError(f"{name}: expected {dims} (4 dims), got shape {jnp.shape(x)}")
        if jnp.result_type(x) not in _DTYPES:
            raise DTypeError(
                f"{name}: expected float32, bfloat16 or float16, got {jnp.result_type(x)}"
            )
    if not (jnp.result_type(q) == jnp.result_type(k) == jnp.result_type(v)):
        raise DTypeError(
            f"q, k, v: expected one dtype, got {jnp.result_type(q)}, {jnp.result_type(k)}, "
            f"{jnp.result_type(v)}"
        )
    b, sq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] < 1 or h % k.shape[2] != 0:
        raise InvalidArgumentError(
            f"k: expected shape [B={b}, kv_seq_len, H_kv, D={d}] with H_kv dividing H={h}, "
            f"got {k.shape}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise InvalidArgumentError(
            f"v: expected shape [B={b}, kv_seq_len={k.shape[1]}, H_kv={k.shape[2]}, Dv], "
            f"got {v.shape}"
        )
    if segment_ids is not None:
        if not isinstance(segment_ids, SegmentIds) and not (
            isinstance(segment_ids, tuple) and len(segment_ids) == 2
        ):
            raise InvalidArgumentError(
                "segment_ids: expected ringsplash.SegmentIds(q=..., kv=...), got "
                f"{type(segment_ids).__name__}"
            )
        qs, kvs = segment_ids
        for name, ids, length in (("segment_ids.q", qs, sq), ("segment_ids.kv", kvs, k.shape[1])):
            if jnp.shape(ids) != (b, length):
                raise InvalidArgumentError(
                    f"{name}: expected shape [B={b}, {length}], got {jnp.shape(ids)}"
                )
            if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
                raise DTypeError(f"{name}: expected integer ids, got {jnp.result_type(ids)}")
    if sinks is not None and jnp.shape(sinks) != (h,):
        raise InvalidArgumentError(f"sinks: expected shape [H={h}], got {jnp.shape(sinks)}")


def _batched(q, k, v, segment_ids):
    """[S,H,D] arrays (and [S] ids) as a batch of one; returns a flag to undo it."""
    if jnp.ndim(q) == 3 and jnp.ndim(k) == 3 and jnp.ndim(v) == 3:
        if segment_ids is not None:
            segment_ids = SegmentIds(jnp.asarray(segment_ids[0])[None],
                                     jnp.asarray(segment_ids[1])[None])
        return q[None], k[None], v[None], segment_ids, True
    return q, k, v, segment_ids, False


class SplashAttentionKernel:
    """``kernel(q, k, v, segment_ids=None, sinks=None) -> out``; ``kernel.with_lse`` also gives lse."""

    def __init__(self, config: _Config):
        self._config = config
        self._attend = self._make_vjp()

    @property
    def mask(self):
        return self._config.mask

    def __call__(self, q, k, v, segment_ids: Optional[SegmentIds] = None, sinks=None):
        return self.with_lse(q, k, v, segment_ids, sinks)[0]

    def with_lse(self, q, k, v, segment_ids: Optional[SegmentIds] = None, sinks=None):
        """``(out, lse)``: lse ``[B, H, q_seq_len]`` float32, natural log, sinks included."""
        q, k, v, segment_ids, unbatched = _batched(q, k, v, segment_ids)
        check_arrays(q, k, v, segment_ids, sinks)
        self._config.mask.check(q.shape[2], q.shape[1], k.shape[1])
        qs, kvs = (None, None) if segment_ids is None else segment_ids
        if qs is not None:
            qs, kvs = jnp.asarray(qs, jnp.int32), jnp.asarray(kvs, jnp.int32)
        if sinks is not None:
            sinks = jnp.asarray(sinks, jnp.float32)
        out, lse = self._attend(q, k, v, sinks, qs, kvs)
        if unbatched:
            return out[0], lse[0]
        return out, lse

    def _make_vjp(self):
        cfg = self._config

        def call_args(q, k, sinks, qs, kvs):
            return dict(
                mask=cfg.mask,
                scale=cfg.scale_for(q.shape[-1]),
                logits_soft_cap=cfg.logits_soft_cap,
                sinks=sinks,
                q_segment_ids=qs,
                kv_segment_ids=kvs,
                q_positions=None,  # 0 .. S-1
                kv_positions=None,
                block_sizes=cfg.block_sizes,
                num_threads=cfg.threads(),
            )

        @jax.custom_vjp
        def attend(q, k, v, sinks, qs, kvs):
            return _ffi.forward_call(q, k, v, out_dtype=q.dtype, **call_args(q, k, sinks, qs, kvs))

        def fwd(*primals):
            # symbolic_zeros=True wraps each primal as CustomVJPPrimal(value, perturbed).
            q, k, v, sinks, qs, kvs = jax.tree_util.tree_map(
                _primal_value, primals, is_leaf=_is_primal)
            out, lse = attend(q, k, v, sinks, qs, kvs)
            return (out, lse), (q, k, v, sinks, qs, kvs, out, lse)

        def bwd(res, cotangents):
            q, k, v, sinks, qs, kvs, out, lse = res
            dout, dlse = cotangents
            dout = _materialize(dout, out)
            dlse = None if _is_zero(dlse) else dlse
            dq, dk, dv, dsinks = _ffi.backward_call(
                q, k, v, out, lse, dout.astype(out.dtype), grad_dtype=q.dtype, dlse=dlse,
                **call_args(q, k, sinks, qs, kvs)
            )
            # Inside shard_map a gradient sums over the mesh axes its rows vary
            # over but its primal does not (sinks replicated over a data axis).
            grads = tuple(
                None if g is None else _ffi.cotangent_like(g, p).astype(p.dtype)
                for g, p in ((dq, q), (dk, k), (dv, v), (dsinks, sinks)))
            return grads + (None, None)

        attend.defvjp(fwd, bwd, symbolic_zeros=True)

        def attend_plain(q, k, v, sinks, qs, kvs):
            return attend(q, k, v, sinks, qs, kvs)

        return attend_plain


def _is_primal(x) -> bool:
    return type(x).__name__ == "CustomVJPPrimal"


def _primal_value(x):
    return x.value if _is_primal(x) else x


def _is_zero(ct) -> bool:
    return ct is None or type(ct).__name__ == "SymbolicZero"


def _materialize(ct, like):
    return jnp.zeros(like.shape, like.dtype) if _is_zero(ct) else ct


def make_splash_attention(mask=None, *, scale=None, logits_soft_cap=None, block_sizes=None,
                          num_threads=None) -> SplashAttentionKernel:
    """A single-device block-sparse attention kernel for JAX.

    Args:
      mask: a ``ringsplash.masks`` mask (the names of JAX's splash attention:
        ``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``, ``NumpyMask``,
        ``MultiHeadMask``, ``&``, ``|``), mask text, a boolean array, or None (full).
        Built and analysed once; the kernel may be called any number of times.
      scale: logit scale, default ``1/sqrt(D)``.
      logits_soft_cap: ``s -> cap * tanh(s / cap)``.
      block_sizes: ``BlockSizes(q, kv)`` or a pair (multiples of 16).
      num_threads: kernel threads per call; default: this process's cores divided
        among its CPU devices (``RINGSPLASH_NUM_THREADS`` overrides).

    Returns:
      ``kernel(q, k, v, segment_ids=None, sinks=None) -> out`` with q
      ``[B, Sq, H, D]``, k ``[B, Skv, Hkv, D]``, v ``[B, Skv, Hkv, Dv]`` (or the
      same without B), ``segment_ids`` a ``ringsplash.SegmentIds`` and ``sinks``
      float ``[H]``; ``kernel.with_lse(...)`` returns ``(out, lse)``.
    """
    return SplashAttentionKernel(_Config(mask, scale, logits_soft_cap, block_sizes, num_threads))

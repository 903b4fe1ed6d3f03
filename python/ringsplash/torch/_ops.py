"""The PyTorch custom ops under ringsplash.torch: one kernel call each.

    torch.ops.ringsplash.attention_fwd   q, k, v ([B, S, H, D] views, any strides)
                                         -> out [B, Sq, H, Dv], lse [B, H, Sq] f32
    torch.ops.ringsplash.attention_bwd   ... out, lse, dout -> dq, dk, dv, dsinks

Registered with ``torch.library.custom_op`` (with fake implementations, so
``torch.compile(fullgraph=True)`` traces through them); tensors reach the C++
kernels through DLPack without copies, and the GIL is released while they
run. Masks cross as their registry id (``Mask.registry_id``), a boolean
``dense_mask`` tensor (SDPA's ``attn_mask``) is combined with it per call.
Absent optional outputs (dsinks without sinks) are empty tensors.
``forward_step`` / ``backward_step`` call them without autograd (the ring's
steps); ``_autograd.py`` wraps them for users.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .. import _core
from ..masks import by_id

Tensor = torch.Tensor


def _mask(mask_id: int, dense_mask: Optional[Tensor]):
    mask = by_id(mask_id)
    if dense_mask is not None:
        values = np.ascontiguousarray(dense_mask.detach().cpu().numpy(), dtype=np.uint8)
        mask = mask & _core.Mask.dense(values)
    return mask


def _positions(p: Optional[Tensor]):
    return None if p is None else p.detach().to(torch.int64).contiguous()


def _kernel_args(sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, dense_mask,
                 mask_id, scale, softcap, block_q, block_kv, num_threads):
    return dict(
        mask=_mask(mask_id, dense_mask),
        scale=scale,
        softcap=softcap if softcap > 0 else None,
        sinks=None if sinks is None else sinks.detach().to(torch.float32),
        q_segments=None if q_segment_ids is None else q_segment_ids.detach().to(torch.int32),
        kv_segments=None if kv_segment_ids is None else kv_segment_ids.detach().to(torch.int32),
        q_positions=_positions(q_positions),
        kv_positions=_positions(kv_positions),
        block_q=block_q,
        block_kv=block_kv,
        num_threads=num_threads,
    )


@torch.library.custom_op("ringsplash::attention_fwd", mutates_args=(), device_types="cpu")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
                  q_segment_ids: Optional[Tensor], kv_segment_ids: Optional[Tensor],
                  q_positions: Optional[Tensor], kv_positions: Optional[Tensor],
                  dense_mask: Optional[Tensor], mask_id: int, scale: float, softcap: float,
                  block_q: int, block_kv: int, num_threads: int,
                  out_f32: bool) -> Tuple[Tensor, Tensor]:
    b, sq, h, _ = q.shape
    out = torch.empty((b, sq, h, v.shape[3]), dtype=torch.float32 if out_f32 else q.dtype)
    lse = torch.empty((b, h, sq), dtype=torch.float32)
    _core.forward(q.detach(), k.detach(), v.detach(), out, lse,
                  **_kernel_args(sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                 dense_mask, mask_id, scale, softcap, block_q, block_kv,
                                 num_threads))
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, dense_mask,
      mask_id, scale, softcap, block_q, block_kv, num_threads, out_f32):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[3]), dtype=torch.float32 if out_f32 else q.dtype)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("ringsplash::attention_bwd", mutates_args=(), device_types="cpu")
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                  sinks: Optional[Tensor], q_segment_ids: Optional[Tensor],
                  kv_segment_ids: Optional[Tensor], q_positions: Optional[Tensor],
                  kv_positions: Optional[Tensor], dense_mask: Optional[Tensor], mask_id: int,
                  scale: float, softcap: float, block_q: int, block_kv: int, num_threads: int,
                  grads_f32: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dtype = torch.float32 if grads_f32 else q.dtype
    dq = torch.empty(q.shape, dtype=dtype)
    dk = torch.empty(k.shape, dtype=dtype)
    dv = torch.empty(v.shape, dtype=dtype)
    dsinks = torch.empty((q.shape[2] if sinks is not None else 0,), dtype=torch.float32)
    _core.backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                   dout.detach(), dq, dk, dv, dsinks if sinks is not None else None,
                   **_kernel_args(sinks, q_segment_ids, kv_segment_ids, q_positions,
                                  kv_positions, dense_mask, mask_id, scale, softcap, block_q,
                                  block_kv, num_threads))
    return dq, dk, dv, dsinks


@attention_bwd.register_fake
def _(q, k, v, out, lse, dout, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
      dense_mask, mask_id, scale, softcap, block_q, block_kv, num_threads, grads_f32):
    dtype = torch.float32 if grads_f32 else q.dtype
    return (q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype),
            v.new_empty(v.shape, dtype=dtype),
            q.new_empty((q.shape[2] if sinks is not None else 0,), dtype=torch.float32))


def forward_step(q, k, v, *, mask_id: int, scale: float, softcap: float = 0.0, sinks=None,
                 q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                 dense_mask=None, block_q: int = 128, block_kv: int = 128, num_threads: int = 0,
                 out_f32: bool = True):
    """One forward kernel call, no autograd: ``(out, lse)``; with sinks both include them.

    Positions (int64 ``[S]``, GLOBAL) default to ``0 .. S-1``. A row with no
    allowed key: out 0, lse -inf.
    """
    return torch.ops.ringsplash.attention_fwd(
        q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, dense_mask,
        mask_id, float(scale), float(softcap), block_q, block_kv, num_threads, out_f32)


def backward_step(q, k, v, out, lse, dout, *, mask_id: int, scale: float, softcap: float = 0.0,
                  sinks=None, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                  kv_positions=None, dense_mask=None, block_q: int = 128, block_kv: int = 128,
                  num_threads: int = 0, grads_f32: bool = True, dlse=None):
    """One backward kernel call, no autograd: ``(dq, dk, dv, dsinks or None)``.

    ``out``/``lse`` are the row's final ones (lse with the sink); pass
    ``sinks=None`` for one key/value slice of a ring. ``dlse`` ``[B, H, Sq]``:
    an upstream gradient of lse, entering as ``D_i - dlse_i`` through an extra
    column of out (``-dlse``), dout (1) and v (0) -- see ringsplash/jax/_ffi.py.
    """
    dv_dim = v.shape[-1]
    if dlse is not None:
        column = dlse.transpose(1, 2).unsqueeze(-1).to(torch.float32)  # [B, Sq, H, 1]
        out = torch.cat([out.to(torch.float32), -column], dim=-1)
        dout = torch.cat([dout.to(torch.float32), torch.ones_like(column)], dim=-1)
        v = torch.cat([v, v.new_zeros(v.shape[:-1] + (1,))], dim=-1)
    dq, dk, dv, dsinks = torch.ops.ringsplash.attention_bwd(
        q, k, v, out, lse, dout, sinks, q_segment_ids, kv_segment_ids, q_positions,
        kv_positions, dense_mask, mask_id, float(scale), float(softcap), block_q, block_kv,
        num_threads, grads_f32)
    if dlse is not None:
        dv = dv[..., :dv_dim].contiguous()  # callers send it (gloo wants contiguous)
    return dq, dk, dv, (dsinks if sinks is not None else None)

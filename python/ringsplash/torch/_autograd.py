"""Autograd of ringsplash's PyTorch forward op (``register_autograd``).

The backward is the op ``ringsplash::attention_bwd``: dq, dk, dv in the
inputs' dtype and dsinks (when sinks were given). A gradient of lse (when the
caller uses it) enters as ``D_i - dlse_i`` (``_ops.backward_step``). Gradients
of outputs nobody used arrive as None (``set_materialize_grads(False)``), so an
unused lse costs nothing.
"""

from __future__ import annotations

import torch

from . import _ops


def _setup_context(ctx, inputs, output):
    (q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, dense_mask,
     mask_id, scale, softcap, block_q, block_kv, num_threads, out_f32) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions,
                          kv_positions, dense_mask, out, lse)
    ctx.params = dict(mask_id=mask_id, scale=scale, softcap=softcap, block_q=block_q,
                      block_kv=block_kv, num_threads=num_threads)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    (q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, dense_mask, out,
     lse) = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = _ops.backward_step(
        q, k, v, out, lse, dout.to(out.dtype), sinks=sinks, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_positions=kv_positions,
        dense_mask=dense_mask, grads_f32=False, dlse=dlse, **ctx.params)
    if dsinks is not None:
        dsinks = dsinks.to(sinks.dtype)
    return (dq, dk, dv, dsinks) + (None,) * 12


torch.library.register_autograd("ringsplash::attention_fwd", _backward,
                                setup_context=_setup_context)

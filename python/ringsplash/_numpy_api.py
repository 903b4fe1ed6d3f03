"""The NumPy front-end: single-device attention on ``[B, S, H, D]`` arrays.

Arrays are float32, float16 or ``ml_dtypes.bfloat16`` and are passed to the C++
kernels without copies, whatever their strides (a ``[B, H, S, D]`` array
transposed to ``[B, S, H, D]`` costs nothing). The GIL is released while the
kernels run, so several Python threads may attend at once.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _core
from ._errors import DTypeError, InvalidArgumentError
from ._types import as_block_sizes, as_num_threads
from .masks import as_mask

_FLOAT_DTYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
}


def _float_array(x, name: str) -> np.ndarray:
    """x as an array the kernels take (bf16 as its uint16 view: python/src/views.h).

    Views with negative strides (``x[:, ::-1]``) are copied: the kernels walk
    memory forwards. Every other layout is passed as it is.
    """
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype not in _FLOAT_DTYPES:
        raise DTypeError(
            f"{name}: expected float32, bfloat16 (ml_dtypes) or float16, got {x.dtype}"
        )
    if any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return x.view(np.uint16)
    return x


def _rank(x: np.ndarray, name: str, ndim: int, dims: str) -> None:
    if x.ndim != ndim:
        raise InvalidArgumentError(f"{name}: expected {dims} ({ndim} dims), got shape {x.shape}")


def _segments(ids, name: str):
    if ids is None:
        return None
    arr = np.asarray(ids)
    if not np.issubdtype(arr.dtype, np.integer):
        raise DTypeError(f"{name}: expected integer segment ids, got {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise InvalidArgumentError(f"{name}: segment ids must fit in int32")
        arr = arr.astype(np.int32)
    return arr


def _sinks(sinks):
    if sinks is None:
        return None
    arr = np.asarray(sinks)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
        raise DTypeError(f"sinks: expected a float array [H], got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def _common(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids, kv_segment_ids,
            block_sizes, num_threads):
    qa, ka, va = _float_array(q, "q"), _float_array(k, "k"), _float_array(v, "v")
    dtypes = [np.asarray(x).dtype for x in (q, k, v)]
    if len(set(dtypes)) != 1:
        raise DTypeError(f"q, k, v: expected one dtype, got {', '.join(map(str, dtypes))}")
    _rank(qa, "q", 4, "[B, q_seq_len, H, D]")
    _rank(ka, "k", 4, "[B, kv_seq_len, H_kv, D]")
    _rank(va, "v", 4, "[B, kv_seq_len, H_kv, Dv]")
    m = as_mask(mask)
    m.check(qa.shape[2], qa.shape[1], ka.shape[1])
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise InvalidArgumentError(
            "q_segment_ids and kv_segment_ids: give both or neither, got "
            f"q_segment_ids={'None' if q_segment_ids is None else 'an array'}, "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'an array'}"
        )
    bs = as_block_sizes(block_sizes)
    return dict(
        q=qa, k=ka, v=va, mask=m.core,
        scale=None if scale is None else float(scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        sinks=_sinks(sinks),
        q_segments=_segments(q_segment_ids, "q_segment_ids"),
        kv_segments=_segments(kv_segment_ids, "kv_segment_ids"),
        q_positions=None, kv_positions=None,
        block_q=bs.q, block_kv=bs.kv, num_threads=as_num_threads(num_threads),
    )



def attention(q, k, v, *, mask=None, scale=None, logits_soft_cap=None, sinks=None,
              q_segment_ids=None, kv_segment_ids=None, return_lse=False, block_sizes=None,
              num_threads=None):
    """Block-sparse flash attention (SPEC §2) on one device.

    Args:
      q: ``[B, Sq, H, D]``; k: ``[B, Skv, Hkv, D]``; v: ``[B, Skv, Hkv, Dv]``; one dtype
        (float32, bfloat16 or float16), any strides; ``H % Hkv == 0`` (GQA/MQA).
      mask: a ``ringsplash.masks`` mask, mask text, a boolean array, or None (full).
      scale: logit scale, default ``1/sqrt(D)``.
      logits_soft_cap: ``s -> cap * tanh(s / cap)`` before masking.
      sinks: float ``[H]``: one extra logit per head in every row's softmax
        denominator that contributes no value (-inf: no sink for that head).
      q_segment_ids, kv_segment_ids: int ``[B, Sq]`` / ``[B, Skv]``, both or neither.
      return_lse: also return the log-sum-exp ``[B, H, Sq]`` float32 (natural log,
        sinks included; ``-inf`` for a row with no allowed key, whose out is 0).
      block_sizes: ``BlockSizes(q, kv)`` or a pair, multiples of 16.
      num_threads: kernel threads; None or 0: every core.

    Returns:
      out ``[B, Sq, H, Dv]`` in q's dtype, or ``(out, lse)``.
    """
    args = _common(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids,
                   kv_segment_ids, block_sizes, num_threads)
    qa = np.asarray(q)
    b, sq, h, _ = qa.shape
    dv = args["v"].shape[3]
    out = np.empty((b, sq, h, dv), dtype=qa.dtype)
    lse = np.empty((b, h, sq), dtype=np.float32)
    _core.forward(out=_float_array(out, "out"), lse=lse, **args)
    return (out, lse) if return_lse else out


def attention_backward(q, k, v, out, lse, dout, *, mask=None, scale=None, logits_soft_cap=None,
                       sinks=None, q_segment_ids=None, kv_segment_ids=None, block_sizes=None,
                       num_threads=None):
    """Gradients of :func:`attention`, given its ``out`` and ``lse`` and the upstream ``dout``.

    Takes the same keyword arguments as the forward (they must be the same).
    Returns ``(dq, dk, dv, dsinks)``: dq/dk/dv in q's dtype and shapes, dsinks
    float32 ``[H]`` (None without sinks).
    """
    args = _common(q, k, v, mask, scale, logits_soft_cap, sinks, q_segment_ids,
                   kv_segment_ids, block_sizes, num_threads)
    out_a = _float_array(out, "out")
    dout_a = _float_array(dout, "dout")
    lse_a = np.asarray(lse)
    if lse_a.dtype != np.float32:
        raise DTypeError(f"lse: expected float32 (as attention returns it), got {lse_a.dtype}")
    dtype = np.asarray(q).dtype
    dq = np.empty(np.shape(q), dtype=dtype)
    dk = np.empty(np.shape(k), dtype=dtype)
    dv = np.empty(np.shape(v), dtype=dtype)
    dsinks = None if args["sinks"] is None else np.empty(args["sinks"].shape, np.float32)
    _core.backward(out=out_a, lse=lse_a, dout=dout_a, dq=_float_array(dq, "dq"),
                   dk=_float_array(dk, "dk"), dv=_float_array(dv, "dv"), dsinks=dsinks, **args)
    return dq, dk, dv, dsinks

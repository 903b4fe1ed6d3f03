"""ringsplash.torch's public functions: ``attention`` and ``scaled_dot_product_attention``."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np
import torch

from .._errors import DTypeError, InvalidArgumentError
from .._types import as_block_sizes, as_num_threads
from ..masks import Mask, TextMask
from . import _autograd  # noqa: F401  (registers the ops' autograd)
from . import _ops

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_TEXT_MASKS = {}  # mask text (None: "full") -> TextMask, built and registered once


def _structured_mask(mask) -> Mask:
    """A mask object or mask text (None: full) as a registered Mask, text masks cached."""
    if isinstance(mask, Mask):
        return mask
    text = "full" if mask is None else mask
    if text not in _TEXT_MASKS:
        _TEXT_MASKS[text] = TextMask(text)
    return _TEXT_MASKS[text]


@torch.compiler.assume_constant_result
def _checked_mask_id(mask, num_heads: int, q_len: int, kv_len: int) -> int:
    # Mask objects and text are resolved, checked against the lengths and
    # registered in eager Python: torch.compile takes the id as a constant
    # instead of tracing into the (C++) mask machinery.
    m = _structured_mask(mask)
    m.check(num_heads, q_len, kv_len)
    return m.registry_id


_SDPA_MASKS = {}


@torch.compiler.assume_constant_result
def _sdpa_mask_id(is_causal: bool, left: int, right: int) -> int:
    """The id of causal and/or window masks (-1: no bound), built once per combination."""
    key = (is_causal, left, right)
    if key not in _SDPA_MASKS:
        terms = ["causal"] if is_causal else []
        if left >= 0 or right >= 0:
            terms.append(f"local:{left if left >= 0 else ''},{right if right >= 0 else ''}")
        _SDPA_MASKS[key] = TextMask(" & ".join(terms) or "full")
    return _SDPA_MASKS[key].registry_id


def check_tensor(x, name: str, dims: str = "4 dims"):
    """A CPU tensor of a float dtype the kernels take, of rank 4 (``dims`` says which)."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise InvalidArgumentError(
            f"{name}: expected a CPU tensor, got one on {x.device} (ringsplash runs on CPUs)")
    if x.dtype not in _DTYPES:
        raise DTypeError(f"{name}: expected float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 4:
        raise InvalidArgumentError(f"{name}: expected {dims}, got shape {tuple(x.shape)}")


def _to_bshd(x, layout: str):
    return x if layout == "bshd" else x.transpose(1, 2)


def _segments(ids, name: str, batch: int, length: int):
    if ids is None:
        return None
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise DTypeError(f"{name}: expected integer segment ids, got {ids.dtype}")
    if tuple(ids.shape) != (batch, length):
        raise InvalidArgumentError(
            f"{name}: expected shape [B={batch}, {length}], got {tuple(ids.shape)}")
    return ids.to(torch.int32)


def attention(q, k, v, *, mask=None, scale: Optional[float] = None,
              logits_soft_cap: Optional[float] = None, sinks=None, q_segment_ids=None,
              kv_segment_ids=None, layout: str = "bshd", return_lse: bool = False,
              block_sizes=None, num_threads: Optional[int] = None):
    """Block-sparse flash attention as a PyTorch op (autograd, ``torch.compile``).

    Args:
      q, k, v: ``[B, S, H, D]`` (layout "bshd") or ``[B, H, S, D]`` ("bhsd") CPU
        tensors of one dtype (float32, bfloat16, float16), any strides; no copies.
        ``k``/``v`` may have fewer heads (GQA/MQA, ``H % Hkv == 0``).
      mask: a ``ringsplash.masks`` mask (build it outside compiled code: once, reused),
        mask text, a boolean ``[Sq, Skv]`` / ``[H, Sq, Skv]`` array or tensor, or None.
      scale: default ``1/sqrt(D)``. logits_soft_cap: ``s -> cap * tanh(s / cap)``.
      sinks: float ``[H]`` (may require grad). q_segment_ids / kv_segment_ids:
        int ``[B, Sq]`` / ``[B, Skv]``, both or neither.
      return_lse: also return lse ``[B, H, Sq]`` float32 (sinks included, -inf for
        a row with no key).
    Returns:
      out in q's layout and dtype (``[B, Sq, H, Dv]`` or ``[B, H, Sq, Dv]``), or ``(out, lse)``.
    """
    if layout not in ("bshd", "bhsd"):
        raise InvalidArgumentError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    qb, kb, vb = (_to_bshd(x, layout) for x in (q, k, v))
    b, sq, h, d = qb.shape
    skv = kb.shape[1]
    # A boolean array or tensor goes to the op as a dense mask of this call
    # (nothing registered per call); mask objects and text by their id.
    dense = None
    if isinstance(mask, (torch.Tensor, np.ndarray)):
        dense = torch.as_tensor(mask)
        if dense.dtype != torch.bool or tuple(dense.shape) not in ((sq, skv), (h, sq, skv)):
            raise InvalidArgumentError(
                f"mask: expected a boolean [Sq={sq}, Skv={skv}] or [H={h}, Sq, Skv] array, got "
                f"{dense.dtype} {tuple(dense.shape)}")
        mask = None
    elif mask is not None and not isinstance(mask, (Mask, str)):
        raise InvalidArgumentError(
            "mask: expected a ringsplash.masks mask, mask text, a boolean array or tensor, or "
            f"None, got {type(mask).__name__}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise InvalidArgumentError("q_segment_ids and kv_segment_ids: give both or neither")
    qs = _segments(q_segment_ids, "q_segment_ids", b, sq)
    kvs = _segments(kv_segment_ids, "kv_segment_ids", b, skv)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise DTypeError("sinks: expected a float tensor [H]")
        if tuple(sinks.shape) != (h,):
            raise InvalidArgumentError(f"sinks: expected shape [H={h}], got {tuple(sinks.shape)}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise InvalidArgumentError(f"logits_soft_cap: expected a value > 0, got {logits_soft_cap}")
    bs = as_block_sizes(block_sizes)
    out, lse = torch.ops.ringsplash.attention_fwd(
        qb, kb, vb, sinks, qs, kvs, None, None, dense, _checked_mask_id(mask, h, sq, skv),
        float(scale) if scale is not None else 1.0 / math.sqrt(d),
        float(logits_soft_cap or 0.0), bs.q, bs.kv, as_num_threads(num_threads), False)
    out = _to_bshd(out, layout)
    return (out, lse) if return_lse else out


def _window(window) -> Tuple[int, int]:
    if window is None:
        return -1, -1
    if isinstance(window, int):
        left, right = window, 0
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"window: expected an int or a (left, right) pair, got {window!r}") from None
    if (left is not None and int(left) < 0) or (right is not None and int(right) < 0):
        raise InvalidArgumentError(f"window: sides must be >= 0 or None, got {window!r}")
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *,
                                 window: Union[int, Tuple[Optional[int], Optional[int]], None] = None,
                                 logits_soft_cap: Optional[float] = None, sinks=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on ringsplash's kernels.

    Same arguments and ``[B, H, S, D]`` layout, so a model swaps one call, plus what
    that function lacks: ``window`` (``w``: each query sees itself and the ``w``
    keys before it; ``(left, right)``: ``q - left <= kv <= q + right``, None for an
    unbounded side), ``logits_soft_cap`` and ``sinks`` (float ``[H]``). Blocks the
    masks rule out are skipped. A boolean ``attn_mask`` (True: attend) broadcastable
    to ``[B, H, Sq, Skv]`` is applied as a dense mask; a float (additive) mask is
    refused. ``dropout_p`` must be 0.
    """
    if all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (query, key, value)):
        # [H, S, D] without a batch, as F.scaled_dot_product_attention takes too.
        out = scaled_dot_product_attention(
            query[None], key[None], value[None],
            attn_mask if attn_mask is None or attn_mask.dim() < 3 else attn_mask[None],
            dropout_p, is_causal, scale, enable_gqa, window=window,
            logits_soft_cap=logits_soft_cap, sinks=sinks)
        return out[0]
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_tensor(x, name)
    if dropout_p != 0.0:
        raise InvalidArgumentError(
            f"dropout_p: ringsplash has no attention dropout, got {dropout_p} (use 0.0)")
    b, h, sq, _ = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    if hkv != h and not enable_gqa:
        raise InvalidArgumentError(
            f"key: {hkv} heads against {h} query heads; pass enable_gqa=True for GQA/MQA")
    if is_causal and attn_mask is not None:
        raise InvalidArgumentError("attn_mask and is_causal: give one, not both (as PyTorch)")
    left, right = _window(window)
    mask_id = _sdpa_mask_id(bool(is_causal), left, right)
    if attn_mask is None:
        return attention(query, key, value, mask=_SDPA_MASKS[(bool(is_causal), left, right)],
                         scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                         layout="bhsd")
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise InvalidArgumentError(
            "attn_mask: only boolean masks (True = attend) are supported, got "
            f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}; an additive float mask "
            "has no block structure to skip: express it as a boolean mask, or use window=, "
            "logits_soft_cap=, sinks= or ringsplash.torch.attention(mask=...)")
    if attn_mask.dim() > 4 or tuple(attn_mask.shape[-2:]) not in ((sq, skv), (1, skv), (sq, 1),
                                                                   (1, 1)):
        raise InvalidArgumentError(
            f"attn_mask: expected a shape broadcastable to [B={b}, H={h}, Sq={sq}, Skv={skv}], "
            f"got {tuple(attn_mask.shape)}")
    full = attn_mask.expand(*((1,) * (4 - attn_mask.dim())), *attn_mask.shape)
    try:
        full = full.expand(full.shape[0], full.shape[1], sq, skv)
    except RuntimeError:
        raise InvalidArgumentError(
            f"attn_mask: expected a shape broadcastable to [B={b}, H={h}, Sq={sq}, Skv={skv}], "
            f"got {tuple(attn_mask.shape)}") from None
    if full.shape[0] not in (1, b) or full.shape[1] not in (1, h):
        raise InvalidArgumentError(
            f"attn_mask: expected a shape broadcastable to [B={b}, H={h}, Sq={sq}, Skv={skv}], "
            f"got {tuple(attn_mask.shape)}")
    d = query.shape[-1]
    scale_value = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    outs = []
    # One call per batch element whose mask differs (the C++ masks are per head at most).
    batches = [(0, b)] if full.shape[0] == 1 else [(i, i + 1) for i in range(b)]
    for lo, hi in batches:
        dense = full[min(lo, full.shape[0] - 1)]                   # [1 or H, Sq, Skv]
        dense = dense[0] if dense.shape[0] == 1 else dense
        out, _ = torch.ops.ringsplash.attention_fwd(
            query[lo:hi].transpose(1, 2), key[lo:hi].transpose(1, 2),
            value[lo:hi].transpose(1, 2), sinks, None, None, None, None,
            dense.contiguous(), mask_id, scale_value, float(logits_soft_cap or 0.0), 128, 128, 0,
            False)
        outs.append(out.transpose(1, 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

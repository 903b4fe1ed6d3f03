"""ringsplash for PyTorch (CPU): a custom op with autograd and torch.compile support.

    attention(q, k, v, *, mask=..., layout="bshd"|"bhsd", ...)     every ringsplash mask
    scaled_dot_product_attention(query, key, value, ...)            F.sdpa's arguments, plus
                                                                    window, soft cap, sinks
    ring_attention(q, k, v, *, group=None, layout="zigzag", ...)    over torch.distributed
    shard_sequence / gather_sequence                                a layout's rows and back

Built on the ops ``torch.ops.ringsplash.attention_fwd`` / ``attention_bwd``
(``_ops.py``), which call the C++ kernels on the tensors' memory.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ringsplash.torch needs PyTorch: pip install 'ringsplash[torch]'") from e

from ._api import attention, scaled_dot_product_attention
from .ring import gather_sequence, ring_attention, shard_sequence

__all__ = [
    "attention",
    "scaled_dot_product_attention",
    "ring_attention",
    "shard_sequence",
    "gather_sequence",
]

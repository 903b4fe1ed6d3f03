"""ringsplash for JAX (CPU): single-device splash attention and ring attention in shard_map.

    make_splash_attention(mask, ...)            one device, under jit / grad / vmap
    make_ring_attention(mask, ring_axis=...)    inside shard_map, the sequence over ring_axis
    shard_sequence / unshard_sequence           a global array in a layout's order and back

Both kernels run ringsplash's C++ kernels through XLA FFI custom calls
(python/src/ffi_handlers.cc) with gradients from ``jax.custom_vjp``.
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ringsplash.jax needs JAX: pip install 'ringsplash[jax]' (or jax and jaxlib)"
    ) from e

from .._types import BlockSizes, SegmentIds
from ._ffi import default_num_threads
from .ring import RingAttentionKernel, make_ring_attention, shard_sequence, unshard_sequence
from .splash import SplashAttentionKernel, make_splash_attention

__all__ = [
    "BlockSizes",
    "SegmentIds",
    "SplashAttentionKernel",
    "RingAttentionKernel",
    "default_num_threads",
    "make_splash_attention",
    "make_ring_attention",
    "shard_sequence",
    "unshard_sequence",
]

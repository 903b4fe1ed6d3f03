"""ringsplash: exact ring attention over block-sparse flash kernels, for CPUs.

NumPy front-end here (``attention``, ``attention_backward``), masks in
``ringsplash.masks`` (also importable from here), JAX in ``ringsplash.jax``
(``pip install ringsplash[jax]``). The contract is SPEC.md; the C++ library's
README describes the kernels.
"""

from . import _core
from ._errors import DTypeError, Error, InvalidArgumentError
from ._numpy_api import attention, attention_backward
from ._types import BlockSizes, SegmentIds
from .masks import (
    ChunkedCausalMask,
    CausalMask,
    FullMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    NumpyMask,
    TextMask,
)

_core.set_error_type(InvalidArgumentError)

__version__ = "0.1.0"


def kernel_path(requested: str = "auto") -> str:
    """The micro-kernel path calls run on this CPU (RINGSPLASH_KERNEL overrides 'auto')."""
    return _core.kernel_path(requested)


def release_cached_threads() -> None:
    """Ends the worker threads (and their scratch) single-device calls keep between calls,
    and frees the large buffers calls keep for the next call of the same shapes."""
    _core.release_cached_threads()


__all__ = [
    "attention",
    "attention_backward",
    "BlockSizes",
    "SegmentIds",
    "Error",
    "InvalidArgumentError",
    "DTypeError",
    "Mask",
    "FullMask",
    "CausalMask",
    "LocalMask",
    "ChunkedCausalMask",
    "NumpyMask",
    "MultiHeadMask",
    "LogicalAnd",
    "LogicalOr",
    "TextMask",
    "kernel_path",
    "release_cached_threads",
]

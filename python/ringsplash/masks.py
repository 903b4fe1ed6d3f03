"""Attention masks as objects, with the names of JAX's splash-attention mask library.

A mask is a predicate on GLOBAL token positions ``allowed(head, q_pos, kv_pos)``
(SPEC §3). Its ``shape`` is the global ``(q_len, kv_len)`` extent it was built for
(``(heads, q_len, kv_len)`` for a ``MultiHeadMask``); calls check it against their
arrays. Structured masks (everything but ``NumpyMask``) are classified block by
block analytically: no ``q_len x kv_len`` array is ever made for them.

    CausalMask(shape, offset=0)                    q + offset >= kv
    LocalMask(shape, window_size=(l, r), offset=0) q + offset - l <= kv <= q + offset + r
                                                   (None: that side unbounded)
    ChunkedCausalMask(shape, chunk_size)           q // c == kv // c and q >= kv
    FullMask(shape)                                always
    NumpyMask(array)                               a boolean [q_len, kv_len] array
    MultiHeadMask(masks)                           query head h uses masks[h]
    a & b, a | b                                   LogicalAnd, LogicalOr

Every mask is converted to its C++ counterpart once, when built; a
``NumpyMask`` copies its array then (later changes to the array are not seen).
Mask arguments of the package also take ``None`` (full attention) and the
command line's mask text (``"causal & local:512,0"``, docs/CLI.md).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._errors import InvalidArgumentError

__all__ = [
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
    "as_mask",
]


_BY_ID = {}  # registry id -> the C++ mask (python/src/mask_registry.h keeps its own)


def by_id(mask_id: int):
    """The C++ mask registered as ``mask_id`` (see ``Mask.registry_id``)."""
    try:
        return _BY_ID[mask_id]
    except KeyError:
        raise InvalidArgumentError(f"mask_id: no mask is registered as {mask_id}") from None


def _shape2(shape, what: str) -> Tuple[int, int]:
    try:
        q_len, kv_len = (int(n) for n in shape)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"{what}: expected shape (q_seq_len, kv_seq_len), got {shape!r}"
        ) from None
    if q_len <= 0 or kv_len <= 0:
        raise InvalidArgumentError(f"{what}: expected positive lengths, got shape {shape!r}")
    return q_len, kv_len


class Mask:
    """Base class: a shape and the C++ mask behind it (``core``)."""

    shape: Optional[Tuple[int, ...]]

    def __init__(self, shape, core):
        self.shape = shape
        self.core = core
        self._registry_id = None

    def __and__(self, other: "Mask") -> "Mask":
        return LogicalAnd(self, as_mask(other))

    def __or__(self, other: "Mask") -> "Mask":
        return LogicalOr(self, as_mask(other))

    @property
    def registry_id(self) -> int:
        """The id compiled calls (XLA FFI, PyTorch ops) name this mask by.

        Registered once, on first use, and kept for the life of the process:
        a compiled function may run after this object is gone.
        """
        if self._registry_id is None:
            self._registry_id = self.core.registry_id()
            _BY_ID[self._registry_id] = self.core
        return self._registry_id

    @property
    def num_heads(self) -> int:
        """0 if the mask is the same for every head, else the query heads it covers."""
        return self.core.num_heads

    def allowed(self, q_pos: int, kv_pos: int, head: int = 0) -> bool:
        """The mask's value at one pair of global positions (for inspection)."""
        return self.core.allowed(head, q_pos, kv_pos)

    def check(self, num_heads: int, q_len: int, kv_len: int, what: str = "mask") -> None:
        """Raises InvalidArgumentError unless the mask fits these (global) lengths."""
        if self.shape is None:
            return
        expected = (q_len, kv_len) if len(self.shape) == 2 else (num_heads, q_len, kv_len)
        if tuple(self.shape) != expected:
            dims = "(q_seq_len, kv_seq_len)" if len(self.shape) == 2 else "(heads, q_seq_len, kv_seq_len)"
            raise InvalidArgumentError(
                f"{what}: shape {tuple(self.shape)} does not match the attention's "
                f"{dims} = {expected}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, '{self.core}')"


class FullMask(Mask):
    """Every query attends to every key."""

    def __init__(self, shape):
        super().__init__(_shape2(shape, "FullMask"), _core.Mask.full())


class CausalMask(Mask):
    """Allowed iff ``q_pos + offset >= kv_pos``."""

    def __init__(self, shape, offset: int = 0):
        self.offset = int(offset)
        super().__init__(_shape2(shape, "CausalMask"), _core.Mask.causal(self.offset))


class LocalMask(Mask):
    """Allowed iff ``q + offset - left <= kv <= q + offset + right`` (None: unbounded side)."""

    def __init__(self, shape, window_size: Tuple[Optional[int], Optional[int]], offset: int = 0):
        try:
            left, right = window_size
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"LocalMask: window_size: expected (left, right), got {window_size!r}"
            ) from None
        for name, side in (("left", left), ("right", right)):
            if side is not None and int(side) < 0:
                raise InvalidArgumentError(
                    f"LocalMask: window_size {name} side must be >= 0 or None, got {side}"
                )
        self.window_size = (
            None if left is None else int(left),
            None if right is None else int(right),
        )
        self.offset = int(offset)
        super().__init__(
            _shape2(shape, "LocalMask"),
            _core.Mask.local(self.window_size[0], self.window_size[1], self.offset),
        )


class ChunkedCausalMask(Mask):
    """Allowed iff ``q // chunk_size == kv // chunk_size`` and ``q >= kv``."""

    def __init__(self, shape, chunk_size: int):
        if int(chunk_size) <= 0:
            raise InvalidArgumentError(f"ChunkedCausalMask: chunk_size must be > 0, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        super().__init__(
            _shape2(shape, "ChunkedCausalMask"), _core.Mask.chunked_causal(self.chunk_size)
        )


class NumpyMask(Mask):
    """A boolean ``[q_len, kv_len]`` array indexed by global positions."""

    def __init__(self, array):
        arr = np.asarray(array)
        if arr.ndim != 2:
            raise InvalidArgumentError(
                f"NumpyMask: expected a 2-D [q_seq_len, kv_seq_len] array, got shape {arr.shape}"
            )
        if arr.dtype != np.bool_ and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(
                f"NumpyMask: expected a boolean array, got dtype {arr.dtype}"
            )
        self.array = arr.astype(np.bool_)
        self.array.setflags(write=False)
        values = np.ascontiguousarray(self.array, dtype=np.uint8)
        super().__init__(_shape2(arr.shape, "NumpyMask"), _core.Mask.dense(values))


class MultiHeadMask(Mask):
    """One 2-D mask per query head: head h uses ``masks[h]``."""

    def __init__(self, masks: Sequence[Mask]):
        self.masks = tuple(as_mask(m) for m in masks)
        if not self.masks:
            raise InvalidArgumentError("MultiHeadMask: expected at least one mask")
        shapes = {m.shape for m in self.masks}
        if len(shapes) != 1 or any(s is not None and len(s) != 2 for s in shapes):
            raise InvalidArgumentError(
                f"MultiHeadMask: expected 2-D masks of one shape, got shapes {sorted(map(str, shapes))}"
            )
        (shape,) = shapes
        if shape is None:
            raise InvalidArgumentError("MultiHeadMask: masks need a shape (text masks have none)")
        super().__init__(
            (len(self.masks),) + tuple(shape), _core.Mask.per_head([m.core for m in self.masks])
        )


def _combined_shape(left: Mask, right: Mask, op: str):
    if left.shape is None:
        return right.shape
    if right.shape is None or tuple(left.shape) == tuple(right.shape):
        return left.shape
    if tuple(left.shape[-2:]) == tuple(right.shape[-2:]):
        return left.shape if len(left.shape) == 3 else right.shape
    raise InvalidArgumentError(
        f"mask {op}: shapes {tuple(left.shape)} and {tuple(right.shape)} do not match"
    )


class LogicalAnd(Mask):
    """Allowed where both masks allow."""

    def __init__(self, left: Mask, right: Mask):
        self.left, self.right = as_mask(left), as_mask(right)
        super().__init__(_combined_shape(self.left, self.right, "&"), self.left.core & self.right.core)


class LogicalOr(Mask):
    """Allowed where either mask allows."""

    def __init__(self, left: Mask, right: Mask):
        self.left, self.right = as_mask(left), as_mask(right)
        super().__init__(_combined_shape(self.left, self.right, "|"), self.left.core | self.right.core)


class TextMask(Mask):
    """A mask in the command line's text form; it has no shape (fits any lengths)."""

    def __init__(self, text: str):
        self.text = text
        super().__init__(None, _core.Mask.parse(text))


def as_mask(mask) -> Mask:
    """A Mask from a mask object, None (full attention), mask text or a boolean array."""
    if isinstance(mask, Mask):
        return mask
    if mask is None:
        return TextMask("full")
    if isinstance(mask, str):
        return TextMask(mask)
    if isinstance(mask, np.ndarray):
        return NumpyMask(mask)
    raise InvalidArgumentError(
        f"mask: expected a ringsplash.masks mask, None, mask text or a boolean NumPy array, "
        f"got {type(mask).__name__}"
    )

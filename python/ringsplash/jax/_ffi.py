"""The two XLA FFI calls under ringsplash.jax: one block-sparse kernel call each.

``forward_call`` / ``backward_call`` are plain ``jax.ffi.ffi_call``s of the
handlers in python/src/ffi_handlers.cc (not differentiable by themselves: the
kernels of splash.py and ring.py wrap them in ``jax.custom_vjp``). Positions
are operands, so a ring step's global positions are dynamic values. Under
``vmap`` the calls run once per mapped element (``vmap_method="sequential"``):
each call is already a whole multi-threaded kernel.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from .. import _core
from .._errors import Error, InvalidArgumentError
from .._types import usable_cores

_register_lock = threading.Lock()
_registered = False


def _register() -> None:
    global _registered
    with _register_lock:
        if _registered:
            return
        targets = _core.ffi_targets()
        if not targets:
            raise Error(
                "ringsplash was built without JAX's FFI headers (JAX was not importable when "
                "the extension was compiled); reinstall with `pip install ringsplash[jax]` "
                "in an environment that has jax"
            )
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _registered = True


def default_num_threads() -> int:
    """Kernel threads per FFI call: this process's cores shared among its CPU devices.

    XLA runs the devices of one process (``--xla_force_host_platform_device_count``)
    side by side, so one call per device each on every core would oversubscribe
    them. ``RINGSPLASH_NUM_THREADS`` overrides; a kernel's ``num_threads`` argument
    overrides both.
    """
    env = os.environ.get("RINGSPLASH_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise InvalidArgumentError(
                f"RINGSPLASH_NUM_THREADS: expected a number of threads, got {env!r}"
            ) from None
        if n < 1:
            raise InvalidArgumentError(f"RINGSPLASH_NUM_THREADS: expected >= 1, got {n}")
        return n
    return max(1, usable_cores() // max(1, jax.local_device_count(backend="cpu")))


# Varying manual axes (shard_map's check_vma). Inside shard_map every value is
# typed with the mesh axes it varies over; all operands of one FFI call must
# vary over the same axes, XLA's results carry none (so they get the operands'
# union), and a cotangent must match its primal's axes.


def varying(x) -> frozenset:
    if x is None:
        return frozenset()
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "mat", None)
        vma = getattr(mat, "varying", None) if mat is not None else None
    return frozenset(vma or ())


def to_varying(x, axes):
    if x is None:
        return None
    missing = tuple(sorted(frozenset(axes) - varying(x), key=str))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # older JAX


def cotangent_like(ct, primal):
    """Transpose JAX's implicit broadcast to varying: sum ``ct`` over the axes
    it varies over but ``primal`` does not, then match ``primal``'s axes."""
    extra = tuple(sorted(varying(ct) - varying(primal), key=str))
    if extra:
        ct = lax.psum(ct, extra)
    return to_varying(ct, varying(primal))


def _uniform(operands):
    """The operands cast to the union of their varying axes, and that union."""
    axes = frozenset().union(*(varying(x) for x in operands))
    return tuple(to_varying(x, axes) for x in operands), axes


_EMPTY_F32 = np.zeros((0,), np.float32)
_EMPTY_I32 = np.zeros((0,), np.int32)


def _operands(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    return (
        q,
        k,
        v,
        _EMPTY_F32 if sinks is None else jnp.asarray(sinks, jnp.float32),
        _EMPTY_I32 if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32),
        _EMPTY_I32 if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32),
        _EMPTY_I32 if q_positions is None else jnp.asarray(q_positions, jnp.int32),
        _EMPTY_I32 if kv_positions is None else jnp.asarray(kv_positions, jnp.int32),
    )


def _attributes(mask, scale, logits_soft_cap, block_sizes, num_threads):
    return dict(
        mask_id=np.int64(mask.registry_id),
        scale=np.float32(scale),
        softcap=np.float32(0.0 if logits_soft_cap is None else logits_soft_cap),
        block_q=np.int64(block_sizes.q),
        block_kv=np.int64(block_sizes.kv),
        num_threads=np.int64(num_threads),
    )


def forward_call(q, k, v, *, mask, scale, logits_soft_cap, sinks, q_segment_ids, kv_segment_ids,
                 q_positions, kv_positions, block_sizes, num_threads, out_dtype):
    """One forward kernel call.

    q ``[B,Sq,H,D]``, k ``[B,Skv,Hkv,D]``, v ``[B,Skv,Hkv,Dv]``; positions int32
    ``[Sq]`` / ``[Skv]`` (global), or None for ``0 .. S-1`` (the kernels' own
    iota: cheaper than the same positions spelled out). Returns out ``[B,Sq,H,Dv]`` (``out_dtype``) and
    lse ``[B,H,Sq]`` f32; with sinks both include them. A row with no allowed
    key: out 0, lse -inf (the sink, with one).
    """
    _register()
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    call = jax.ffi.ffi_call(
        "ringsplash_forward",
        (
            jax.ShapeDtypeStruct((b, sq, h, dv), out_dtype),
            jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
        ),
        vmap_method="sequential",
    )
    operands, axes = _uniform(
        _operands(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions))
    out, lse = call(*operands, **_attributes(mask, scale, logits_soft_cap, block_sizes, num_threads))
    return to_varying(out, axes), to_varying(lse, axes)


def backward_call(q, k, v, out, lse, dout, *, mask, scale, logits_soft_cap, sinks, q_segment_ids,
                  kv_segment_ids, q_positions, kv_positions, block_sizes, num_threads, grad_dtype,
                  dlse=None):
    """One backward kernel call; returns ``(dq, dk, dv, dsinks)`` (dsinks None without sinks).

    ``out`` and ``lse`` are the row's final ones (lse with the sink); for one
    key/value slice of a ring pass ``sinks=None``: ``p = exp(s - lse)`` is then
    exactly that slice's share. ``dlse`` (``[B,H,Sq]``, optional) is an upstream
    gradient of lse: since ``d lse_i / d s_ij = p_ij``, it enters every ``ds``
    as ``p_ij * dlse_i``, i.e. as ``D_i = dout_i . out_i`` lowered by ``dlse_i``;
    the kernel forms ``D_i`` from out and dout, so out and dout gain one column
    (``-dlse_i`` and 1) against a zero column of v.
    """
    _register()
    dv_dim = v.shape[-1]
    if dlse is not None:
        column = jnp.swapaxes(dlse, 1, 2)[..., None].astype(jnp.float32)  # [B,Sq,H,1]
        out = jnp.concatenate([out.astype(jnp.float32), -column], axis=-1)
        dout = jnp.concatenate([dout.astype(jnp.float32), jnp.ones_like(column)], axis=-1)
        v = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    h = q.shape[2]
    results = (
        jax.ShapeDtypeStruct(q.shape, grad_dtype),
        jax.ShapeDtypeStruct(k.shape, grad_dtype),
        jax.ShapeDtypeStruct(v.shape, grad_dtype),
        jax.ShapeDtypeStruct((h,) if sinks is not None else (0,), jnp.float32),
    )
    call = jax.ffi.ffi_call("ringsplash_backward", results, vmap_method="sequential")
    operands, axes = _uniform(
        _operands(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
        + (out, jnp.asarray(lse, jnp.float32), dout))
    dq, dk, dv, dsinks = (to_varying(x, axes) for x in call(
        *operands, **_attributes(mask, scale, logits_soft_cap, block_sizes, num_threads)))
    if dlse is not None:
        dv = dv[..., :dv_dim]
    return dq, dk, dv, (dsinks if sinks is not None else None)

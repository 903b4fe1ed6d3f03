// XLA FFI handlers of the single-device kernels, for ringsplash.jax.
//
// Targets (registered for the CPU platform by ringsplash/jax/_ffi.py):
//   ringsplash_forward   q, k, v, sinks, q_segments, kv_segments, q_positions,
//                        kv_positions -> out, lse
//   ringsplash_backward  the same inputs, then out, lse, dout -> dq, dk, dv, dsinks
// Shapes as in ringsplash/attention.h, row-major (XLA's default layout):
//   q [B,Sq,H,D], k [B,Skv,Hkv,D], v [B,Skv,Hkv,Dv]  f32 | bf16 | f16
//   sinks [H] f32, segments [B,S] s32, positions [S] s32 (GLOBAL positions:
//   dynamic operands, so a ring step's positions never cause recompilation)
//   out [B,Sq,H,Dv] (q's dtype or f32), lse [B,H,Sq] f32
//   dq/dk/dv: shapes of q/k/v (f32 or q's dtype), dsinks [H] f32
// An absent optional operand is an array with no elements. Attributes:
// mask_id (python/src/mask_registry.h), scale, softcap (0: none), block_q,
// block_kv, num_threads (0: all cores). A ringsplash::Error becomes an
// INVALID_ARGUMENT error whose message is the library's.
#ifndef RINGSPLASH_PYTHON_SRC_FFI_HANDLERS_H_
#define RINGSPLASH_PYTHON_SRC_FFI_HANDLERS_H_

#include <nanobind/nanobind.h>

namespace ringsplash::python {

// {target name: PyCapsule of the handler}; empty without the FFI headers.
nanobind::dict FfiTargets();

}  // namespace ringsplash::python

#endif  // RINGSPLASH_PYTHON_SRC_FFI_HANDLERS_H_

// Argument checks of the single-device entry points (include/ringsplash/attention.h),
// split so the forward/backward drivers in attention.cc stay readable.
// Every check throws ringsplash::Error naming the argument, what was expected
// and what was given.
#ifndef RINGSPLASH_KERNELS_VALIDATE_H_
#define RINGSPLASH_KERNELS_VALIDATE_H_

#include <cstdint>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"

namespace ringsplash::kernels {

// Sizes of a validated call: q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv].
struct AttentionDims {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0, d = 0, dv = 0;
};

// Everything ValidateAttentionInputs checks; returns the sizes.
AttentionDims ValidateInputsAndOptions(const AttentionInputs& in, const AttentionOptions& opt);

// out [B, Sq, H, Dv] (dtype of q, or f32), lse [B, H, Sq] f32.
void ValidateForwardOutputs(const AttentionDims& dims, DType q_dtype, const TensorView& out,
                            const TensorView& lse);

// Backward extras: out and lse as in the forward; dout [B, Sq, H, Dv] (dtype
// of q, or f32); dq/dk/dv shapes of q/k/v (dtype of q, or f32); dsinks [H] f32
// iff sinks were given.
void ValidateBackwardArgs(const AttentionDims& dims, const AttentionInputs& in,
                          const TensorView& out, const TensorView& lse, const TensorView& dout,
                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const TensorView& dsinks);

// Whether no two elements of t can share memory because its dims nest: taken
// by increasing stride, each dim's stride is at least the extent of the ones
// before it (dense layouts in any dim order, and padded ones). The kernels
// write such outputs from several threads directly; validation refuses only
// the plainly overlapping views (a zero stride, two dims with one stride).
bool StridesNest(const TensorView& t);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_VALIDATE_H_

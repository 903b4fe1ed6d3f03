// Argument checks of the single-device entry points (include/ringsplash/attention.h),
// split so the forward/backward drivers in attention.cc stay readable.
// Every check throws ringsplash::Error naming the argument, what was expected
// and what was given.
#ifndef RINGSPLASH_KERNELS_VALIDATE_H_
#define RINGSPLASH_KERNELS_VALIDATE_H_

#include <cstdint>
#include <initializer_list>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"

namespace ringsplash::kernels {

// Sizes of a validated call: q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv].
struct AttentionDims {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0, d = 0, dv = 0;
};

// Everything ValidateAttentionInputs checks; returns the sizes. The ring
// passes dense_positions = false: its inputs are a rank's shards, whose
// global positions it checks against a dense mask itself.
AttentionDims ValidateInputsAndOptions(const AttentionInputs& in, const AttentionOptions& opt,
                                       bool dense_positions = true);

// out [B, Sq, H, Dv] (dtype of q, or f32), lse [B, H, Sq] f32, sharing no
// memory with each other or with an input of `in` (CheckNoAliasing).
void ValidateForwardOutputs(const AttentionDims& dims, const AttentionInputs& in,
                            const TensorView& out, const TensorView& lse);

// Backward extras: out and lse as in the forward (inputs here); dout
// [B, Sq, H, Dv] (dtype of q, or f32); dq/dk/dv shapes of q/k/v (dtype of q,
// or f32); dsinks [H] f32 iff sinks were given. dq, dk, dv and dsinks share
// no memory with each other or with an input (those of `in`, out, lse, dout).
void ValidateBackwardArgs(const AttentionDims& dims, const AttentionInputs& in,
                          const TensorView& out, const TensorView& lse, const TensorView& dout,
                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const TensorView& dsinks);

// Whether some byte of an element of `a` is also a byte of an element of `b`
// (any dtypes and strides; an undefined or empty view overlaps nothing).
// Exact: views that interleave in one buffer without sharing a byte (dq, dk
// and dv as slices of one packed [B, S, 3, H, D] buffer) do not overlap. A
// search bounded to 2^17 steps decides it (a few when the strides nest); a
// pair it cannot decide within them counts as overlapping.
bool ViewsOverlap(const TensorView& a, const TensorView& b);

// An argument of a call, by name.
struct NamedView {
  const char* name;
  const TensorView& view;
};

// The aliasing rule of the entry points: no output may share memory with an
// input or with another output (an output written while an input is still
// read, or two outputs written over each other, give silently wrong
// results). Throws Error for the first offending pair, naming both:
//   "dq: expected memory shared with no input or other output, got a view
//    overlapping q (dq [2, 8, 4, 16] f32 at 0x..., q [2, 8, 4, 16] f32 at 0x...)".
// Inputs may share memory with each other (they are only read).
void CheckNoAliasing(std::initializer_list<NamedView> outputs,
                     std::initializer_list<NamedView> inputs);

// Whether no two elements of t can share memory because its dims nest: taken
// by increasing stride, each dim's stride is at least the extent of the ones
// before it (dense layouts in any dim order, and padded ones). The kernels
// write such outputs from several threads directly; validation refuses only
// the plainly overlapping views (a zero stride, two dims with one stride).
bool StridesNest(const TensorView& t);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_VALIDATE_H_

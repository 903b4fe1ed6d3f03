// Row-wise f32 helpers shared by the single-device entry points and the ring:
// merging partial (out, lse) pairs, adding sinks once per row, and the
// backward's per-row delta and dsinks terms (SPEC §2).
#ifndef RINGSPLASH_KERNELS_COMBINE_H_
#define RINGSPLASH_KERNELS_COMBINE_H_

#include <cstdint>

#include "ringsplash/tensor.h"

namespace ringsplash::kernels {

// Shapes of the f32 contiguous buffers below: out [B, Sq, H, Dv], lse [B, H, Sq].
struct RowShape {
  int64_t b = 0, sq = 0, h = 0, dv = 0;
};

// (out_acc, lse_acc) <- merge with (out_part, lse_part):
//   lse = lse_a + softplus(lse_b - lse_a)
//   out = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a)
// Guarded: merging with an empty part (lse = -inf) on either side never
// produces NaN, and two empty parts stay empty (out 0, lse -inf).
void MergePartial(const RowShape& s, float* out_acc, float* lse_acc, const float* out_part,
                  const float* lse_part);

// Adds the sink logit sinks[h] to each row's denominator: lse' = logaddexp(lse,
// sinks[h]); out *= exp(lse - lse'). A row with no allowed key keeps out = 0
// and gets lse = sinks[h].
void ApplySinks(const RowShape& s, float* out, float* lse, const float* sinks);

// delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]  (f32 accumulate).
// dout and out are views [B, Sq, H, Dv] of any float dtype.
void ComputeDelta(const TensorView& dout, const TensorView& out, float* delta);

// dsinks[h] += -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * delta[b, h, i]
// over the rows given (a rank's rows; the ring all-reduces the sum).
void AccumulateDSinks(const RowShape& s, const float* sinks, const float* lse, const float* delta,
                      float* dsinks);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_COMBINE_H_

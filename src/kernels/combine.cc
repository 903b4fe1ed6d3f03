// Row-wise f32 merges, sinks, delta and dsinks (SPEC §2). See combine.h.
//
// Layouts (all f32, C order): out [B, Sq, H, Dv], lse [B, H, Sq].
// A row is empty when its lse is -inf (no allowed key); every function here
// treats that case explicitly so that -inf - -inf never reaches exp().
#include "src/kernels/combine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ringsplash::kernels {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Contiguous f32 view of one row of `t` (shape [B, Sq, H, Dv], any float
// dtype): returns a direct pointer when the row is unit-stride f32, otherwise
// converts into `scratch`.
const float* LoadRow(const TensorView& t, int64_t b, int64_t i, int64_t h,
                     std::vector<float>& scratch) {
  const int64_t dv = t.shape[3];
  const int64_t base = t.Offset(b, i, h);
  if (t.dtype == DType::kF32 && (t.stride[3] == 1 || dv == 1)) {
    return static_cast<const float*>(t.data) + base;
  }
  scratch.resize(static_cast<size_t>(dv));
  for (int64_t d = 0; d < dv; ++d) scratch[d] = LoadAsF32(t, base + d * t.stride[3]);
  return scratch.data();
}

}  // namespace

void MergePartial(const RowShape& s, float* out_acc, float* lse_acc, const float* out_part,
                  const float* lse_part) {
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t i = 0; i < s.sq; ++i) {
      for (int64_t h = 0; h < s.h; ++h) {
        const int64_t li = (b * s.h + h) * s.sq + i;
        const int64_t oi = ((b * s.sq + i) * s.h + h) * s.dv;
        float* __restrict oa = out_acc + oi;
        const float* __restrict ob = out_part + oi;
        const float la = lse_acc[li];
        const float lb = lse_part[li];
        if (lb == kNegInf) {
          // Nothing to add. If the accumulator is empty too, make its
          // output exactly zero (the SPEC's value for an empty row).
          if (la == kNegInf) {
            for (int64_t d = 0; d < s.dv; ++d) oa[d] = 0.0f;
          }
          continue;
        }
        if (la == kNegInf) {
          for (int64_t d = 0; d < s.dv; ++d) oa[d] = ob[d];
          lse_acc[li] = lb;
          continue;
        }
        // Both finite (or +inf, which is a caller bug we do not guard).
        // lse = max + log1p(exp(-|la - lb|)) is the overflow-free softplus form;
        // w = sigmoid(lb - la) = 1 / (1 + exp(la - lb)) saturates cleanly to
        // 0 or 1 when exp overflows to inf or underflows to 0.
        const float diff = lb - la;
        const float w = 1.0f / (1.0f + std::exp(-diff));
        lse_acc[li] = std::max(la, lb) + std::log1p(std::exp(-std::fabs(diff)));
        for (int64_t d = 0; d < s.dv; ++d) oa[d] += w * (ob[d] - oa[d]);
      }
    }
  }
}

void ApplySinks(const RowShape& s, float* out, float* lse, const float* sinks) {
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t i = 0; i < s.sq; ++i) {
      for (int64_t h = 0; h < s.h; ++h) {
        const float sink = sinks[h];
        if (sink == kNegInf) continue;  // exp(-inf) = 0 joins the denominator
        const int64_t li = (b * s.h + h) * s.sq + i;
        float* __restrict o = out + ((b * s.sq + i) * s.h + h) * s.dv;
        const float l = lse[li];
        if (l == kNegInf) {
          // No allowed key: the sink is the whole denominator; nothing
          // contributes a value.
          for (int64_t d = 0; d < s.dv; ++d) o[d] = 0.0f;
          lse[li] = sink;
          continue;
        }
        // The keys' share of the new denominator, sigmoid(l - sink), from
        // e = exp(-|l - sink|) directly: exp(l - l_new) would lose every
        // sink share below lse's rounding (~5e-4 at |lse| ~ 8000), and the
        // backward, whose D = dout . out then misses it, the sink's part of
        // every gradient.
        const float e = std::exp(-std::fabs(l - sink));
        const float l_new = std::max(l, sink) + std::log1p(e);
        const float factor = l >= sink ? 1.0f / (1.0f + e) : e / (1.0f + e);
        for (int64_t d = 0; d < s.dv; ++d) o[d] *= factor;
        lse[li] = l_new;
      }
    }
  }
}

void ComputeDelta(const TensorView& dout, const TensorView& out, float* delta) {
  const int64_t nb = out.shape[0], sq = out.shape[1], nh = out.shape[2], dv = out.shape[3];
  std::vector<float> scratch_a, scratch_b;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t h = 0; h < nh; ++h) {
        const float* __restrict x = LoadRow(dout, b, i, h, scratch_a);
        const float* __restrict y = LoadRow(out, b, i, h, scratch_b);
        float acc = 0.0f;
        for (int64_t d = 0; d < dv; ++d) acc += x[d] * y[d];
        delta[(b * nh + h) * sq + i] = acc;
      }
    }
  }
}

void AccumulateDSinks(const RowShape& s, const float* sinks, const float* lse, const float* delta,
                      float* dsinks) {
  for (int64_t h = 0; h < s.h; ++h) {
    const float sink = sinks[h];
    float acc = 0.0f;
    for (int64_t b = 0; b < s.b; ++b) {
      const float* l = lse + (b * s.h + h) * s.sq;
      const float* dl = delta + (b * s.h + h) * s.sq;
      for (int64_t i = 0; i < s.sq; ++i) {
        // lse == -inf only when the row is empty and the sink is -inf too:
        // the sink's probability is then 0 (not exp(-inf + inf) = NaN).
        if (l[i] == kNegInf) continue;
        acc += std::exp(sink - l[i]) * dl[i];
      }
    }
    dsinks[h] -= acc;
  }
}

}  // namespace ringsplash::kernels

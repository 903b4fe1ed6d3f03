// Portable micro-kernels: plain C++ loops with the same tile contracts as the
// AVX-512 ones (micro.h). They are the reference when debugging the fast
// paths and the fallback on CPUs without AVX-512. Also holds the dispatcher,
// since this translation unit is compiled for baseline x86-64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ringsplash/tensor.h"
#include "src/kernels/micro.h"

namespace ringsplash::kernels::micro {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void GemmF32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
             const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
             bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (!accumulate) {
      std::fill(ci, ci + n, 0.0f);
    } else if (row_scale != nullptr) {
      const float r = row_scale[i];
      for (int64_t j = 0; j < n; ++j) ci[j] *= r;
    }
    for (int64_t p = 0; p < k; ++p) {
      const float aip = a[i * a_rs + p * a_cs];
      const float* bp = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
    }
  }
}

// x = cap(scale * s), masked to -inf; shared by forward and backward so both
// see bit-identical logits.
inline float Logit(float s, float scale, float softcap, float inv_cap) {
  float x = s * scale;
  if (softcap > 0.0f) x = softcap * std::tanh(x * inv_cap);
  return x;
}

void SoftmaxForward(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask, int64_t ldm,
                    float scale, float softcap, float* row_max, float* row_sum, float* alpha) {
  const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  const int64_t n_pad = RoundUp(n, kVec);
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * lds;
    const uint8_t* mi = mask != nullptr ? mask + i * ldm : nullptr;
    float mx = kNegInf;
    for (int64_t j = 0; j < n; ++j) {
      float x = Logit(si[j], scale, softcap, inv_cap);
      if (mi != nullptr && mi[j] == 0) x = kNegInf;
      si[j] = x;
      mx = std::max(mx, x);
    }
    const float m_new = std::max(row_max[i], mx);
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      si[j] = std::exp(si[j] - shift);
      sum += si[j];
    }
    for (int64_t j = n; j < n_pad; ++j) si[j] = 0.0f;
    const float a = std::exp(row_max[i] - shift);
    alpha[i] = a;
    row_sum[i] = a * row_sum[i] + sum;
    row_max[i] = m_new;
  }
}

void ProbsBackward(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask, int64_t ldm,
                   float scale, float softcap, const float* lse, float* deriv) {
  const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  const int64_t n_pad = RoundUp(n, kVec);
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * lds;
    const uint8_t* mi = mask != nullptr ? mask + i * ldm : nullptr;
    // lse = -inf: no allowed key in the whole row; exp(x - inf) = 0 everywhere.
    const float shift = lse[i] == kNegInf ? std::numeric_limits<float>::infinity() : lse[i];
    for (int64_t j = 0; j < n; ++j) {
      float x = Logit(si[j], scale, softcap, inv_cap);
      if (softcap > 0.0f) {
        const float t = x * inv_cap;
        deriv[i * lds + j] = 1.0f - t * t;
      }
      if (mi != nullptr && mi[j] == 0) x = kNegInf;
      si[j] = std::exp(x - shift);
    }
    for (int64_t j = n; j < n_pad; ++j) si[j] = 0.0f;
  }
}

void DsBackward(int64_t m, int64_t n, const float* p, float* dp, int64_t ld, const float* delta,
                const float* deriv, float scale) {
  const int64_t n_pad = RoundUp(n, kVec);
  for (int64_t i = 0; i < m; ++i) {
    const float* pi = p + i * ld;
    float* di = dp + i * ld;
    const float* ri = deriv != nullptr ? deriv + i * ld : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      float ds = scale * pi[j] * (di[j] - delta[i]);
      if (ri != nullptr) ds *= ri[j];
      di[j] = ds;
    }
    for (int64_t j = n; j < n_pad; ++j) di[j] = 0.0f;
  }
}

void ToBf16(int64_t m, int64_t n, const float* src, int64_t lds, uint16_t* dst, int64_t ldd) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) dst[i * ldd + j] = F32ToBF16(src[i * lds + j]);
    if (n % 2 != 0) dst[i * ldd + n] = 0;
  }
}

}  // namespace

const MicroKernels& PortableMicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t;
    t.name = "portable";
    t.gemm_f32 = GemmF32;
    t.softmax_forward = SoftmaxForward;
    t.probs_backward = ProbsBackward;
    t.ds_backward = DsBackward;
    t.to_bf16 = ToBf16;
    return t;
  }();
  return table;
}

const MicroKernels& MicroKernelsFor(KernelPath path) {
  switch (path) {
    case KernelPath::kAvx512:
      return Avx512MicroKernels();
    case KernelPath::kAvx512Bf16:
      return Avx512Bf16MicroKernels();
    case KernelPath::kAuto:
    case KernelPath::kPortable:
      break;
  }
  return PortableMicroKernels();
}

}  // namespace ringsplash::kernels::micro

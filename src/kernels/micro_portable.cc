// Portable micro-kernels: plain C++ loops with the same tile contracts as the
// AVX2 and AVX-512 ones (micro.h). They are the reference when debugging the
// fast paths and the fallback on CPUs without AVX2. Also holds the dispatcher,
// since this translation unit is compiled for baseline x86-64.
#include <algorithm>
#include <bit>
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

// x = cap(scale * s); shared by forward and backward so both see
// bit-identical logits.
inline float Logit(float s, float scale, float softcap, float inv_cap) {
  float x = s * scale;
  if (softcap > 0.0f) x = softcap * std::tanh(x * inv_cap);
  return x;
}

inline bool Allowed(const TileArgs& t, int64_t j, int64_t i) {
  return micro::Allowed(t.mask, t.ldm, j, i);
}

void GemmF32Ranges(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                   const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                   bool accumulate, KRanges ranges) {
  if (ranges.lo == nullptr) {
    GemmF32(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t lo = ranges.lo[i], hi = ranges.hi[i];
    GemmF32(1, n, hi - lo, a + i * a_rs + lo * a_cs, a_rs, a_cs, b + lo * ldb, ldb, c + i * ldc,
            ldc, row_scale != nullptr ? row_scale + i : nullptr, accumulate);
  }
}

// 1 if x is a NaN or an infinity: |bits| >= the infinity pattern (exponent
// all ones), branch-free so the copy loops stay simple.
inline uint32_t NonFinite(float x) {
  return static_cast<uint32_t>((std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu) >= 0x7F800000u);
}

bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd) {
  uint32_t bad = 0;
  for (int64_t c = 0; c < cols; ++c) {
    float* out = dst + c * ldd;
    for (int64_t r = 0; r < rows; ++r) {
      out[r] = src[r * lds + c];
      bad |= NonFinite(out[r]);
    }
    std::fill(out + rows, out + ldd, 0.0f);
  }
  return bad != 0;
}

void MaskBits(int64_t queries, int64_t keys, const uint8_t* bytes, int64_t ldb, uint16_t* bits,
              int64_t ldm, int32_t* key_lo, int32_t* key_hi, int32_t* query_lo, int32_t* query_hi) {
  std::fill(bits, bits + keys * ldm, uint16_t{0});
  std::fill(query_lo, query_lo + keys, 0);
  std::fill(query_hi, query_hi + keys, 0);
  for (int64_t i = 0; i < queries; ++i) {
    int32_t lo = 0, hi = 0;
    for (int64_t j = 0; j < keys; ++j) {
      if (bytes[i * ldb + j] == 0) continue;
      bits[j * ldm + i / kVec] |= static_cast<uint16_t>(1u << (i % kVec));
      if (hi == 0) lo = static_cast<int32_t>(j);
      hi = static_cast<int32_t>(j + 1);
      if (query_hi[j] == 0) query_lo[j] = static_cast<int32_t>(i);
      query_hi[j] = static_cast<int32_t>(i + 1);
    }
    key_lo[i] = lo;
    key_hi[i] = hi;
  }
}

// Raw products S^T = K Q^T into t.pt.
void ScoresT(const TileArgs& t) {
  GemmF32(t.keys, RoundUp(t.queries, kVec), t.d, t.k, t.ldk, 1, t.qt, t.ldq, t.pt, t.ldp, nullptr,
          false);
}

void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const float inv_cap = t.softcap > 0.0f ? 1.0f / t.softcap : 0.0f;
  for (int64_t i = 0; i < t.queries; ++i) {
    float mx = kNegInf;
    for (int64_t j = 0; j < t.keys; ++j) {
      float& s = t.pt[j * t.ldp + i];
      s = Allowed(t, j, i) ? Logit(s, t.scale, t.softcap, inv_cap) : kNegInf;
      mx = std::max(mx, s);
    }
    const float m_new = std::max(row_max[i], mx);
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    float sum = 0.0f;
    for (int64_t j = 0; j < t.keys; ++j) {
      float& s = t.pt[j * t.ldp + i];
      s = std::exp(s - shift);
      sum += s;
    }
    const float a = std::exp(row_max[i] - shift);
    alpha[i] = a;
    row_sum[i] = a * row_sum[i] + sum;
    row_max[i] = m_new;
  }
}

void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  ScoresT(t);
  SoftmaxColumns(t, row_max, row_sum, alpha);
}

void BackwardTile(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const float inv_cap = t.softcap > 0.0f ? 1.0f / t.softcap : 0.0f;
  const int64_t mp = RoundUp(t.queries, kVec);
  ScoresT(t);
  GemmF32(t.keys, mp, b.dv, b.v, b.ldv, 1, b.dot, t.ldq, b.ds, t.ldp, nullptr, false);
  for (int64_t j = 0; j < t.keys; ++j) {
    for (int64_t i = 0; i < t.queries; ++i) {
      const int64_t o = j * t.ldp + i;
      const float x = Logit(t.pt[o], t.scale, t.softcap, inv_cap);
      // lse = -inf: the query has no allowed key at all; its P is 0.
      const float p = Allowed(t, j, i) && b.lse[i] != kNegInf ? std::exp(x - b.lse[i]) : 0.0f;
      float ds = t.scale * p * (b.ds[o] - b.delta[i]);
      if (t.softcap > 0.0f) {
        const float c = x * inv_cap;
        ds *= 1.0f - c * c;
      }
      t.pt[o] = p;
      b.ds[o] = ds;
    }
  }
}

bool CopyRowsF32(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                 int64_t ldd) {
  uint32_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    float* d = dst + r * ldd;
    for (int64_t c = 0; c < cols; ++c) {
      bad |= NonFinite(s[c]);
      d[c] = s[c];
    }
    for (int64_t c = cols; c < ldd; ++c) d[c] = 0.0f;
  }
  return bad != 0;
}

}  // namespace

const MicroKernels& PortableMicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t;
    t.name = "portable";
    t.gemm_f32 = GemmF32;
    t.gemm_f32_ranges = GemmF32Ranges;
    t.mask_bits = MaskBits;
    t.transpose_f32 = TransposeF32;
    t.copy_rows_f32 = CopyRowsF32;
    t.softmax_columns = SoftmaxColumns;
    t.forward_tile = ForwardTile;
    t.backward_tile = BackwardTile;
    return t;
  }();
  return table;
}

const MicroKernels& MicroKernelsFor(KernelPath path) {
#if defined(__x86_64__)
  switch (path) {
    case KernelPath::kAvx2:
      return Avx2MicroKernels();
    case KernelPath::kAvx512:
      return Avx512MicroKernels();
    case KernelPath::kAvx512Bf16:
      return Avx512Bf16MicroKernels();
    case KernelPath::kAuto:
    case KernelPath::kPortable:
      break;
  }
#else
  // Elsewhere the x86 tables are not built; ResolveKernelPath never yields them.
  (void)path;
#endif
  return PortableMicroKernels();
}

}  // namespace ringsplash::kernels::micro

// Portable micro-kernels: plain C++ with the same tile contracts as the AVX2
// and AVX-512 ones (micro.h). They are the reference when debugging the fast
// paths and the only path on processors other than x86-64 (aarch64), so
// they are written for the compiler's vectoriser: the products in register
// blocks of GCC/clang vector types (4 f32 lanes: SSE2 on x86-64, NEON on
// aarch64, the baseline vector unit of each), and the softmax loops with
// the queries innermost and no calls or branches inside (a polynomial exp,
// mask bits tested against a table), which -O3 turns into vector code. The
// file is built with -fno-trapping-math (CMakeLists.txt): g++ otherwise
// keeps each select of a possibly-trapping comparison as a branch and
// vectorises none of these loops. Values are unchanged; nothing here runs
// with floating-point traps enabled.
// Also holds the dispatcher, since this translation unit is compiled for
// the baseline instruction set.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ringsplash/tensor.h"
#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/micro/poly.h"

namespace ringsplash::kernels::micro {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Four f32 lanes; arithmetic on it is lane-wise, a scalar operand is
// broadcast.
using V4 = float __attribute__((vector_size(16)));
constexpr int kLanes = 4;
// Register blocks of the products: kBlockRows rows x kBlockVecs vectors of
// C. NEON has 32 vector registers: 4 x 4 (16 accumulators, 4 B vectors, one
// broadcast); SSE2 has 16: 4 x 2.
constexpr int kBlockRows = 4;
#if defined(__aarch64__)
constexpr int kBlockVecs = 4;
#else
constexpr int kBlockVecs = 2;
#endif
constexpr int64_t kBlockCols = kLanes * kBlockVecs;  // divides kVec, hence every n

inline V4 LoadV4(const float* p) {
  V4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreV4(float* p, V4 v) { std::memcpy(p, &v, sizeof v); }

// C[R x 4 NV] (= or +=, see GemmF32Fn) A[R x k] B[k x 4 NV], the
// accumulators in registers. Per p the NV vectors of B's row p are loaded
// once and each A(i, p) is broadcast: the same rounding order as the fast
// paths (C, then the k products in order).
template <int R, int NV>
RINGSPLASH_INLINE void Block(int64_t k, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                             int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                             bool accumulate) {
  V4 acc[R][NV];
  RINGSPLASH_UNROLL
  for (int i = 0; i < R; ++i) {
    const float r = row_scale != nullptr ? row_scale[i] : 1.0f;
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = V4{};
      if (accumulate) {
        acc[i][v] = LoadV4(c + i * ldc + kLanes * v);
        if (row_scale != nullptr) acc[i][v] *= r;
      }
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    V4 bv[NV];
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) bv[v] = LoadV4(b + p * ldb + kLanes * v);
    RINGSPLASH_UNROLL
    for (int i = 0; i < R; ++i) {
      const float ai = a[i * a_rs + p * a_cs];
      RINGSPLASH_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] += ai * bv[v];
    }
  }
  RINGSPLASH_UNROLL
  for (int i = 0; i < R; ++i) {
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) StoreV4(c + i * ldc + kLanes * v, acc[i][v]);
  }
}

// GemmF32RangesFn: column panels of kBlockCols (n is a multiple of kVec),
// rows in balanced blocks of up to kBlockRows, each block over the union of
// its rows' p ranges.
void GemmF32Ranges(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                   const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                   bool accumulate, KRanges ranges) {
  for (int64_t j = 0; j < n; j += kBlockCols) {
    ForEachRowBlock<kBlockRows>(m, [&](int64_t i0, auto rows) {
      constexpr int R = decltype(rows)::value;
      int64_t lo, hi;
      BlockRange(ranges, i0, R, k, &lo, &hi);
      Block<R, kBlockVecs>(hi - lo, a + i0 * a_rs + lo * a_cs, a_rs, a_cs, b + lo * ldb + j, ldb,
                           c + i0 * ldc + j, ldc, row_scale != nullptr ? row_scale + i0 : nullptr,
                           accumulate);
    });
  }
}

void GemmF32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
             const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
             bool accumulate) {
  GemmF32Ranges(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate, KRanges());
}

// exp(x) as Exp256 computes it (micro/math_avx2.h: Cody-Waite reduction, the
// kExp polynomial, 2^n from the rounding sum's bits; 0 below kExpMin, NaN
// stays NaN), as branch-free scalar code so that loops over lanes vectorise.
inline float ExpPoly(float x) {
  using namespace poly;
  const bool tiny = x < kExpMin;  // -inf among them; false for NaN
  x = x < kExpMin ? kExpMin : x;
  x = x > kExpMax ? kExpMax : x;
  // big's bits are 0x4B400000 + n for n = round(x log2 e) (|n| < 2^22).
  const float big = x * kLog2e + kRoundMagic;
  const float n = big - kRoundMagic;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float y = kExp[0];
  for (int i = 1; i < 6; ++i) y = y * r + kExp[i];
  // 2^(n-1) (biased exponent n + 126, in [2, 254] for the clamped x) times 2y.
  const uint32_t bits = (std::bit_cast<uint32_t>(big) + (126u - 0x4B400000u)) << 23;
  const float e = (y + y) * std::bit_cast<float>(bits);
  return tiny ? 0.0f : e;
}

// Bit i of a 16-bit mask word, as a lane-wise AND against this table (SSE2
// has no per-lane variable shift).
constexpr uint32_t kLaneBit[kVec] = {1u << 0,  1u << 1,  1u << 2,  1u << 3, 1u << 4,  1u << 5,
                                     1u << 6,  1u << 7,  1u << 8,  1u << 9, 1u << 10, 1u << 11,
                                     1u << 12, 1u << 13, 1u << 14, 1u << 15};

// The mask word of key j for the 16 queries from i0 (all ones without a mask).
inline uint32_t MaskWord(const TileArgs& t, int64_t j, int64_t i0) {
  return t.mask == nullptr ? 0xFFFFu : t.mask[j * t.ldm + i0 / kVec];
}

// x = cap(scale * s); shared by forward and backward so both see
// bit-identical logits. The soft cap's tanh is a library call, so only the
// uncapped loops vectorise.
template <bool kCapped>
inline float Logit(float s, float scale, float softcap, float inv_cap) {
  float x = s * scale;
  if constexpr (kCapped) x = softcap * std::tanh(x * inv_cap);
  return x;
}

// 1 if x is a NaN or an infinity: |bits| >= the infinity pattern (exponent
// all ones), branch-free so the copy loops stay simple.
inline uint32_t NonFinite(float x) {
  return static_cast<uint32_t>((std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu) >= 0x7F800000u);
}

// In strips of kVec rows, so the strip's source lines stay in L1 while its
// columns are walked (a whole-column walk touched every row's line per
// column).
bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd) {
  uint32_t bad = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kVec) {
    const int64_t r1 = std::min(rows, r0 + kVec);
    for (int64_t c = 0; c < cols; ++c) {
      float* out = dst + c * ldd;
      for (int64_t r = r0; r < r1; ++r) {
        out[r] = src[r * lds + c];
        bad |= NonFinite(out[r]);
      }
    }
  }
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ldd + rows, dst + (c + 1) * ldd, 0.0f);
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

// First pass of the exact step: P^T's logits in place (-inf where masked),
// each lane's max over the tile in lane_max. Keys outer, lanes inner.
template <bool kCapped>
void LogitsAndMax(const TileArgs& t, float* lane_max) {
  const float inv_cap = kCapped ? 1.0f / t.softcap : 0.0f;
  for (int64_t j = 0; j < t.keys; ++j) {
    float* s = t.pt + j * t.ldp;
    for (int64_t i0 = 0; i0 < t.queries; i0 += kVec) {
      const uint32_t w = MaskWord(t, j, i0);
      const int64_t n = std::min(kVec, t.queries - i0);
      for (int64_t l = 0; l < n; ++l) {
        float x = Logit<kCapped>(s[i0 + l], t.scale, t.softcap, inv_cap);
        x = (w & kLaneBit[l]) != 0 ? x : kNegInf;
        s[i0 + l] = x;
        lane_max[i0 + l] = lane_max[i0 + l] < x ? x : lane_max[i0 + l];
      }
    }
  }
}

void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const int64_t mp = RoundUp(t.queries, kVec);
  float* lane_max = t.scratch;    // [mp]
  float* shift = t.scratch + mp;  // [mp]
  float* sum = t.scratch + 2 * mp;
  std::fill(lane_max, lane_max + t.queries, kNegInf);
  std::fill(sum, sum + t.queries, 0.0f);
  t.softcap > 0.0f ? LogitsAndMax<true>(t, lane_max) : LogitsAndMax<false>(t, lane_max);
  for (int64_t i = 0; i < t.queries; ++i) {
    const float m_new = row_max[i] < lane_max[i] ? lane_max[i] : row_max[i];
    lane_max[i] = m_new;
    shift[i] = m_new == kNegInf ? 0.0f : m_new;
  }
  for (int64_t j = 0; j < t.keys; ++j) {
    float* s = t.pt + j * t.ldp;
    for (int64_t i = 0; i < t.queries; ++i) {
      const float p = ExpPoly(s[i] - shift[i]);
      s[i] = p;
      sum[i] += p;
    }
  }
  for (int64_t i = 0; i < t.queries; ++i) {
    const float a = ExpPoly(row_max[i] - shift[i]);
    alpha[i] = a;
    row_sum[i] = a * row_sum[i] + sum[i];
    row_max[i] = lane_max[i];
  }
}

void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  ScoresT(t);
  SoftmaxColumns(t, row_max, row_sum, alpha);
}

// P^T and dS^T from the raw S^T (in t.pt) and dP^T (in b.ds), in place.
template <bool kCapped>
void BackwardEpilogue(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const float inv_cap = kCapped ? 1.0f / t.softcap : 0.0f;
  for (int64_t j = 0; j < t.keys; ++j) {
    float* pt = t.pt + j * t.ldp;
    float* ds = b.ds + j * t.ldp;
    for (int64_t i0 = 0; i0 < t.queries; i0 += kVec) {
      const uint32_t w = MaskWord(t, j, i0);
      const int64_t n = std::min(kVec, t.queries - i0);
      for (int64_t l = 0; l < n; ++l) {
        const int64_t i = i0 + l;
        const float x = Logit<kCapped>(pt[i], t.scale, t.softcap, inv_cap);
        // lse = -inf: the query has no allowed key at all; its P is 0.
        const bool live = ((w & kLaneBit[l]) != 0) & (b.lse[i] != kNegInf);  // no branch
        const float p = live ? ExpPoly(x - b.lse[i]) : 0.0f;
        float d = t.scale * p * (ds[i] - b.delta[i]);
        if constexpr (kCapped) {
          const float c = x * inv_cap;
          d *= 1.0f - c * c;
        }
        pt[i] = p;
        ds[i] = d;
      }
    }
  }
}

void BackwardTile(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const int64_t mp = RoundUp(t.queries, kVec);
  ScoresT(t);
  GemmF32(t.keys, mp, b.dv, b.v, b.ldv, 1, b.dot, t.ldq, b.ds, t.ldp, nullptr, false);
  t.softcap > 0.0f ? BackwardEpilogue<true>(b) : BackwardEpilogue<false>(b);
}

inline float AsF32(float x) { return x; }
inline float AsF32(uint16_t x) { return BF16ToF32(x); }  // exact

// copy_rows_f32 (T = float) and widen_rows_bf16 (T = uint16_t).
template <typename T>
bool CopyRowsAsF32(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  uint32_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * lds;
    float* d = dst + r * ldd;
    for (int64_t c = 0; c < cols; ++c) {
      d[c] = AsF32(s[c]);
      bad |= NonFinite(d[c]);
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
    t.copy_rows_f32 = CopyRowsAsF32<float>;
    t.widen_rows_bf16 = CopyRowsAsF32<uint16_t>;
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
    case KernelPath::kAmx:
      return AmxMicroKernels();
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

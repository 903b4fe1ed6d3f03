// The decoding step for AVX2 (micro.h DecodeStepFn): the AVX-512 kernel's
// design (decode/step_avx512.cc) on 8-lane vectors — chunks of 8 keys,
// their 8 dot products reduced by horizontal adds, an exact online-softmax
// step per chunk, P V into register accumulators, entries sharing K/V rows
// taking each loaded vector together, and their rows four chunks ahead
// requested into L2 a line at a time. AVX2 has no masked 16-bit loads: bf16 column tails go through
// a small zeroed buffer, f32 tails through vmaskmov (which never faults on the lanes it leaves
// out). With 16 vector registers, fewer tokens and columns are held at once than on AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "src/kernels/decode/step_loop.h"
#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/math_avx2.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro::avx2 {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kLanes = 8;
constexpr int kMaxShare = static_cast<int>(kMaxDecodeShare);
// As on AVX-512 (decode/step_avx512.cc): K and V rows 32 keys (four chunks
// here) ahead, into L2, a line at a time beside the loads of the same
// columns.
constexpr int64_t kPrefetchKeys = 32;

// Lanes [0, n) set (n in 0..8), as the vmaskmov mask.
RINGSPLASH_INLINE __m256i LaneMask(int64_t n) {
  const auto lanes = static_cast<int>(std::clamp<int64_t>(n, 0, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The 8 elements from src as f32 (bf16 widened exactly).
template <typename T>
RINGSPLASH_INLINE __m256 LoadFull8(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(src);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Elements [0, n) of src as f32 (bf16 widened exactly), 0 from n on; no
// element at or past n is read. n >= 8: LoadFull8.
template <typename T>
RINGSPLASH_INLINE __m256 Load8(const T* src, int64_t n) {
  if (n >= kLanes) return LoadFull8(src);
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_maskload_ps(src, LaneMask(n));
  } else {
    alignas(16) uint16_t tail[kLanes] = {};
    if (n > 0) std::memcpy(tail, src, static_cast<size_t>(n) * sizeof(uint16_t));
    const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Lane j = the sum of the 8 lanes of r[j].
RINGSPLASH_INLINE __m256 SumLanes8(const __m256 (&r)[kLanes]) {
  const __m256 t0 = _mm256_hadd_ps(r[0], r[1]), t1 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 t2 = _mm256_hadd_ps(r[4], r[5]), t3 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [r0 r1 r2 r3 | r0 r1 r2 r3] by 128-bit half (low, high lanes), u1 likewise r4..r7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

RINGSPLASH_INLINE float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

RINGSPLASH_INLINE float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Requests `bytes` bytes from `ahead` bytes past row into L2 (the address
// formed as an integer: it may lie past the tensor's end; prefetches never
// fault).
template <typename T>
RINGSPLASH_INLINE void PrefetchRow(const T* row, int64_t ahead, int64_t bytes) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(ahead);
  for (int64_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(at + static_cast<uintptr_t>(o)), _MM_HINT_T1);
  }
}

// Scores of G entries sharing K rows: lane j < rows of x[i] = q_i . k_j,
// lanes >= rows 0. Tokens in groups of kTokens (each K vector loaded once
// for the entries, each q vector once for the group); per-token partial
// sums through `part` [G][8][8]. Tokens past `rows` read the last row again
// (their sums are never used), so the column loop has no per-token tests;
// whole cache lines of columns run without the tail's masked loads. With
// fewer than 8 accumulators (G * kTokens < 8), two sets take alternate
// column steps: an FMA's latency is 4 cycles on 2 pipes.
template <int G, typename T>
RINGSPLASH_INLINE void Dots(const DecodeHead* h, const T* k, int64_t ldk, int64_t d, int rows,
                            float* part, __m256 (&x)[G]) {
  constexpr int kTokens = G <= 2 ? 4 : (G <= 4 ? 2 : 1);  // G * kTokens + kTokens + 1 <= 16
  constexpr int kSets = G * kTokens < 8 ? 2 : 1;          // kSets * G * kTokens <= 12
  constexpr int64_t kPerLine = 64 / static_cast<int64_t>(sizeof(T));  // elements per line
  constexpr int kStepsPerLine = static_cast<int>(kPerLine / kLanes);
  const int64_t ahead = kPrefetchKeys * ldk * static_cast<int64_t>(sizeof(T));
  for (int j0 = 0; j0 < rows; j0 += kTokens) {
    const T* row[kTokens];
    RINGSPLASH_UNROLL
    for (int t = 0; t < kTokens; ++t) row[t] = k + std::min(j0 + t, rows - 1) * ldk;
    __m256 acc[kSets][G][kTokens];
    RINGSPLASH_UNROLL
    for (int s = 0; s < kSets; ++s) {
      RINGSPLASH_UNROLL
      for (int i = 0; i < G; ++i) {
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) acc[s][i][t] = _mm256_setzero_ps();
      }
    }
    // Columns [c, c + 8) into set s; n < 8 (the tail) loads only n. Every
    // call but the tail's passes n = kLanes, so Load8's test folds away.
    auto step = [&](int64_t c, int s, int64_t n) RINGSPLASH_INLINE_LAMBDA {
      __m256 kv[kTokens];
      RINGSPLASH_UNROLL
      for (int t = 0; t < kTokens; ++t) kv[t] = Load8(row[t] + c, n);
      RINGSPLASH_UNROLL
      for (int i = 0; i < G; ++i) {
        const __m256 qv = Load8(h[i].q + c, n);
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) acc[s][i][t] = _mm256_fmadd_ps(qv, kv[t], acc[s][i][t]);
      }
    };
    int64_t c = 0;
    for (; c + kPerLine <= d; c += kPerLine) {
      if constexpr (G >= 2) {  // the line these columns open, kPrefetchKeys rows ahead
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) PrefetchRow(row[t] + c, ahead, 64);
      }
      RINGSPLASH_UNROLL
      for (int u = 0; u < kStepsPerLine; ++u) step(c + u * kLanes, u % kSets, kLanes);
    }
    if (c < d) {  // a partial line: whole vectors, then the tail
      if constexpr (G >= 2) {
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) PrefetchRow(row[t] + c, ahead, 64);
      }
      for (; c + kLanes <= d; c += kLanes) step(c, 0, kLanes);
      if (c < d) step(c, 0, d - c);
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      RINGSPLASH_UNROLL
      for (int t = 0; t < kTokens; ++t) {
        __m256 sum = acc[0][i][t];
        if constexpr (kSets == 2) sum = _mm256_add_ps(sum, acc[1][i][t]);
        _mm256_store_ps(part + (i * kLanes + j0 + t) * kLanes, sum);
      }
    }
  }
  RINGSPLASH_UNROLL
  for (int i = 0; i < G; ++i) {
    __m256 r[kLanes];
    RINGSPLASH_UNROLL
    for (int j = 0; j < kLanes; ++j) {
      r[j] = j < rows ? _mm256_load_ps(part + (i * kLanes + j) * kLanes) : _mm256_setzero_ps();
    }
    x[i] = SumLanes8(r);
  }
}

// acc_i[0, dv) = alpha_i acc_i + sum_{j < rows} p[i][j] v_j for the G
// entries sharing V rows, NV vectors of columns at a time in registers.
template <int G, typename T>
RINGSPLASH_INLINE void AddRows(const DecodeHead* h, const float (&p)[kMaxShare][kLanes],
                               const float (&alpha)[kMaxShare], const T* v, int64_t ldv, int64_t dv,
                               int rows) {
  constexpr int NV = G == 1 ? 8 : (G == 2 ? 4 : (G <= 6 ? 2 : 1));  // G * NV + 2 <= 16
  for (int64_t c0 = 0; c0 < dv; c0 += kLanes * NV) {
    __m256 a[G][NV];
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      const __m256 va = _mm256_set1_ps(alpha[i]);
      RINGSPLASH_UNROLL
      for (int u = 0; u < NV; ++u) {
        a[i][u] = _mm256_mul_ps(Load8(h[i].acc + c0 + kLanes * u, dv - c0 - kLanes * u), va);
      }
    }
    // This pass's columns of each row kPrefetchKeys ahead, from the passes
    // that open a line (a pass may cover less than one: 8 or 16 columns).
    const bool prefetch = G >= 2 && c0 % (64 / static_cast<int64_t>(sizeof(T))) == 0;
    const int64_t ahead = kPrefetchKeys * ldv * static_cast<int64_t>(sizeof(T));
    const int64_t bytes = std::min<int64_t>(kLanes * NV, dv - c0) * static_cast<int64_t>(sizeof(T));
    // `full` true: all NV vectors of the pass lie inside [0, dv) (every
    // pass but a last partial one), loaded without the tail's tests.
    auto rows_pass = [&](auto full) RINGSPLASH_INLINE_LAMBDA {
      for (int j = 0; j < rows; ++j) {
        const T* row = v + j * ldv + c0;
        if (prefetch) PrefetchRow(row, ahead, bytes);
        RINGSPLASH_UNROLL
        for (int u = 0; u < NV; ++u) {
          const __m256 vv = decltype(full)::value ? LoadFull8(row + kLanes * u)
                                                  : Load8(row + kLanes * u, dv - c0 - kLanes * u);
          RINGSPLASH_UNROLL
          for (int i = 0; i < G; ++i) {
            a[i][u] = _mm256_fmadd_ps(_mm256_set1_ps(p[i][j]), vv, a[i][u]);
          }
        }
      }
    };
    if (c0 + kLanes * NV <= dv) {
      rows_pass(std::true_type{});
    } else {
      rows_pass(std::false_type{});
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      RINGSPLASH_UNROLL
      for (int u = 0; u < NV; ++u) {
        // vmaskmovps stores are microcoded on AMD cores (about a third of
        // the step's time when every store took one): only the tail does.
        const int64_t c = c0 + kLanes * u;
        if (dv - c >= kLanes) {
          _mm256_storeu_ps(h[i].acc + c, a[i][u]);
        } else if (c < dv) {
          _mm256_maskstore_ps(h[i].acc + c, LaneMask(dv - c), a[i][u]);
        }
      }
    }
  }
}

// One chunk (keys [j0, j0 + rows), rows <= 8) of G entries sharing their K
// and V rows; returns whether a product q . k was not finite.
template <int G, typename T, bool kCapped>
bool Chunk(const DecodeArgs& a, const DecodeHead* h, int64_t j0, int rows) {
  const T* k = static_cast<const T*>(h[0].k) + j0 * a.ldk;
  const T* v = static_cast<const T*>(h[0].v) + j0 * a.ldv;
  alignas(32) float part[G * kLanes * kLanes];
  __m256 x[G];
  Dots<G>(h, k, a.ldk, a.d, rows, part, x);
  alignas(32) float p[kMaxShare][kLanes];
  float alpha[kMaxShare];
  const __m256i live = LaneMask(rows);
  bool bad = false;
  for (int i = 0; i < G; ++i) {
    // |q . k| at or above the infinity pattern: a NaN or an infinity, checked
    // before the soft cap, whose tanh maps them to finite values.
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(x[i]), _mm256_set1_epi32(0x7fffffff));
    const __m256i non_finite = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32(0x7f7fffff));
    bad |= _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(non_finite, live))) != 0;
    __m256 xi = _mm256_mul_ps(x[i], _mm256_set1_ps(a.scale));
    if constexpr (kCapped) {
      xi = _mm256_mul_ps(_mm256_set1_ps(a.softcap),
                         Tanh256(_mm256_mul_ps(xi, _mm256_set1_ps(1.0f / a.softcap))));
    }
    __m256i allowed = live;
    if (h[i].allowed != nullptr) {
      const int word = (h[i].allowed[j0 / 16] >> (j0 % 16)) & 0xff;
      const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(word), bit), bit);
      allowed = _mm256_and_si256(allowed, set);
    }
    const __m256 keep = _mm256_castsi256_ps(allowed);
    xi = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), xi, keep);
    const float m_old = *h[i].row_max;
    const float m_new = std::max(m_old, HorizontalMax(xi));
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    // Exp256 gives exactly 0 for -inf (and anything below -86).
    const __m256 pi = _mm256_and_ps(Exp256(_mm256_sub_ps(xi, _mm256_set1_ps(shift))), keep);
    // exp(0) = 1 exactly: no call while a finite running max holds (most
    // chunks).
    alpha[i] = m_new == m_old && std::isfinite(m_old) ? 1.0f : std::exp(m_old - shift);
    *h[i].row_sum = alpha[i] * *h[i].row_sum + HorizontalSum(pi);
    *h[i].row_max = m_new;
    _mm256_store_ps(p[i], pi);
  }
  AddRows<G>(h, p, alpha, v, a.ldv, a.dv, rows);
  return bad;
}

template <typename T, bool kCapped>
bool Step(const DecodeArgs& a) {
  return ForEachChunk<kLanes>(
      a, [&a](auto g, const DecodeHead* h, int64_t j0, int rows) RINGSPLASH_INLINE_LAMBDA {
        return Chunk<decltype(g)::value, T, kCapped>(a, h, j0, rows);
      });
}

}  // namespace

bool DecodeStep(const DecodeArgs& a) {
  const bool capped = a.softcap > 0.0f;
  if (a.bf16) return capped ? Step<uint16_t, true>(a) : Step<uint16_t, false>(a);
  return capped ? Step<float, true>(a) : Step<float, false>(a);
}

}  // namespace ringsplash::kernels::micro::avx2

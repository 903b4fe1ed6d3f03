// The decoding step for AVX2 (micro.h DecodeStepFn): the AVX-512 kernel's
// design (decode/step_avx512.cc) on 8-lane vectors — chunks of 8 keys,
// their 8 dot products reduced by horizontal adds, an exact online-softmax
// step per chunk, P V into register accumulators, entries sharing K/V rows
// taking each loaded vector together, and (kRequestAhead) their rows four
// chunks ahead requested into L2 a line at a time. AVX2 has no masked
// 16-bit loads: bf16 column tails go through a small zeroed buffer, f32
// tails through vmaskmov (which never faults on the lanes it leaves out).
// With 16 vector registers, fewer tokens and columns are held at once than
// on AVX-512. bf16 entries that share their rows with no other (MHA) read
// K and V as word pairs, as the AVX-512 step does (SplitPairs).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "src/kernels/decode/step_loop.h"
#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/cpu_features.h"
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

// bf16 rows in pair order (DecodeStep with d and dv multiples of 16), as
// on AVX-512 (decode/step_avx512.cc): the 16 columns of a row from c load
// as one vector of 8 32-bit words whose low halves are the even columns c,
// c + 2, ... and high halves the odd ones, widened by one shift and one
// AND — one load and two single-uop operations per 16 columns, where two
// 8-column loads take two loads, two lane-crossing zero extensions and two
// shifts. q and acc are held in the same order for the call: per 16
// columns, the 8 even ones, then the 8 odd ones.
RINGSPLASH_INLINE void SplitPairs(__m256i words, __m256& even, __m256& odd) {
  even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  odd = _mm256_castsi256_ps(
      _mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y = x[0, n) in pair order (n a multiple of 16).
void ToPairOrder(const float* x, int64_t n, float* y) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m256 lo = _mm256_loadu_ps(x + c), hi = _mm256_loadu_ps(x + c + 8);
    // Per 128-bit half: lo's even (odd) elements, then hi's; then the
    // halves' 64-bit pieces in the order lo0 lo1 hi0 hi1.
    const __m256 even = _mm256_shuffle_ps(lo, hi, 0x88), odd = _mm256_shuffle_ps(lo, hi, 0xDD);
    _mm256_storeu_ps(y + c, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
    _mm256_storeu_ps(y + c + 8,
                     _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
  }
}

// x[0, n) = y back from pair order.
void FromPairOrder(const float* y, int64_t n, float* x) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m256 even = _mm256_loadu_ps(y + c), odd = _mm256_loadu_ps(y + c + 8);
    // Interleaving per 128-bit half gives columns 0-3 | 8-11 (lo) and 4-7 |
    // 12-15 (hi); their halves recombined put them in order.
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(x + c, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(x + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// Whether runs of G entries request their K/V rows ahead (PrefetchRow):
// every run of 2 or more (a single row streams on its own), but where the
// hardware prefetchers keep up with K/V streams (kHwStreams:
// CpuFeatures::hw_prefetch_streams, AMD) only at 4 or more FLOPs per byte
// of K and V (2 G FLOPs per element: 4 entries on bf16, 8 on f32). Below
// that the rows stream fast enough for the hardware and the requests cost
// more than they save. On Zen 3 (2 threads, alternated), without them: f32
// with 2 and 4 entries 1.36x and 1.19x faster, bf16 with 2 1.20x; f32 with
// 8 entries and bf16 with 4 0.84x and 0.86-0.90x (docs/perf/DESIGN_MEASUREMENTS.md:
// decoding prefetch).
template <int G, typename T, bool kHwStreams>
constexpr bool kRequestAhead = G >= 2 && (!kHwStreams ||
                                          static_cast<int>(sizeof(float) / sizeof(T)) * G >= 8);

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
// column steps: an FMA's latency is 4 cycles on 2 pipes. kPairs: bf16 rows
// read as word pairs, q in pair order (d a multiple of 16): the same sums
// in another order, the even columns into set 0 and the odd ones into the
// last set.
template <int G, typename T, bool kPairs, bool kRequest>
RINGSPLASH_INLINE void Dots(const DecodeHead* h, const T* k, int64_t ldk, int64_t d, int rows,
                            float* part, __m256 (&x)[G]) {
  static_assert(!kPairs || (G == 1 && std::is_same_v<T, uint16_t>), "word pairs: bf16, one entry");
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
    // Columns [c, c + 16) as word pairs (kPairs).
    auto pair_step = [&](int64_t c) RINGSPLASH_INLINE_LAMBDA {
      __m256 even[kTokens], odd[kTokens];
      RINGSPLASH_UNROLL
      for (int t = 0; t < kTokens; ++t) {
        SplitPairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[t] + c)), even[t],
                   odd[t]);
      }
      RINGSPLASH_UNROLL
      for (int i = 0; i < G; ++i) {
        const __m256 qe = _mm256_loadu_ps(h[i].q + c), qo = _mm256_loadu_ps(h[i].q + c + kLanes);
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) {
          acc[0][i][t] = _mm256_fmadd_ps(qe, even[t], acc[0][i][t]);
          acc[kSets - 1][i][t] = _mm256_fmadd_ps(qo, odd[t], acc[kSets - 1][i][t]);
        }
      }
    };
    int64_t c = 0;
    if constexpr (kPairs) {
      // d is a multiple of 16: half a line at the end. One entry: no
      // requests (kRequestAhead).
      for (; c < d; c += kPerLine) {
        pair_step(c);
        if (c + 2 * kLanes < d) pair_step(c + 2 * kLanes);
      }
    } else {
      for (; c + kPerLine <= d; c += kPerLine) {
        // The line these columns open, kPrefetchKeys rows ahead.
        if constexpr (kRequest) {
          RINGSPLASH_UNROLL
          for (int t = 0; t < kTokens; ++t) PrefetchRow(row[t] + c, ahead, 64);
        }
        RINGSPLASH_UNROLL
        for (int u = 0; u < kStepsPerLine; ++u) step(c + u * kLanes, u % kSets, kLanes);
      }
      if (c < d) {  // a partial line: whole vectors, then the tail
        if constexpr (kRequest) {
          RINGSPLASH_UNROLL
          for (int t = 0; t < kTokens; ++t) PrefetchRow(row[t] + c, ahead, 64);
        }
        for (; c + kLanes <= d; c += kLanes) step(c, 0, kLanes);
        if (c < d) step(c, 0, d - c);
      }
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
template <int G, bool kRequest, typename T>
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
    const bool prefetch = kRequest && c0 % (64 / static_cast<int64_t>(sizeof(T))) == 0;
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

// AddRows on bf16 V rows with acc in pair order, for one entry (kPairs is
// taken only where no entries share rows: DecodeStep): the NW 16-column
// groups from c0, 2 NW vectors of acc in registers.
template <int NW>
RINGSPLASH_INLINE void AddRowsPairsAt(const DecodeHead& h, const float (&p)[kLanes], float alpha,
                                      const uint16_t* v, int64_t ldv, int rows, int64_t c0) {
  __m256 a[2 * NW];
  const __m256 va = _mm256_set1_ps(alpha);
  RINGSPLASH_UNROLL
  for (int u = 0; u < 2 * NW; ++u)
    a[u] = _mm256_mul_ps(_mm256_loadu_ps(h.acc + c0 + kLanes * u), va);
  for (int j = 0; j < rows; ++j) {
    const uint16_t* row = v + j * ldv + c0;
    const __m256 pj = _mm256_set1_ps(p[j]);
    RINGSPLASH_UNROLL
    for (int w = 0; w < NW; ++w) {
      __m256 even, odd;
      SplitPairs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * w)), even, odd);
      a[2 * w] = _mm256_fmadd_ps(pj, even, a[2 * w]);
      a[2 * w + 1] = _mm256_fmadd_ps(pj, odd, a[2 * w + 1]);
    }
  }
  RINGSPLASH_UNROLL
  for (int u = 0; u < 2 * NW; ++u) _mm256_storeu_ps(h.acc + c0 + kLanes * u, a[u]);
}

RINGSPLASH_INLINE void AddRowsPairs(const DecodeHead& h, const float (&p)[kLanes], float alpha,
                                    const uint16_t* v, int64_t ldv, int64_t dv, int rows) {
  constexpr int NW = 4;  // as AddRows with one entry: 8 vectors of acc
  int64_t c0 = 0;
  for (; c0 + 16 * NW <= dv; c0 += 16 * NW) AddRowsPairsAt<NW>(h, p, alpha, v, ldv, rows, c0);
  for (; c0 < dv; c0 += 16) AddRowsPairsAt<1>(h, p, alpha, v, ldv, rows, c0);
}

// One chunk (keys [j0, j0 + rows), rows <= 8) of G entries sharing their K
// and V rows; returns whether a product q . k was not finite.
// kPairs: bf16 rows, q and acc in pair order (Dots, AddRowsPairs).
template <int G, typename T, bool kCapped, bool kPairs, bool kHwStreams>
bool Chunk(const DecodeArgs& a, const DecodeHead* h, int64_t j0, int rows) {
  constexpr bool kRequest = kRequestAhead<G, T, kHwStreams>;
  const T* k = static_cast<const T*>(h[0].k) + j0 * a.ldk;
  const T* v = static_cast<const T*>(h[0].v) + j0 * a.ldv;
  alignas(32) float part[G * kLanes * kLanes];
  __m256 x[G];
  Dots<G, T, kPairs, kRequest>(h, k, a.ldk, a.d, rows, part, x);
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
  if constexpr (kPairs) {
    static_assert(G == 1, "word pairs: one entry per run");
    AddRowsPairs(h[0], p[0], alpha[0], v, a.ldv, a.dv, rows);
  } else {
    AddRows<G, kRequest>(h, p, alpha, v, a.ldv, a.dv, rows);
  }
  return bad;
}

// kAlonePairs: bf16 rows with d and dv multiples of 16, where each entry
// that is a run of its own (G = 1) reads them as word pairs, its q and acc
// in pair order (InPairOrder).
template <typename T, bool kCapped, bool kHwStreams, bool kAlonePairs>
bool Step(const DecodeArgs& a) {
  return ForEachChunk<kLanes>(
      a, [&a](auto g, const DecodeHead* h, int64_t j0, int rows) RINGSPLASH_INLINE_LAMBDA {
        constexpr int G = decltype(g)::value;
        constexpr bool kPairs = kAlonePairs && G == 1;
        return Chunk<G, T, kCapped, kPairs, kHwStreams>(a, h, j0, rows);
      });
}

template <typename T, bool kAlonePairs>
bool StepOf(const DecodeArgs& a, bool capped, bool hw_streams) {
  if (capped) {
    return hw_streams ? Step<T, true, true, kAlonePairs>(a) : Step<T, true, false, kAlonePairs>(a);
  }
  return hw_streams ? Step<T, false, true, kAlonePairs>(a) : Step<T, false, false, kAlonePairs>(a);
}

}  // namespace

// bf16 rows go as word pairs for entries that share their rows with no
// other (MHA steps: 1.07-1.11x in place on one Zen 3 thread); with 4 or 8
// entries per row the pairs measured no faster (docs/perf/DESIGN_MEASUREMENTS.md:
// AVX2 bf16 word pairs). The choice is per run, which the entries' rows alone
// decide, never per call: a call's items take any number of kv groups, so a
// per-call choice would follow the thread count.
bool DecodeStep(const DecodeArgs& a) {
  const bool capped = a.softcap > 0.0f;
  const bool hw_streams = DetectCpuFeatures().hw_prefetch_streams;
  if (a.bf16 && a.d % 16 == 0 && a.dv % 16 == 0) {
    return InPairOrder(
        a, ToPairOrder, FromPairOrder, [](int g) { return g == 1; },
        [&](const DecodeArgs& pairs) { return StepOf<uint16_t, true>(pairs, capped, hw_streams); });
  }
  return a.bf16 ? StepOf<uint16_t, false>(a, capped, hw_streams)
                : StepOf<float, false>(a, capped, hw_streams);
}

}  // namespace ringsplash::kernels::micro::avx2

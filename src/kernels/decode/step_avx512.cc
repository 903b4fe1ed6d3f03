// The decoding step for AVX-512 (micro.h DecodeStepFn): a few query rows
// per head, K and V rows read in place, 16 keys at a time.
//
// Why its own kernel: a decoding step is bound by reading K and V once (0.5
// FLOP per byte and query row), and the tile loop spends most of it
// elsewhere — it copies each head's strided rows into a per-thread tile (one
// more write and read of every byte) and its transposed score tile fills 1
// of 16 query lanes per row. Here the 16 scores of a chunk are 16 dot
// products over D (their partial sums reduced by a merge tree), the softmax step is
// exact per chunk (16 lanes: no lazy rescaling needed), and P V adds 16 rows
// into acc in registers; every row's part of a chunk is done before the next
// chunk, so the K (then V) rows of a token for all the heads of a work item
// — adjacent in [B, S, H, D] tensors — are read as one stretch of memory.
// Entries sharing K/V rows (rows of one head, heads of one kv head) load
// each vector once for up to kMaxDecodeShare of them.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "src/kernels/decode/step_loop.h"
#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/fused_avx512.h"
#include "src/kernels/micro/math_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro::avx512 {
namespace {

// Lanes `live` of 16 consecutive elements of a row as f32 (bf16 widened,
// exactly); the other lanes are 0 and not read.
template <typename T>
RINGSPLASH_INLINE __m512 Load16(const T* src, __mmask16 live) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(live, src);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(live, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

constexpr int kMaxShare = static_cast<int>(kMaxDecodeShare);  // entries done together

// Heads sharing rows (G >= 2) do G times the arithmetic per byte, which
// leaves the out-of-order window too few loads in flight to cover memory
// latency: each K and V row two chunks ahead (32 keys) is requested, a line
// at a time beside the loads of the same columns of this chunk's row —
// spread over the arithmetic, since a request waits for a free fill buffer
// and a burst of them stalls the core. Into L1 (prefetcht0) for runs of up
// to 4 entries, into L2 (prefetcht1) for 5 to 8: measured on one host (the
// Xeon with AMX), runs of 2 and 4 took 5-20 % less time into L1 and runs of 8 4 %
// more (docs/perf/DESIGN_MEASUREMENTS.md: decoding prefetch). One head per row
// (MHA) keeps enough loads in flight by itself; the requests would only
// slow it, so it makes none.
constexpr int64_t kPrefetchKeys = 32;

// Requests `bytes` bytes from `ahead` bytes past row for a run of G entries
// (above). The address may lie past the tensor's end (the last chunks):
// prefetches never fault, and it is formed as an integer, not by pointer
// arithmetic out of the object.
template <int G, typename T>
RINGSPLASH_INLINE void PrefetchRow(const T* row, int64_t ahead, int64_t bytes) {
  constexpr auto kHint = G <= 4 ? _MM_HINT_T0 : _MM_HINT_T1;
  const uintptr_t at = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(ahead);
  for (int64_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(at + static_cast<uintptr_t>(o)), kHint);
  }
}

// x[i] lane j = the sum of the 16 lanes of part[i][j] (token j's partial
// sums of entry i, j < rows; lanes of tokens >= rows are 0), by a tree of
// pairwise merges (30 shuffles and 15 adds per entry, against 64 and 15 for
// a 16 x 16 transpose and adds): level 1 adds lanes c and c + 8 of two
// tokens into one vector (each token's 8 sums in one half), level 2 lanes c
// and c + 4, level 3 c and c + 2, level 4 c and c + 1 — the association a
// transpose followed by halving adds would give, so the sums are the same.
// The pairing of level 1 (tokens p and p + 4, then p + 8 and p + 12) leaves
// token j in lane j.
template <int G>
RINGSPLASH_INLINE void ReduceParts(const float* part, int rows, __m512 (&x)[G]) {
  RINGSPLASH_UNROLL
  for (int i = 0; i < G; ++i) {
    const float* pi = part + i * 16 * 16;
    auto token = [&](int j) {
      return j < rows ? _mm512_load_ps(pi + j * 16) : _mm512_setzero_ps();
    };
    __m512 y[8];
    RINGSPLASH_UNROLL
    for (int p = 0; p < 4; ++p) {
      RINGSPLASH_UNROLL
      for (int h = 0; h < 2; ++h) {  // y[2p] = tokens (p, p + 4), y[2p + 1] = (p + 8, p + 12)
        const __m512 a = token(8 * h + p), b = token(8 * h + p + 4);
        y[2 * p + h] =
            _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
      }
    }
    __m512 z[4];
    RINGSPLASH_UNROLL
    for (int n = 0; n < 4; ++n) {
      z[n] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * n], y[2 * n + 1], 0x88),
                           _mm512_shuffle_f32x4(y[2 * n], y[2 * n + 1], 0xDD));
    }
    __m512 w[2];
    RINGSPLASH_UNROLL
    for (int n = 0; n < 2; ++n) {
      w[n] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * n], z[2 * n + 1], 0x44),
                           _mm512_shuffle_ps(z[2 * n], z[2 * n + 1], 0xEE));
    }
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  }
}

// bf16 rows in pair order (DecodeStep with d and dv multiples of 32): the
// 32 columns of a row from c0 load as one vector of 16 32-bit words whose
// low halves are the even columns c0, c0 + 2, ... and high halves the odd
// ones, widened by one shift and one AND — half the loads and widening
// work of two 16-column loads, which bound a bf16 GQA step (several heads'
// arithmetic per byte read). q and acc are held in the same order for the
// call: per 32 columns, the 16 even ones, then the 16 odd ones.
RINGSPLASH_INLINE void SplitPairs(__m512i words, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  odd = _mm512_castsi512_ps(
      _mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y = x[0, n) in pair order (n a multiple of 32).
void ToPairOrder(const float* x, int64_t n, float* y) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 lo = _mm512_loadu_ps(x + c), hi = _mm512_loadu_ps(x + c + 16);
    _mm512_storeu_ps(y + c, _mm512_permutex2var_ps(lo, even, hi));
    _mm512_storeu_ps(y + c + 16, _mm512_permutex2var_ps(lo, odd, hi));
  }
}

// x[0, n) = y back from pair order.
void FromPairOrder(const float* y, int64_t n, float* x) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 even = _mm512_loadu_ps(y + c), odd = _mm512_loadu_ps(y + c + 16);
    _mm512_storeu_ps(x + c, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(x + c + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
}

// Scores of G entries sharing K rows: lane j < rows of x[i] = q_i . k_j
// (k_j = k + j * ldk, d elements), lanes >= rows 0. Tokens go in groups of
// kTokens, each K vector loaded (and widened) once for the G entries and
// each q vector once for the group's tokens — G * kTokens accumulators, one
// load per FMA or fewer — and the per-token partial sums go through `part`
// [G][16][16] and ReduceParts. kPairs: bf16 rows read as word pairs, q in
// pair order (d a multiple of 32): the same sums in another order.
template <int G, typename T, bool kPairs = false>
RINGSPLASH_INLINE void Dots(const DecodeHead* h, const T* k, int64_t ldk, int64_t d, int rows,
                            float* part, __m512 (&x)[G]) {
  static_assert(!kPairs || std::is_same_v<T, uint16_t>, "word pairs are bf16 rows");
  constexpr int kTokens = G <= 2 ? 8 : (G <= 4 ? 4 : 2);  // divides 16
  for (int j0 = 0; j0 < rows; j0 += kTokens) {
    const T* row[kTokens];
    __mmask16 present[kTokens];  // tokens past `rows` are not read
    RINGSPLASH_UNROLL
    for (int t = 0; t < kTokens; ++t) {
      row[t] = k + std::min(j0 + t, rows - 1) * ldk;
      present[t] = j0 + t < rows ? static_cast<__mmask16>(0xffff) : 0;
    }
    // The line of each row kPrefetchKeys ahead that holds the columns read
    // next (64 bytes: 32 bf16 or 16 f32 columns).
    const int64_t ahead = kPrefetchKeys * ldk * static_cast<int64_t>(sizeof(T));
    auto request = [&](int64_t c) RINGSPLASH_INLINE_LAMBDA {
      if constexpr (G >= 2) {
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) {
          if (present[t] != 0) PrefetchRow<G>(row[t] + c, ahead, 64);
        }
      }
    };
    __m512 acc[G][kTokens];
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      RINGSPLASH_UNROLL
      for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_setzero_ps();
    }
    if constexpr (kPairs) {
      for (int64_t c = 0; c < d; c += 32) {
        request(c);
        __m512 even[kTokens], odd[kTokens];
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) {
          SplitPairs(_mm512_maskz_loadu_epi32(present[t], row[t] + c), even[t], odd[t]);
        }
        RINGSPLASH_UNROLL
        for (int i = 0; i < G; ++i) {
          const __m512 qe = _mm512_loadu_ps(h[i].q + c), qo = _mm512_loadu_ps(h[i].q + c + 16);
          RINGSPLASH_UNROLL
          for (int t = 0; t < kTokens; ++t) {
            acc[i][t] = _mm512_fmadd_ps(qo, odd[t], _mm512_fmadd_ps(qe, even[t], acc[i][t]));
          }
        }
      }
    } else {
      for (int64_t c = 0; c < d; c += 16) {
        if (c % (64 / static_cast<int64_t>(sizeof(T))) == 0) request(c);
        const __mmask16 live = LaneMask(d - c);
        __m512 kv[kTokens];
        RINGSPLASH_UNROLL
        for (int t = 0; t < kTokens; ++t) kv[t] = Load16(row[t] + c, live & present[t]);
        RINGSPLASH_UNROLL
        for (int i = 0; i < G; ++i) {
          const __m512 qv = _mm512_maskz_loadu_ps(live, h[i].q + c);
          RINGSPLASH_UNROLL
          for (int t = 0; t < kTokens; ++t) acc[i][t] = _mm512_fmadd_ps(qv, kv[t], acc[i][t]);
        }
      }
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      RINGSPLASH_UNROLL
      for (int t = 0; t < kTokens; ++t) {
        _mm512_store_ps(part + (i * 16 + j0 + t) * 16, acc[i][t]);
      }
    }
  }
  ReduceParts<G>(part, rows, x);
}

// acc_i[0, dv) = alpha_i acc_i + sum_{j < rows} p[i][j] v_j for the G heads
// sharing V rows, NV vectors of columns at a time held in registers over the
// rows (each V vector loaded and widened once for the G heads).
template <int G, typename T>
RINGSPLASH_INLINE void AddRows(const DecodeHead* h, const float (&p)[kMaxShare][16],
                               const float (&alpha)[kMaxShare], const T* v, int64_t ldv, int64_t dv,
                               int rows) {
  constexpr int NV = G <= 4 ? 4 : 2;
  for (int64_t c0 = 0; c0 < dv; c0 += 16 * NV) {
    __m512 a[G][NV];
    __mmask16 live[NV];
    RINGSPLASH_UNROLL
    for (int u = 0; u < NV; ++u) {
      const int64_t c = c0 + 16 * u;
      live[u] = c < dv ? LaneMask(dv - c) : 0;
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      const __m512 va = _mm512_set1_ps(alpha[i]);
      RINGSPLASH_UNROLL
      for (int u = 0; u < NV; ++u) {
        a[i][u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(live[u], h[i].acc + c0 + 16 * u), va);
      }
    }
    for (int j = 0; j < rows; ++j) {
      const T* row = v + j * ldv + c0;
      if constexpr (G >= 2) {
        // This pass's columns of the row kPrefetchKeys ahead.
        PrefetchRow<G>(row, kPrefetchKeys * ldv * static_cast<int64_t>(sizeof(T)),
                       std::min<int64_t>(16 * NV, dv - c0) * static_cast<int64_t>(sizeof(T)));
      }
      __m512 vv[NV];
      RINGSPLASH_UNROLL
      for (int u = 0; u < NV; ++u) vv[u] = Load16(row + 16 * u, live[u]);
      RINGSPLASH_UNROLL
      for (int i = 0; i < G; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i][j]);
        RINGSPLASH_UNROLL
        for (int u = 0; u < NV; ++u) a[i][u] = _mm512_fmadd_ps(pj, vv[u], a[i][u]);
      }
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      RINGSPLASH_UNROLL
      for (int u = 0; u < NV; ++u) {
        _mm512_mask_storeu_ps(h[i].acc + c0 + 16 * u, live[u], a[i][u]);
      }
    }
  }
}

// AddRows on bf16 V rows with acc in pair order: columns [c0, c0 + 32 NW).
template <int G, int NW>
RINGSPLASH_INLINE void AddRowsPairsAt(const DecodeHead* h, const float (&p)[kMaxShare][16],
                                      const float (&alpha)[kMaxShare], const uint16_t* v,
                                      int64_t ldv, int rows, int64_t c0) {
  __m512 a[G][2 * NW];
  RINGSPLASH_UNROLL
  for (int i = 0; i < G; ++i) {
    const __m512 va = _mm512_set1_ps(alpha[i]);
    RINGSPLASH_UNROLL
    for (int u = 0; u < 2 * NW; ++u) {
      a[i][u] = _mm512_mul_ps(_mm512_loadu_ps(h[i].acc + c0 + 16 * u), va);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const uint16_t* row = v + j * ldv + c0;
    if constexpr (G >= 2) {
      PrefetchRow<G>(row, kPrefetchKeys * ldv * 2, 64 * NW);  // this pass's columns
    }
    __m512 vv[2 * NW];
    RINGSPLASH_UNROLL
    for (int u = 0; u < NW; ++u) {
      SplitPairs(_mm512_loadu_si512(row + 32 * u), vv[2 * u], vv[2 * u + 1]);
    }
    RINGSPLASH_UNROLL
    for (int i = 0; i < G; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i][j]);
      RINGSPLASH_UNROLL
      for (int u = 0; u < 2 * NW; ++u) a[i][u] = _mm512_fmadd_ps(pj, vv[u], a[i][u]);
    }
  }
  RINGSPLASH_UNROLL
  for (int i = 0; i < G; ++i) {
    RINGSPLASH_UNROLL
    for (int u = 0; u < 2 * NW; ++u) _mm512_storeu_ps(h[i].acc + c0 + 16 * u, a[i][u]);
  }
}

template <int G>
RINGSPLASH_INLINE void AddRowsPairs(const DecodeHead* h, const float (&p)[kMaxShare][16],
                                    const float (&alpha)[kMaxShare], const uint16_t* v, int64_t ldv,
                                    int64_t dv, int rows) {
  constexpr int NW = G <= 4 ? 2 : 1;  // as AddRows: 2 NW vectors per head in registers
  int64_t c0 = 0;
  for (; c0 + 32 * NW <= dv; c0 += 32 * NW) AddRowsPairsAt<G, NW>(h, p, alpha, v, ldv, rows, c0);
  if constexpr (NW > 1) {
    if (c0 < dv) AddRowsPairsAt<G, 1>(h, p, alpha, v, ldv, rows, c0);
  }
}

// One chunk (keys [j0, j0 + rows)) of G heads sharing their K and V rows;
// returns whether a logit was not finite.
// kPairs: bf16 rows, q and acc in pair order (Dots, AddRowsPairs).
template <int G, typename T, bool kCapped, bool kPairs>
bool Chunk(const DecodeArgs& a, const DecodeHead* h, int64_t j0, int rows) {
  const T* k = static_cast<const T*>(h[0].k) + j0 * a.ldk;
  const T* v = static_cast<const T*>(h[0].v) + j0 * a.ldv;
  const __mmask16 live = LaneMask(rows);
  alignas(64) float part[G * 16 * 16];
  __m512 x[G];
  Dots<G, T, kPairs>(h, k, a.ldk, a.d, rows, part, x);
  alignas(64) float p[kMaxShare][16];
  float alpha[kMaxShare];
  bool bad = false;
  for (int i = 0; i < G; ++i) {
    // |q . k| reaches the infinity pattern iff it is a NaN or an infinity:
    // checked before the soft cap, whose tanh maps +-inf and NaN to +-1.
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(x[i]), _mm512_set1_epi32(0x7fffffff));
    bad |= _mm512_mask_cmpge_epi32_mask(live, bits, _mm512_set1_epi32(0x7f800000)) != 0;
    __m512 xi = _mm512_mul_ps(x[i], _mm512_set1_ps(a.scale));
    if constexpr (kCapped) {
      xi = _mm512_mul_ps(_mm512_set1_ps(a.softcap),
                         Tanh512(_mm512_mul_ps(xi, _mm512_set1_ps(1.0f / a.softcap))));
    }
    const __mmask16 allowed =
        h[i].allowed == nullptr ? live : static_cast<__mmask16>(live & h[i].allowed[j0 / 16]);
    xi = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), allowed, xi);
    const float m_old = *h[i].row_max;
    const float m_new = std::max(m_old, _mm512_reduce_max_ps(xi));
    const float shift = m_new == kNegInf ? 0.0f : m_new;
    // Exp512 gives exactly 0 for -inf (and anything below -86).
    const __m512 pi =
        _mm512_maskz_mov_ps(allowed, Exp512(_mm512_sub_ps(xi, _mm512_set1_ps(shift))));
    // exp(0) = 1 exactly: no call while a finite running max holds (most
    // chunks).
    alpha[i] = m_new == m_old && std::isfinite(m_old) ? 1.0f : std::exp(m_old - shift);
    *h[i].row_sum = alpha[i] * *h[i].row_sum + _mm512_reduce_add_ps(pi);
    *h[i].row_max = m_new;
    _mm512_store_ps(p[i], pi);
  }
  if constexpr (kPairs) {
    AddRowsPairs<G>(h, p, alpha, v, a.ldv, a.dv, rows);
  } else {
    AddRows<G>(h, p, alpha, v, a.ldv, a.dv, rows);
  }
  return bad;
}

template <typename T, bool kCapped, bool kPairs = false>
bool Step(const DecodeArgs& a) {
  return ForEachChunk<16>(
      a, [&a](auto g, const DecodeHead* h, int64_t j0, int rows) RINGSPLASH_INLINE_LAMBDA {
        return Chunk<decltype(g)::value, T, kCapped, kPairs>(a, h, j0, rows);
      });
}

// Step on bf16 rows in pair order (InPairOrder).
template <bool kCapped>
bool StepPairs(const DecodeArgs& a) {
  return InPairOrder(
      a, ToPairOrder, FromPairOrder, [](int) { return true; },
      [](const DecodeArgs& pairs) { return Step<uint16_t, kCapped, true>(pairs); });
}

}  // namespace

bool DecodeStep(const DecodeArgs& a) {
  const bool capped = a.softcap > 0.0f;
  if (a.bf16 && a.d % 32 == 0 && a.dv % 32 == 0) {
    return capped ? StepPairs<true>(a) : StepPairs<false>(a);
  }
  if (a.bf16) return capped ? Step<uint16_t, true>(a) : Step<uint16_t, false>(a);
  return capped ? Step<float, true>(a) : Step<float, false>(a);
}

}  // namespace ringsplash::kernels::micro::avx512

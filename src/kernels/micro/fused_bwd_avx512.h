// The fused backward tile of the AVX-512 kernels (BackwardTileFn), as a
// template over where its two products come from: computed in registers
// (micro/fused_bwd_avx512.cc) or stored by the bf16 products (GemmBf16Fn)
// (micro/fused_bwd_stored_avx512.cc). Two files, so that the two sets of
// unrolled block instantiations compile on two cores at once: an
// instrumented sanitizer build of both in one file is the slowest compile
// of CI (docs/perf/DESIGN_MEASUREMENTS.md: two fused backward
// files). lse is known, so P^T = 2^(x * log2 e - lse * log2 e) is fused
// into the S^T block, and dS^T = scale P^T (dP^T - delta) into the
// dP^T = V dO^T block. Include only from AVX-512 translation units.
#ifndef RINGSPLASH_KERNELS_MICRO_FUSED_BWD_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_FUSED_BWD_AVX512_H_

#include <immintrin.h>

#include <cstdint>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/fused_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro::avx512::bwd {

// P^T = 2^(x2 - lse2) (0 where masked or lse = -inf), with a cap also
// deriv^T = 1 - tanh^2.
template <bool kMasked, bool kCapped>
struct ProbsEpilogue {
  const TileArgs& t;
  const float* lse2;       // [mp] lse * log2 e (0 for queries without keys)
  const uint16_t* finite;  // [mp / 16] lanes whose lse is finite
  float* deriv;
  ExponentOp<kCapped> exponent;

  void Zero(int64_t j0, int rows, int64_t i0, int vectors) {
    ZeroVectors(t.pt, t.ldp, j0, rows, i0, vectors);
  }

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 shift = _mm512_load_ps(lse2 + col);
      RINGSPLASH_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t o = (j0 + r) * t.ldp + col;
        __m512 th;
        const __m512 p = Exp2Raw512(exponent(acc[r][v], shift, &th));
        if constexpr (kCapped) {
          _mm512_storeu_ps(deriv + o, _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f)));
        }
        __mmask16 keep = finite[col / 16];
        if constexpr (kMasked) keep &= Allowed16(t, j0 + r, col);
        _mm512_storeu_ps(t.pt + o, _mm512_maskz_mov_ps(keep, p));
      }
    }
  }
};

// dS^T = scale P^T (dP^T - delta) [* deriv^T] from the dP^T registers.
template <bool kCapped>
struct DsEpilogue {
  const BackwardTileArgs& b;
  const float* delta;  // [mp]
  __m512 scale;

  void Zero(int64_t j0, int rows, int64_t i0, int vectors) {
    ZeroVectors(b.ds, b.t.ldp, j0, rows, i0, vectors);
  }

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    const int64_t ldp = b.t.ldp;
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 dl = _mm512_load_ps(delta + col);
      RINGSPLASH_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t o = (j0 + r) * ldp + col;
        const __m512 sp = _mm512_mul_ps(scale, _mm512_loadu_ps(b.t.pt + o));
        __m512 ds = _mm512_mul_ps(sp, _mm512_sub_ps(acc[r][v], dl));
        if constexpr (kCapped) ds = _mm512_mul_ps(ds, _mm512_loadu_ps(b.deriv + o));
        _mm512_storeu_ps(b.ds + o, ds);
      }
    }
  }
};

template <bool kStored, bool kMasked, bool kCapped>
void Probs(const TileArgs& t, int64_t mp, const float* lse2, const uint16_t* finite, float* deriv) {
  ProbsEpilogue<kMasked, kCapped> epi{t, lse2, finite, deriv, ExponentOp<kCapped>(t)};
  if constexpr (kStored) {
    StoredBlocks(t.keys, mp, t.pt, t.ldp, t.mask, t.ldm, epi);
  } else {
    Blocks(t.keys, mp, t.d, t.k, t.ldk, t.qt, t.ldq, t.mask, t.ldm, epi);
  }
}

template <bool kStored, bool kCapped>
void Ds(const BackwardTileArgs& b, int64_t mp, const float* delta) {
  const TileArgs& t = b.t;
  DsEpilogue<kCapped> epi{b, delta, _mm512_set1_ps(t.scale)};
  if constexpr (kStored) {
    StoredBlocks(t.keys, mp, b.ds, t.ldp, t.mask, t.ldm, epi);
  } else {
    Blocks(t.keys, mp, b.dv, b.v, b.ldv, b.dot, t.ldq, t.mask, t.ldm, epi);
  }
}

// BackwardTileFn with the products computed in registers (kStored false) or
// read from t.pt and b.ds (BackwardTileArgs::products_stored).
template <bool kStored>
void BackwardTileImpl(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const int64_t mp = RoundUp(t.queries, kVec);
  float* lse2 = t.scratch;
  float* delta = t.scratch + mp;
  auto* finite = reinterpret_cast<uint16_t*>(t.scratch + 2 * mp);
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __m512 l = _mm512_maskz_loadu_ps(live, b.lse + i0);
    // Dead lanes and queries without keys (lse = -inf) get P = 0.
    const __mmask16 keys = _mm512_mask_cmp_ps_mask(live, l, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    finite[i0 / 16] = keys;
    _mm512_store_ps(lse2 + i0, _mm512_maskz_mul_ps(keys, l, _mm512_set1_ps(kLog2e)));
    _mm512_store_ps(delta + i0, _mm512_maskz_loadu_ps(live, b.delta + i0));
  }
  WithSwitches(t, [&](auto capped, auto masked) {
    constexpr bool kCapped = decltype(capped)::value;
    Probs<kStored, decltype(masked)::value, kCapped>(t, mp, lse2, finite, b.deriv);
    Ds<kStored, kCapped>(b, mp, delta);
  });
}

}  // namespace ringsplash::kernels::micro::avx512::bwd

#endif  // RINGSPLASH_KERNELS_MICRO_FUSED_BWD_AVX512_H_

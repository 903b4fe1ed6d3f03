// AMX micro-kernels (compiled with -mamx-tile -mamx-bf16 on top of the
// AVX512_BF16 flags; called only after runtime detection, and tile
// instructions run only once Linux granted the tile-data permission:
// AmxTilesPermitted). The "amx" path is the avx512_bf16 table with GemmBf16
// on AMX tiles: the bf16 forward's score products K Q^T and, with P rounded
// to bf16 rows by its softmax step (SoftmaxBf16) and V packed as pairs
// (PackPairsBf16), its P V; the bf16 backward's S^T = K Q^T, dP^T = V dO^T
// and, from P^T and dS^T rounded to bf16 (GradOperandsBf16), dV, dK and dQ
// (flash/backward.cc). Those operands are made by the avx512_bf16 table's
// kernels (micro/path_avx512_bf16.cc), everything else by the AVX-512 kernels.
//
// TDPBF16PS multiplies a 16 x 32 bf16 tile A (16 rows, 16 pairs) by a 16 x 16
// pair-interleaved tile B (16 pair rows x 16 columns x 2) into 16 x 16 f32 C,
// i.e. exactly micro.h's GemmBf16 layouts: A rows at stride lda elements, B
// pair rows at stride ldb * 2 elements. Like vdpbf16ps it multiplies bf16
// pairs exactly in f32 and rounds each f32 sum to nearest even (bf16
// subnormal inputs read as zero), so results differ from the vdpbf16ps kernel
// only in the order of the f32 sums.
//
// Tiles: C blocks of up to 2 x 2 tiles (32 x 32) in tmm0-3, A in tmm4-5, B in
// tmm6-7, every tile 16 rows x 64 bytes; k runs in steps of 16 pairs. Rows
// beyond the last multiple of 16 and pairs beyond the last multiple of 16
// (D not a multiple of 32) go to the vdpbf16ps kernel.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/micro/tile_config_amx.h"

namespace ringsplash::kernels::micro {
namespace {

constexpr int64_t kTile = 16;  // rows of a tile; also pairs (k) and columns (n) per tile

// One C block of RI x CJ tiles at rows i, columns j, over k2 pairs (a
// multiple of 16). Tile numbers are instruction immediates, hence the
// spelled-out cases.
template <int RI, int CJ>
void TileBlock(int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  float* c1 = c + kTile * ldc;                             // second row of tiles
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if constexpr (CJ == 2) _tile_loadd(1, c + kTile, sc);
    if constexpr (RI == 2) _tile_loadd(2, c1, sc);
    if constexpr (RI == 2 && CJ == 2) _tile_loadd(3, c1 + kTile, sc);
  } else {
    _tile_zero(0);
    if constexpr (CJ == 2) _tile_zero(1);
    if constexpr (RI == 2) _tile_zero(2);
    if constexpr (RI == 2 && CJ == 2) _tile_zero(3);
  }
  for (int64_t t = 0; t < k2; t += kTile) {
    _tile_loadd(4, a + 2 * t, sa);
    if constexpr (RI == 2) _tile_loadd(5, a + kTile * lda + 2 * t, sa);
    _tile_loadd(6, b + t * ldb * 2, sb);
    if constexpr (CJ == 2) _tile_loadd(7, b + (t * ldb + kTile) * 2, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CJ == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RI == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RI == 2 && CJ == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  if constexpr (CJ == 2) _tile_stored(1, c + kTile, sc);
  if constexpr (RI == 2) _tile_stored(2, c1, sc);
  if constexpr (RI == 2 && CJ == 2) _tile_stored(3, c1 + kTile, sc);
}

// C[m x n] (+)= A B with m, n and k2 multiples of 16. Row panels of 32
// outside: a panel of A (32 rows x k2 pairs, 8 KiB at k2 = 64) stays in L1
// while the column blocks stream B. Faster than column panels outside (B's
// panel kept instead) on the products of D = 128 (docs/perf/DESIGN_MEASUREMENTS.md:
// AMX row panels).
void TileProducts(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                  const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  // GCC 12's tile load and store intrinsics are asm without a "memory"
  // clobber, so nothing stops the compiler from moving them across
  // ordinary loads and stores of A, B and C once this is inlined somewhere:
  // compiler barriers on both sides keep them inside.
  asm volatile("" ::: "memory");
  ConfigureTiles();
  for (int64_t i = 0; i < m; i += 2 * kTile) {
    const bool two_rows = i + 2 * kTile <= m;
    const uint16_t* ai = a + i * lda;
    for (int64_t j = 0; j < n; j += 2 * kTile) {
      const bool two_cols = j + 2 * kTile <= n;
      const uint16_t* bj = b + 2 * j;  // column j of pair-interleaved B
      float* cij = c + i * ldc + j;
      if (two_rows && two_cols) {
        TileBlock<2, 2>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else if (two_rows) {
        TileBlock<2, 1>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else if (two_cols) {
        TileBlock<1, 2>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else {
        TileBlock<1, 1>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      }
    }
  }
  // Back to the initial tile state, so the thread's context switches save
  // no tile data and other AMX users in the process start from a clean slate.
  _tile_release();
  asm volatile("" ::: "memory");
}

// GemmBf16Fn on AMX where whole tiles fit, the vdpbf16ps kernel for the rest
// (and for row_scale, which AMX cannot apply to C) — and for everything if
// Linux refused the tile permission (same layouts, so same results up to the
// order of the f32 sums).
void GemmBf16Amx(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                 const uint16_t* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                 bool accumulate) {
  const GemmBf16Fn vector_gemm = Avx512Bf16MicroKernels().gemm_bf16;
  const int64_t m16 = m / kTile * kTile, k16 = k2 / kTile * kTile;
  if (row_scale != nullptr || m16 == 0 || k16 == 0 || !AmxTilesPermitted()) {
    vector_gemm(m, n, k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    return;
  }
  TileProducts(m16, n, k16, a, lda, b, ldb, c, ldc, accumulate);
  if (k16 < k2) {
    vector_gemm(m16, n, k2 - k16, a + 2 * k16, lda, b + k16 * ldb * 2, ldb, c, ldc, nullptr, true);
  }
  if (m16 < m) {
    vector_gemm(m - m16, n, k2, a + m16 * lda, lda, b, ldb, c + m16 * ldc, ldc, nullptr,
                accumulate);
  }
}

}  // namespace

const MicroKernels& AmxMicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = Avx512Bf16MicroKernels();
    t.name = "amx";
    t.gemm_bf16 = GemmBf16Amx;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro

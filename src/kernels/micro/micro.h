// Micro-kernel interface of the flash loops: the few tile operations whose
// speed matters, as a table of function pointers per KernelPath.
//
// Tile formats (all row-major, leading dimensions in elements):
//   f32 operands: plain row-major; vector widths (n of a GEMM, ldb, ldc) are
//     multiples of kVec = 16 lanes and padded with zeros by the packers.
//   bf16 operands of GemmBf16: A is row-major bf16 whose consecutive pairs
//     (elements 2t, 2t+1 of a row) are read as one 32-bit word; B is
//     "pair-interleaved": B(p, j) = b[((p / 2) * ldb + j) * 2 + p % 2], so one
//     512-bit load holds 16 columns x 2 consecutive p — what vdpbf16ps wants.
// The flash loops only ever call these through MicroKernelsFor(path), so the
// AVX-512 code runs only after runtime detection (cpu_features.h).
#ifndef RINGSPLASH_KERNELS_MICRO_MICRO_H_
#define RINGSPLASH_KERNELS_MICRO_MICRO_H_

#include <cstdint>

#include "ringsplash/attention.h"

namespace ringsplash::kernels::micro {

constexpr int64_t kVec = 16;  // f32 lanes of a 512-bit vector
inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// Leading dimension for a tile with n columns of 4-byte lanes: n rounded up to
// kVec, plus one vector when the row stride would be a multiple of 512 bytes.
// Such strides map a column panel's rows onto a fraction of the L1 sets
// (e.g. 128 floats: half of them), so a 32 KB B panel no longer fits in L1.
inline int64_t PaddedLd(int64_t n) {
  const int64_t ld = RoundUp(n, kVec);
  return ld % 128 == 0 ? ld + kVec : ld;
}

// C[m x n] = A[m x k] B[k x n]                      when !accumulate,
// C[m x n] = diag(row_scale) C + A B                when accumulate
//            (row_scale == nullptr: plain C += A B).
// A(i, p) = a[i * a_rs + p * a_cs] (row-major, or transposed for P^T dO);
// B(p, j) = b[p * ldb + j]; C(i, j) = c[i * ldc + j].
// Requires n % kVec == 0; k may be 0 (C = 0 or diag(row_scale) C).
using GemmF32Fn = void (*)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                           int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                           const float* row_scale, bool accumulate);

// Per-row ranges of p for products whose A is zero outside them (masked
// attention tiles): row i needs only p in [lo[i], hi[i]) (lo == hi: none).
struct KRanges {
  const int32_t* lo = nullptr;
  const int32_t* hi = nullptr;
};
// GemmF32Fn where A(i, p) == 0 for p outside ranges[i]: the products may skip
// those p (implementations take the union over a register block's rows). The
// result equals the full product's (adding exact zeros) up to the sign of a
// zero and except that 0 * inf = NaN terms are not formed.
using GemmF32RangesFn = void (*)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                                 int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                                 const float* row_scale, bool accumulate, KRanges ranges);

// As GemmF32Fn with bf16 operands (f32 accumulation): k2 pairs of p, A(i, p)
// = a[i * lda + p] (lda even), B pair-interleaved with ldb columns.
using GemmBf16Fn = void (*)(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                            const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                            const float* row_scale, bool accumulate);

// B operands of the bf16 products of the avx512_bf16 and amx paths (the
// forward's V, the backward's Q^T, dO^T, Q, dO and K): f32 rows as bf16 pairs, rounded
// to nearest even,
//   dst[((r / 2) * ldd + c) * 2 + r % 2] = bf16(src[r * lds + c]), zero rows
//   from `rows` to RoundUp(rows, 32) (whole 16-pair k steps); cols % 16 == 0.
using PackPairsBf16Fn = void (*)(int64_t rows, int64_t cols, const float* src, int64_t lds,
                                 uint16_t* dst, int64_t ldd);

// The same pairs straight from bf16 rows (the bf16 forward's V, read from the
// caller's tensor: no rounding, no f32 copy). Any cols: columns from cols
// to RoundUp(cols, 16) are written as zeros and src is read only at r <
// rows, c < cols (the row may end where another head's begins, or the
// tensor does).
using PackPairsFromBf16Fn = void (*)(int64_t rows, int64_t cols, const uint16_t* src, int64_t lds,
                                     uint16_t* dst, int64_t ldd);

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols, and 0 for
// rows <= r < ldd (ldd >= RoundUp(rows, kVec)): packs a Q (or dO) block of
// f32 rows as Q^T. Returns whether a transposed value is a NaN or an
// infinity, so the forward's check of its q rows needs no second pass (on
// the f32 score paths; the bf16 score path packs q otherwise and checks it
// separately).
using TransposeF32Fn = bool (*)(int64_t rows, int64_t cols, const float* src, int64_t lds,
                                float* dst, int64_t ldd);

// dst[r * ldd + c] = src[r * lds + c] for r < rows, c < cols (f32), zero for
// cols <= c < ldd; returns whether a copied value is a NaN or an infinity.
// Copies kv tiles for the per-thread tile cache (tiling/tiles.h): the rows
// are strided by other heads, which the hardware prefetchers do not follow,
// so implementations ask for the rows a few ahead of the copy.
using CopyRowsF32Fn = bool (*)(const float* src, int64_t lds, int64_t rows, int64_t cols,
                               float* dst, int64_t ldd);
// As CopyRowsF32 from bf16 rows (src and lds in bf16 elements), each value
// widened to f32 (exact: its bits shifted up 16); NaN and infinity stay so.
// The per-thread tile copies of bf16 K and V on the f32 product paths, which
// otherwise widen all of K and V once per call into fresh memory.
using WidenRowsBf16Fn = bool (*)(const uint16_t* src, int64_t lds, int64_t rows, int64_t cols,
                                 float* dst, int64_t ldd);
// Whether rows x cols 16-bit floats (row r at src + r * lds) hold a NaN or
// an infinity: |bits| >= inf, the exponent all ones (bf16 0x7F80, f16
// 0x7C00). The NaN/Inf check of bf16 (f16) q, k and v rows read in place,
// as by the bf16 products (FlashParams::non_finite): a plain loop over
// 16-bit lanes took ~20 % of an amx window forward (docs/perf/XEON_HOST.md).
// Only on the AVX-512 tables; else poison.cc's loop.
using AnyNonFinite16Fn = bool (*)(const uint16_t* src, int64_t lds, int64_t rows, int64_t cols,
                                  uint16_t inf);

// --- Tiles in the transposed layout -------------------------------------------
// The flash loops hold score tiles TRANSPOSED: S^T = K Q^T with keys as rows
// and queries as the 16 lanes of a vector. K (and V) rows are then read as
// they are stored (no transposition per kv tile; f32 inputs need no packing
// at all) and the softmax bookkeeping of a query (max, sum, lse, delta) is one
// lane: no horizontal reductions anywhere. Q^T (and dO^T) are packed once per
// q block and reused by every kv tile.
//
// Common fields: `keys` rows j of the tile and `queries` lanes i; vectors span
// mp = RoundUp(queries, kVec) lanes. Logits x_ji = scale * (K Q^T)_ji, then
// with softcap > 0 x = softcap * tanh(x / softcap), then masked to -inf
// unless Allowed(mask, ldm, j, i). Outputs over a register block in which
// no pair is allowed may be written as zeros without computing anything.
struct TileArgs {
  int64_t keys = 0, queries = 0, d = 0;
  const float* k = nullptr;  // K(j, p) = k[j * ldk + p], p < d
  int64_t ldk = 0;
  const float* qt = nullptr;  // Q^T(p, i) = qt[p * ldq + i], zero for queries <= i < mp
  int64_t ldq = 0;
  float* pt = nullptr;  // P^T(j, i) = pt[j * ldp + i] (output), i < mp
  int64_t ldp = 0;
  const uint16_t* mask = nullptr;  // transposed mask bits (MaskBitsFn), or nullptr: all allowed
  int64_t ldm = 0;
  float scale = 1.0f, softcap = 0.0f;
  float* scratch = nullptr;  // 3 * mp floats of working space, 64-byte aligned
};

// Transposed element mask of a tile as bits: key j allows query i iff bit
// i % 16 of mask[j * ldm + i / 16] is set (ldm >= mp / 16 words per key).
inline bool Allowed(const uint16_t* mask, int64_t ldm, int64_t j, int64_t i) {
  return mask == nullptr || ((mask[j * ldm + i / kVec] >> (i % kVec)) & 1) != 0;
}

// From a row-major byte mask (bytes[i * ldb + j] != 0: query i may see key
// j; i < queries, j < keys) makes the transposed bits (bits[j * ldm + g] for
// g < ldm, zero for queries >= `queries`) and the ranges of the products:
// per query the keys it may see, [key.lo[i], key.hi[i]), and per key the
// queries that may see it, [query.lo[j], query.hi[j]) (lo == hi == 0: none).
using MaskBitsFn = void (*)(int64_t queries, int64_t keys, const uint8_t* bytes, int64_t ldb,
                            uint16_t* bits, int64_t ldm, int32_t* key_lo, int32_t* key_hi,
                            int32_t* query_lo, int32_t* query_hi);

// Forward, in place on P^T already holding the raw products (K Q^T)^T: the
// EXACT online-softmax step of every query lane i < queries:
//   m_new = max(row_max_i, max_j x_ji); shift = (m_new == -inf) ? 0 : m_new
//   P^T_ji = exp(x_ji - shift); alpha_i = exp(row_max_i - shift)
//   row_sum_i = alpha_i * row_sum_i + sum_j P^T_ji; row_max_i = m_new.
// A query masked in the whole tile keeps row_max = -inf or its old value.
using SoftmaxColumnsFn = void (*)(const TileArgs& t, float* row_max, float* row_sum, float* alpha);

// Forward: computes K Q^T and the online-softmax step of SoftmaxColumnsFn,
// fused where the implementation can. It may instead take a LAZY step for a
// query whose row_max is finite: P^T_ji = exp(x_ji - row_max_i) with
// alpha_i = 1, row_sum_i += sum_j P^T_ji and row_max_i unchanged, provided
// every such sum stays <= kLazySumLimit (so nothing overflows). row_max is
// then a reference value rather than the running maximum; out = acc / l and
// lse = row_max + log(l) are unchanged up to rounding, and the result is
// still a deterministic function of the inputs and tile order.
constexpr float kLazySumLimit = 1048576.0f;  // 2^20

// The bf16 P V's step: that of ForwardTileFn (exact, or lazy) on the raw
// products already in t.pt (as SoftmaxColumnsFn takes them), but P is
// written only as bf16 rows, the A operand of the tile P V:
//   p[i * ldpb + j] = bf16(P^T_ji) for i < queries, j < keys, and zero for
//   keys <= j < RoundUp(keys, 32) <= ldpb.
// t.pt is clobbered; t.scratch as for the other steps (TileArgs).
// Both steps on stored products (this and SoftmaxColumnsFn) mask every
// element before using it, so masked entries of t.pt may hold anything (the
// bf16 forward leaves stale values in the 32 x 32 blocks of a partial tile
// it does not compute).
using SoftmaxBf16Fn = void (*)(const TileArgs& t, float* row_max, float* row_sum, float* alpha,
                               uint16_t* p, int64_t ldpb);
using ForwardTileFn = void (*)(const TileArgs& t, float* row_max, float* row_sum, float* alpha);

// Backward tile: P^T_ji = exp(x_ji - lse_i) (0 where masked or lse_i = -inf)
// and dS^T_ji = scale * P^T_ji * (dP^T_ji - delta_i) [* (1 - (x_ji / softcap)^2)
// with a soft cap, the derivative taken before masking] where dP^T = V dO^T.
// Writes P^T to t.pt and dS^T to ds[j * ldp + i] (lanes i >= queries: unspecified).
struct BackwardTileArgs {
  TileArgs t;
  int64_t dv = 0;
  const float* v = nullptr;  // V(j, c) = v[j * ldv + c], c < dv
  int64_t ldv = 0;
  const float* dot = nullptr;    // dO^T(c, i) = dot[c * ldq + i], zero padded like Q^T
  const float* lse = nullptr;    // [queries]
  const float* delta = nullptr;  // [queries]
  float* ds = nullptr;
  float* deriv = nullptr;  // keys * ldp floats of working space when softcap > 0
  // The bf16 backward (avx512_bf16, amx): S^T (raw products K Q^T) is already
  // in t.pt and dP^T in ds, from GemmBf16Fn; t.k, t.qt, v and dot are then unused. Only the AVX-512
  // BackwardTile (avx512, avx512_bf16 and amx tables) accepts this.
  bool products_stored = false;
};
using BackwardTileFn = void (*)(const BackwardTileArgs& b);

// The bf16 backward's A operands of its three gradient products, rounded to
// bf16 (nearest even) from a backward tile's P^T and dS^T (ldp):
//   pt_rows[j * ldr + i] = bf16(P^T_ji), ds_rows[j * ldr + i] = bf16(dS^T_ji)
//     for j < keys, i < mp (zero for i >= queries): the A of dV += P^T dO and
//     dK += dS^T Q, k running over queries;
//   ds_cols[i * ldc + j] = bf16(dS^T_ji) for i < queries, j < RoundUp(keys, 32)
//     (zero for j >= keys): the A of dQ += dS K, k running over keys.
// pt_rows and ds_rows (together) or ds_cols may be null: not wanted.
using GradOperandsBf16Fn = void (*)(int64_t keys, int64_t queries, const float* pt, const float* ds,
                                    int64_t ldp, uint16_t* pt_rows, uint16_t* ds_rows, int64_t ldr,
                                    uint16_t* ds_cols, int64_t ldc);

// Decoding (ForwardCall's decoding mode: a few query rows per head): one
// exact online-softmax step of each of `heads` query rows (DecodeHead: one
// row of one head) over `keys` K/V rows read IN PLACE, in chunks of 16 keys
// (8 on AVX2: the rounding differs, each path is deterministic),
// every row's part of a chunk before the next chunk (so the rows of a token
// for all the heads, adjacent in [B, S, H, D] tensors, stream from memory
// together). Adjacent entries with the same k and v (the rows of one head,
// the heads of one kv head) are taken together, up to kMaxDecodeShare at a
// time: each K and V vector is loaded once for them. Per entry and chunk of
// keys j:
//   x_j = scale * (q . k_j), with softcap > 0 then softcap * tanh(x_j / softcap),
//   then -inf unless allowed; m_new = max(row_max, max_j x_j);
//   shift = (m_new == -inf) ? 0 : m_new; p_j = exp(x_j - shift);
//   alpha = exp(row_max - shift); row_sum = alpha * row_sum + sum_j p_j;
//   acc = alpha * acc + sum_j p_j v_j; row_max = m_new.
// Every key of the range is read and multiplied (masked ones with p_j = 0),
// so a NaN or infinity in any K row shows as a non-finite product q . k_j
// (returned: true if any was not finite; checked before the scale and the
// soft cap, whose tanh maps +-inf and NaN to finite values) and one in any V
// row as a non-finite acc. K and V are f32 or bf16 (`bf16`), unit inner stride.
constexpr int64_t kMaxDecodeShare = 8;
struct DecodeHead {
  const float* q = nullptr;           // [d], f32
  const void* k = nullptr;            // K row j at k + j * ldk elements
  const void* v = nullptr;            // V row j at v + j * ldv elements
  const uint16_t* allowed = nullptr;  // bit j % 16 of allowed[j / 16]: key j allowed; null: all
  float* acc = nullptr;               // [dv], zero before the first step
  float* row_max = nullptr;           // -inf before the first step
  float* row_sum = nullptr;           // 0 before the first step
};
struct DecodeArgs {
  int64_t heads = 0, keys = 0, d = 0, dv = 0, ldk = 0, ldv = 0;
  bool bf16 = false;
  float scale = 1.0f, softcap = 0.0f;
  const DecodeHead* head = nullptr;  // [heads]
};
using DecodeStepFn = bool (*)(const DecodeArgs& a);

struct MicroKernels {
  const char* name = "";
  GemmF32Fn gemm_f32 = nullptr;
  GemmF32RangesFn gemm_f32_ranges = nullptr;
  GemmBf16Fn gemm_bf16 = nullptr;  // only on the avx512_bf16 and amx paths
  // Only on the avx512_bf16 and amx paths: bf16 pairs for GemmBf16 (the
  // forward's V, the backward's Q^T, dO^T, Q, dO and K), the forward's step
  // writing P as bf16 rows and the backward's bf16 P^T, dS^T and dS.
  PackPairsBf16Fn pack_pairs_bf16 = nullptr;
  PackPairsFromBf16Fn pack_pairs_from_bf16 = nullptr;
  SoftmaxBf16Fn softmax_bf16 = nullptr;
  GradOperandsBf16Fn grad_operands_bf16 = nullptr;
  TransposeF32Fn transpose_f32 = nullptr;
  CopyRowsF32Fn copy_rows_f32 = nullptr;
  WidenRowsBf16Fn widen_rows_bf16 = nullptr;
  AnyNonFinite16Fn any_non_finite16 = nullptr;  // only on the AVX-512 tables
  MaskBitsFn mask_bits = nullptr;
  SoftmaxColumnsFn softmax_columns = nullptr;
  ForwardTileFn forward_tile = nullptr;
  BackwardTileFn backward_tile = nullptr;
  DecodeStepFn decode_step = nullptr;  // AVX-512 and AVX2 (else the tile loop decodes)
};

const MicroKernels& PortableMicroKernels();
const MicroKernels& Avx2MicroKernels();        // call only if DetectCpuFeatures().avx2
const MicroKernels& Avx512MicroKernels();      // call only if DetectCpuFeatures().avx512
const MicroKernels& Avx512Bf16MicroKernels();  // call only if ....avx512_bf16
const MicroKernels& AmxMicroKernels();         // call only if ....amx
// The table for a resolved path (kAuto is treated as kPortable). Only for a
// path the CPU supports: the AVX2 and AVX-512 tables are built by code
// compiled for those instruction sets, and exist only in x86-64 builds.
const MicroKernels& MicroKernelsFor(KernelPath path);

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_MICRO_H_

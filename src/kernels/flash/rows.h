// Finished rows of the forward (flash/forward.cc): where a q block's rows
// go once its walk over the kv tiles is done — out = acc / l and lse = m +
// log(l), then merged into existing rows (the ring), stored as f32 (with
// non-temporal stores for outputs larger than the caches) or rounded to bf16
// with their sinks, at their own places or, for stacked problems
// (decode/stacked_heads.h), at the places of the rows they stand for.
#ifndef RINGSPLASH_KERNELS_FLASH_ROWS_H_
#define RINGSPLASH_KERNELS_FLASH_ROWS_H_

#include <atomic>
#include <cstdint>

#include "src/kernels/flash/flash.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {

// dst[c] = src[c] * s for c < n. With `stream`, 16-byte aligned rows are
// written with non-temporal stores: a large output is written once and not
// read back by the kernel, so fetching its lines first (read for ownership)
// would double the memory traffic of the last step
// (docs/perf/DESIGN_MEASUREMENTS.md: non-temporal output stores). The caller
// orders them with StreamFence().
// (Other architectures get ordinary stores.)
void ScaleRow(float* dst, const float* src, int64_t n, float s, bool stream);

// Orders ScaleRow's non-temporal stores before the task's results are used.
void StreamFence();

// Outputs from this many floats on (16 MiB) are written with `stream`.
inline constexpr int64_t kStreamMinFloats = int64_t{4} << 20;

// Where FinishRows writes out rows: f32 (`f32`, contiguous, merged into when
// merging), or, not merging, bf16 (`bf16.data`, f32 null, with its strides
// and sinks); `overflow` is set if a finite value rounded to a bf16 infinity.
// With stack_group > 0 the rows are those of a stacked problem (decode/stacked_heads.h):
// its row r of kv head kh is row r / g of head kh * g + r % g (g = stack_group)
// of the caller's [B, sq, h] rows, where out and lse live.
struct OutRows {
  float* f32 = nullptr;
  Bf16Out bf16;
  std::atomic<bool>* overflow = nullptr;
  int64_t stack_group = 0, sq = 0, h = 0;

  uint16_t* Bf16Row(int64_t b, int64_t i, int64_t h) const {
    return bf16.data + b * bf16.stride[0] + i * bf16.stride[1] + h * bf16.stride[2];
  }
};

// Where row `row` of head `h` of a call with geometry g goes in `out`:
// (row, head) and the out's own rows and heads.
struct RowAt {
  int64_t row, head, sq, h;
};
RowAt Place(const Geometry& g, const OutRows& out, int64_t row, int64_t h);

// Row (b, row, h) of a finished partial result (part [dv], part_lse) into
// `out` / lse [B, H, Sq] (through Place): merged into the existing row
// (MergePartial), or stored — its sink applied and rounded for a bf16 out;
// part may be clobbered. With `in_place`, part already is the f32 out row.
void EmitRow(const Geometry& g, int64_t b, int64_t row, int64_t h, float* part, float part_lse,
             bool merge, const OutRows& out, float* lse, bool in_place);

// A finished q block's softmax state: acc [m][g.ld_dv] (clobbered when the
// rows are emitted), row_max and row_sum [m].
struct RowState {
  float* acc;
  const float* row_max;
  const float* row_sum;
};

// out = acc / l and lse = m + log(l) for the block's m rows (0 and -inf for
// a row without keys), each then emitted (EmitRow): merged, stored, or its
// sink applied and rounded. `stream`: f32 out rows written with
// non-temporal stores (never when merging or rounding).
void FinishRows(const Geometry& g, int64_t b, int64_t h, int64_t qb, int64_t m, const RowState& ws,
                bool merge, bool stream, const OutRows& out, float* lse);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_FLASH_ROWS_H_

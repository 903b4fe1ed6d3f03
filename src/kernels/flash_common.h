// Shared plumbing of FlashForward and FlashBackward: problem geometry, the
// block map with segment refinement, element masks of partial tiles, and
// per-worker statistics (integers, summed in worker order at the end so the
// totals never depend on scheduling).
#ifndef RINGSPLASH_KERNELS_FLASH_COMMON_H_
#define RINGSPLASH_KERNELS_FLASH_COMMON_H_

#include <cstdint>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "src/kernels/flash.h"
#include "src/mask/block_map.h"

namespace ringsplash::kernels {

struct Geometry {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0, d = 0, dv = 0;
  int64_t group = 1;        // query heads per kv head
  int64_t bq = 0, bkv = 0;  // block sizes (bkv a multiple of micro::kVec)
  int64_t nqb = 0, nkvb = 0;
  int64_t dp = 0, dvp = 0;  // D, Dv rounded up to micro::kVec
  // Leading dimensions (micro::PaddedLd) of tiles with bkv, D and Dv columns.
  int64_t ld_kv = 0, ld_d = 0, ld_dv = 0;
  static Geometry Of(const FlashParams& p);
  int64_t QRows(int64_t qb) const;    // rows of q block qb (ragged last block)
  int64_t KvRows(int64_t kvb) const;  // rows of kv block kvb
};

// The block map of a call plus per-batch segment ids and block ranges.
class TilePlan {
 public:
  TilePlan(const FlashParams& p, const Geometry& g, bool by_column);

  const mask::BlockMap& map() const { return map_; }
  bool has_segments() const { return has_segments_; }
  // Kind of tile (qb, kvb) for batch b given the map's kind for it.
  mask::BlockKind Refine(mask::BlockKind map_kind, int64_t b, int64_t qb, int64_t kvb) const;
  // Element mask of a non-empty tile whose refined kind is partial:
  // out[i * ld + j] (i < rows of qb, j < rows of kvb) = 1 if allowed, else 0.
  void FillMask(mask::BlockKind map_kind, int64_t head, int64_t b, int64_t qb, int64_t kvb,
                uint8_t* out, int64_t ld) const;

 private:
  const Geometry& g_;
  mask::BlockMap map_;
  bool has_segments_ = false;
  std::vector<int32_t> q_seg_, kv_seg_;                  // [B, Sq], [B, Skv] contiguous copies
  std::vector<mask::BlockRanges> q_ranges_, kv_ranges_;  // per batch
};

// Integer counters per worker; Total() sums them in worker order.
struct WorkerStats {
  int64_t computed = 0, full = 0, partial = 0, skipped = 0, flops = 0;
  char pad[24];  // keeps workers' counters on separate cache lines
};
void AddStats(const std::vector<WorkerStats>& per_worker, KernelStats* stats);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_FLASH_COMMON_H_

// Block-sparsity metadata (the splash "MaskInfo" idea, SPEC §3).
//
// For block sizes (bq, bkv) and the global positions of the rows held, every
// (q block, kv block) tile is classified as empty (never touched), full (no
// per-element mask work) or partial (needs an element mask). Structured masks
// are classified analytically from each block's [min, max] position range in
// O(1) per tile (and the builder evaluates far fewer tiles than exist when
// positions are sorted); the map stores run-length encoded rows, so memory is
// O(number of runs) — a 1M-token causal mask never allocates 1M x 1M anything.
// Dense masks are classified by scanning their tiles; identical partial tiles
// are stored once (de-duplicated) and referenced by index.
#ifndef RINGSPLASH_MASK_BLOCK_MAP_H_
#define RINGSPLASH_MASK_BLOCK_MAP_H_

#include <cstdint>
#include <span>
#include <vector>

#include "ringsplash/mask.h"

namespace ringsplash::mask {

enum class BlockKind : uint8_t { kEmpty = 0, kPartial = 1, kFull = 2 };

// A run of consecutive tiles of one kind along a row (or column) of the map:
// minor-block indices [begin, end).
struct BlockRun {
  int32_t begin = 0;
  int32_t end = 0;
  BlockKind kind = BlockKind::kEmpty;
};

// Per-block [min, max] of positions (or segment ids) — what analytic
// classification needs. Built once per slice in O(S).
struct BlockRanges {
  int64_t block = 0;
  std::vector<int64_t> lo, hi;  // one entry per block
  static BlockRanges Of(std::span<const int64_t> values, int64_t block);
  static BlockRanges Of(std::span<const int32_t> values, int64_t block);
  int64_t num_blocks() const { return static_cast<int64_t>(lo.size()); }
};

// Classifies one tile of `mask` for query head `head` given the position
// ranges of its q rows and kv columns. Exact for empty and full (never claims
// empty or full wrongly); may say partial when unsure. O(1) per structured
// leaf (and exact both ways for a single one); Dense leaves are classified
// over the whole integer rectangle from their 16 x 16 granule summary (built
// once with the mask), which for strided positions covers much more than the
// tile — BlockMap::Build scans the actual positions instead. Compositions
// keep what either side decides (SPEC §6: the seed dropped every mask but
// causal): a & b is empty if either side is, full if both are; a | b is full
// if either side is, empty if both are (block_map_test checks both
// classifiers against brute force).
BlockKind ClassifyTile(const Mask& mask, int64_t head, int64_t q_lo, int64_t q_hi, int64_t kv_lo,
                       int64_t kv_hi);
// Segment refinement: tiles whose q and kv segment-id ranges do not meet are
// empty; tiles where all q and kv ids are one and the same value are full.
BlockKind ClassifySegments(int64_t q_lo, int64_t q_hi, int64_t kv_lo, int64_t kv_hi);
// Combines a mask kind and a segment kind (empty wins, full needs both).
inline BlockKind Combine(BlockKind a, BlockKind b) {
  if (a == BlockKind::kEmpty || b == BlockKind::kEmpty) return BlockKind::kEmpty;
  if (a == BlockKind::kFull && b == BlockKind::kFull) return BlockKind::kFull;
  return BlockKind::kPartial;
}

// Fills out[i * ld + j] = allowed(head, q_pos[i], kv_pos[j]) ? 1 : 0 for
// i < q_pos.size(), j < kv_pos.size(). Vectorisable per leaf; used for
// partial tiles (O(bq * bkv), small next to the tile's O(bq * bkv * D) FLOPs).
// Thread-safe; uses per-thread scratch, so it allocates nothing once warm.
void FillTileMask(const Mask& mask, int64_t head, std::span<const int64_t> q_pos,
                  std::span<const int64_t> kv_pos, uint8_t* out, int64_t ld);

// Identifies the element mask of a tile up to translation (BlockMap::ShiftKey):
// tiles of one map with equal keys have equal masks.
struct TileShapeKey {
  int64_t plane = 0, diff = 0, q_step = 0, kv_step = 0, rows = 0, cols = 0;
  bool operator==(const TileShapeKey&) const = default;
};

class BlockMap {
 public:
  // Row-major map (rows = q blocks, runs over kv blocks) when by_column is
  // false; column-major (rows = kv blocks, runs over q blocks) when true —
  // the backward's dK/dV pass walks columns. num_query_heads is H; the map
  // has one plane per head only if the mask depends on the head (then
  // mask.num_heads() must equal H). Positions may be any int64 sequence
  // (sorted or not); the last block of each side may be smaller. Tile kinds
  // are exact when they say empty or full (see block_map.cc for how).
  // Throws Error for block sizes <= 0, H < 1 or a head-count mismatch.
  static BlockMap Build(const Mask& mask, std::span<const int64_t> q_pos,
                        std::span<const int64_t> kv_pos, int64_t bq, int64_t bkv,
                        int64_t num_query_heads, bool by_column = false);

  // Maps built by Build in this process so far (tests prove reuse with it).
  static int64_t BuildCount();

  int64_t sq() const { return sq_; }    // query rows covered
  int64_t skv() const { return skv_; }  // key rows covered
  int64_t bq() const { return bq_; }
  int64_t bkv() const { return bkv_; }
  int64_t num_q_blocks() const { return nqb_; }
  int64_t num_kv_blocks() const { return nkvb_; }
  bool by_column() const { return by_column_; }
  // Number of head planes (1 when the mask is head-independent).
  int64_t num_planes() const { return planes_; }
  // Non-empty runs of major-block `row` for query head `head` (any head in
  // [0, H); head-independent maps answer the same for all), sorted, disjoint,
  // adjacent runs of one kind merged.
  std::span<const BlockRun> Runs(int64_t head, int64_t row) const;
  // Element mask of tile (q block qb, kv block kvb) into out[i * ld + j],
  // i < rows of qb, j < columns of kvb (same argument order for column maps).
  // Copies from the de-duplicated store for planes whose mask has only Dense
  // (and Full) leaves; otherwise evaluates the mask with FillTileMask on the
  // tile's positions. Correct for any tile; meant for partial ones. Thread-safe
  // (per-thread scratch), no allocation after a thread's first call.
  void FillPartial(int64_t head, int64_t qb, int64_t kvb, uint8_t* out, int64_t ld) const;
  // When the mask of tile (qb, kvb)'s plane depends only on kv - q (Full,
  // Causal and Local leaves under & and |) and both blocks' positions are
  // arithmetic progressions, the tile's mask is a function of the first
  // positions' difference, the steps and the sizes: *key gets those and the
  // answer is true. Tiles with equal keys then have equal masks, so a caller
  // may reuse one's (a sliding window's diagonal tiles are all alike).
  bool ShiftKey(int64_t head, int64_t qb, int64_t kvb, TileShapeKey* key) const;
  // Tiles of each kind over all planes (for tests and accounting).
  int64_t Count(BlockKind kind) const;
  // Unique partial tile patterns stored for Dense masks (0 for structured).
  int64_t num_unique_partial_tiles() const;
  // Bytes held by the map: O(blocks + runs + unique dense tiles), plus the
  // positions of blocks that are not arithmetic progressions, plus a tile
  // index for de-duplicated Dense planes.
  size_t memory_bytes() const;

 private:
  // Positions of one block of rows, kept compactly so that the map stays
  // O(blocks): affine blocks (contiguous, striped) as first + step * i,
  // others as a slice of explicit_pos_ starting at explicit_at.
  struct PositionBlock {
    int64_t first = 0;
    int64_t step = 0;
    int64_t explicit_at = -1;  // -1: affine
  };
  // A de-duplicated partial tile of a Dense mask: rows x cols bytes at offset.
  struct UniqueTile {
    int64_t offset = 0;
    int32_t rows = 0;
    int32_t cols = 0;
  };
  class Builder;

  int64_t PlaneOf(int64_t head) const { return planes_ == 1 ? 0 : head % planes_; }
  // Positions of q block qb / kv block kvb; `buf` holds at least the block size.
  std::span<const int64_t> QPositions(int64_t qb, int64_t* buf) const;
  std::span<const int64_t> KvPositions(int64_t kvb, int64_t* buf) const;

  Mask mask_;
  int64_t sq_ = 0, skv_ = 0;
  std::vector<PositionBlock> q_blocks_, kv_blocks_;
  std::vector<int64_t> explicit_pos_;
  int64_t bq_ = 0, bkv_ = 0, nqb_ = 0, nkvb_ = 0, planes_ = 1;
  bool by_column_ = false;
  std::vector<BlockRun> runs_;
  std::vector<int64_t> row_offsets_;  // [planes * rows + 1] into runs_
  int64_t counts_[3] = {0, 0, 0};
  // Dense de-duplication (planes whose mask has only Dense / Full leaves):
  // unique id per tile [planes, nqb, nkvb], -1 where not stored; empty when
  // no plane de-duplicates.
  std::vector<int32_t> dense_tile_ids_;
  std::vector<uint8_t> shift_invariant_;  // per plane: only Full, Causal, Local leaves
  std::vector<UniqueTile> dense_tiles_;
  std::vector<uint8_t> dense_bytes_;
};

}  // namespace ringsplash::mask

#endif  // RINGSPLASH_MASK_BLOCK_MAP_H_

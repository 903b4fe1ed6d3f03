// Shared plumbing of FlashForward and FlashBackward: problem geometry, the
// block map with segment refinement, element masks of partial tiles, and
// per-worker statistics (integers, summed in worker order at the end so the
// totals never depend on scheduling).
#ifndef RINGSPLASH_KERNELS_TILING_TILES_H_
#define RINGSPLASH_KERNELS_TILING_TILES_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/pack.h"
#include "src/mask/block_map.h"

namespace ringsplash::kernels {

struct Geometry {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0, d = 0, dv = 0;
  int64_t group = 1;        // query heads per kv head
  int64_t bq = 0, bkv = 0;  // block sizes (bkv a multiple of micro::kVec)
  int64_t nqb = 0, nkvb = 0;
  int64_t dp = 0, dvp = 0;  // D, Dv rounded up to micro::kVec
  // Leading dimensions (micro::PaddedLd) of tiles with bkv, D, Dv and bq
  // columns (ld_q: the query lanes of transposed tiles).
  int64_t ld_kv = 0, ld_d = 0, ld_dv = 0, ld_q = 0;
  static Geometry Of(const FlashParams& p);
  int64_t QRows(int64_t qb) const;    // rows of q block qb (ragged last block)
  int64_t KvRows(int64_t kvb) const;  // rows of kv block kvb
};

// A unique id per call (never 0): tells per-thread caches (TileCopies,
// TileMask) which call an entry belongs to, so entries never outlive it.
uint64_t NewCallId();

// The block map of a call plus per-batch segment ids and block ranges.
class TilePlan {
 public:
  TilePlan(const FlashParams& p, const Geometry& g, bool by_column);

  const mask::BlockMap& map() const { return *map_; }
  uint64_t id() const { return id_; }  // unique per plan (NewCallId)
  // Computed tiles per kv tile, averaged over kv tiles (of one batch element,
  // over all query heads of a kv head's group; segments not counted).
  double UsesPerKvTile() const;
  bool has_segments() const { return has_segments_; }
  // Kind of tile (qb, kvb) for batch b given the map's kind for it.
  mask::BlockKind Refine(mask::BlockKind map_kind, int64_t b, int64_t qb, int64_t kvb) const;
  // Element mask of a non-empty tile whose refined kind is partial:
  // out[i * ld + j] (i < rows of qb, j < rows of kvb) = 1 if allowed, else 0.
  void FillMask(mask::BlockKind map_kind, int64_t head, int64_t b, int64_t qb, int64_t kvb,
                uint8_t* out, int64_t ld) const;

 private:
  const Geometry& g_;
  uint64_t id_ = 0;
  std::optional<mask::BlockMap> own_map_;  // built here unless given (FlashParams)
  const mask::BlockMap* map_ = nullptr;
  bool has_segments_ = false;
  std::vector<int32_t> q_seg_, kv_seg_;                  // [B, Sq], [B, Skv] contiguous copies
  std::vector<mask::BlockRanges> q_ranges_, kv_ranges_;  // per batch
};

// The element mask of a partial tile in the micro-kernels' forms (micro.h):
// transposed bits for the fused score kernels and, for the products, the
// keys each query may see and the queries each key may be seen by. The last
// few masks are kept (per workspace, so per thread) under their
// mask::TileShapeKey: the partial tiles of a sliding window or a causal
// diagonal are all alike, and are then built once per thread and call.
class TileMask {
 public:
  // Sizes the buffers for tiles of `g` (no allocation once large enough).
  void Reserve(const Geometry& g);
  void Fill(const TilePlan& plan, const micro::MicroKernels& mk, mask::BlockKind map_kind,
            int64_t head, int64_t b, int64_t qb, int64_t kvb);
  const uint16_t* bits() const { return cur_->bits.data(); }
  int64_t ldm() const { return ldm_; }
  micro::KRanges keys_of_query() const { return {cur_->key_lo.data(), cur_->key_hi.data()}; }
  micro::KRanges queries_of_key() const { return {cur_->query_lo.data(), cur_->query_hi.data()}; }
  // Masks built so far and masks reused from an earlier tile (for tests).
  int64_t builds() const { return builds_; }
  int64_t reuses() const { return reuses_; }

 private:
  static constexpr int kKept = 16;  // partial tiles of a q block row: window edge + diagonal
  struct Entry {
    uint64_t plan = 0;  // TilePlan::id() of the key (0: no key)
    mask::TileShapeKey key;
    uint64_t last_use = 0;
    AlignedBuffer<uint16_t> bits;
    AlignedBuffer<int32_t> key_lo, key_hi, query_lo, query_hi;
  };
  const Geometry* g_ = nullptr;
  int64_t ldm_ = 0;
  AlignedBuffer<uint8_t> bytes_;
  Entry entries_[kKept];
  Entry* cur_ = &entries_[0];
  uint64_t clock_ = 0;
  int64_t builds_ = 0, reuses_ = 0;
};

// Where the flash loops read the K and V rows of kv tile (b, kv head, kvb):
// the caller's tensor itself when it is f32 with unit inner stride, else a
// copy packed once per call (f32 rows with PaddedLd leading dimensions; bf16
// rows of RoundUp(D, 2) for the bf16 product path).
//   K (kF32): in place whenever possible — it is only broadcast from.
//   V: the B operand of P V, loaded in full vectors, so in place needs Dv a
//     multiple of kVec; and row strides of 512 bytes or more slow P V down
//     (L1 set aliasing, TLB), which a copy avoids. A copy (into fresh,
//     page-faulting memory) costs about as much as that penalty over a few
//     uses of a tile, so V is copied only when its tiles are used at least
//     kPackMinUses times on average (`uses`: computed tiles per kv tile of a
//     batch, over all query heads of its group) — dense masks and long rows,
//     not sliding windows — or when it cannot be read in place
//     (docs/perf/DESIGN_MEASUREMENTS.md: V rows in place).
// With `tile_cache` and f32 keys (kF32, kF32Padded), K and V tiles used too
// rarely for a copy per call are instead copied per thread as they are used
// (KvTileCache) — f32 rows copied, bf16 rows widened — unless they can be
// read in place as they are (f32 rows back to back, nothing to pad):
// tile_cache() says so, and the loops must then read K and V only through a
// KvTileCache.
// With `checked_copy`, f32 (bf16) rows of unit inner stride packed per call
// are copied by its copy_rows_f32 (widened by its widen_rows_bf16), which
// also notes whether a tile's rows hold a NaN or an infinity: NonFinite then
// needs no second read of those rows.
// kBf16Tiles (the bf16 P V of the avx512_bf16 and amx paths): bf16 keys
// as for kBf16, but read in place where the tensor allows (unit inner
// stride, even row stride and D: the bf16 GEMM's A operand takes any even
// leading dimension, ldk_bf16()), and V is never packed or copied — the
// caller reads V from the tensor itself (Values() is then null).
class KvRows {
 public:
  // kF32Padded: rows of ld_d, zero padded.
  enum class KeyFormat { kF32, kF32Padded, kBf16, kBf16Tiles };
  static constexpr double kPackMinUses = 8.0;
  // Dense f32 rows are read in place, never copied, by tiles used less than
  // this on average (tile_cache).
  static constexpr double kCopyMinUses = 2.0;
  KvRows(const FlashParams& p, const Geometry& g, KeyFormat keys, double uses, ThreadPool& pool,
         bool tile_cache = false, const micro::MicroKernels* checked_copy = nullptr);
  const float* Keys(int64_t b, int64_t kh, int64_t kvb) const;
  int64_t ldk() const { return ldk_; }
  const uint16_t* KeysBf16(int64_t b, int64_t kh, int64_t kvb) const;  // ld ldk_bf16()
  int64_t ldk_bf16() const { return ldk_bf16_; }
  const float* Values(int64_t b, int64_t kh, int64_t kvb) const;
  int64_t ldv() const { return ldv_; }
  bool tile_cache() const { return tile_cache_; }
  bool f32_keys() const { return keys_ == KeyFormat::kF32 || keys_ == KeyFormat::kF32Padded; }
  // Whether the K or V rows of tile (b, kh, kvb) of p (the call's params)
  // hold a NaN or an infinity: what the checking copy noted for rows it
  // packed, a check in place for the others.
  bool NonFinite(const FlashParams& p, int64_t b, int64_t kh, int64_t kvb) const;

 private:
  friend class KvTileCache;
  int64_t Tile(int64_t b, int64_t kh, int64_t kvb) const {
    return (b * g_.hkv + kh) * g_.nkvb + kvb;
  }
  // Elements from a tensor's start to the first row of tile (b, kh, kvb).
  int64_t Offset(const int64_t (&stride)[3], int64_t b, int64_t kh, int64_t kvb) const {
    return b * stride[0] + kvb * g_.bkv * stride[1] + kh * stride[2];
  }
  const Geometry& g_;
  KeyFormat keys_;
  uint64_t id_ = 0;  // unique per instance: tells a cache which call a copy is from
  bool tile_cache_ = false;
  bool k_checked_ = false, v_checked_ = false;
  std::vector<uint8_t> packed_bad_;  // per tile, when k_checked_ || v_checked_
  // f32 rows read in place (or, with tile_cache_, copied per thread) ...
  const void* k_in_place_ = nullptr;
  const void* v_in_place_ = nullptr;
  // ... or, with tile_cache_ only, bf16 rows widened per thread.
  const void* k_widen_ = nullptr;
  const void* v_widen_ = nullptr;
  const uint16_t* k_bf16_in_place_ = nullptr;
  int64_t k_stride_[3] = {0, 0, 0}, v_stride_[3] = {0, 0, 0};  // b, s, head
  int64_t ldk_ = 0, ldv_ = 0, ldk_bf16_ = 0, k_elems_ = 0, v_elems_ = 0;
  AlignedBuffer<float> k_packed_, v_packed_;
  AlignedBuffer<uint16_t> k_bf16_;
};

// Least-recently-used lookup over `slots` (each with a `last_use` stamp): the
// first slot `matches` accepts (*hit = true), else the least recently used
// one (*hit = false, for the caller to refill); either way stamped with the
// next tick of *clock. Used by the per-thread caches TileCopies and TileMask.
template <class Slot, class Matches>
Slot* FindOrEvict(std::span<Slot> slots, uint64_t* clock, Matches matches, bool* hit) {
  ++*clock;
  Slot* victim = slots.data();
  for (Slot& s : slots) {
    if (matches(s)) {
      s.last_use = *clock;
      *hit = true;
      return &s;
    }
    if (s.last_use < victim->last_use) victim = &s;
  }
  victim->last_use = *clock;
  *hit = false;
  return victim;
}

// Per-thread copies of the tiles a worker used last, least recently used out
// first: slots of `floats` floats, Slots(floats, budget_bytes) of them, kept
// for the thread's lifetime so that they stay in its L2 and cost no fresh
// memory. A cache serves one kind of tile (KvTileCache, the backward's q
// side); a new slot size empties it.
class TileCopies {
 public:
  // As many slots of `floats` floats as fit in budget_bytes, 2 to 16.
  static int64_t Slots(int64_t floats, int64_t budget_bytes);
  // The slot of tile `tile` of call `call`; *hit says whether it already
  // holds that tile's copy, else the caller must fill it now.
  float* Find(uint64_t call, int64_t tile, int64_t floats, int64_t budget_bytes, bool* hit);

 private:
  struct Slot {
    uint64_t call = 0;  // 0: empty
    int64_t tile = -1;
    uint64_t last_use = 0;
  };
  std::vector<Slot> slots_;
  AlignedBuffer<float> data_;
  int64_t floats_ = 0;
  uint64_t clock_ = 0;
};

// K and V rows of one kv tile as the loops read them: K(j, c) = k[j * ldk +
// c], V(j, c) = v[j * ldv + c]; k is null when the keys are bf16 (read
// through KvRows::KeysBf16 instead).
struct KvTile {
  const float* k;
  int64_t ldk;
  const float* v;
  int64_t ldv;
};

// Where a thread reads kv tile (b, kv head, kvb) from: the call's rows
// (KvRows: in place or packed per call), or — with KvRows::tile_cache() — its
// own copies, made (leading dimensions ld_d and ld_dv) on the thread's first
// use and reused by its next tasks: neighbouring q blocks of a sliding window
// share all but one tile. A copy is exact, so results do not depend on hits
// and misses. About half of a 2 MiB L2.
class KvTileCache {
 public:
  static constexpr int64_t kBudgetBytes = 1280 * 1024;
  // The tiles of the last Together(g) Gets are valid together (copies
  // leave least recently used first). With non_finite, a copy made here sets
  // *non_finite if the tile's K or V rows hold a NaN or an infinity (checked
  // while copying): every tile a thread computes is copied by it at least
  // once per call, so this checks each computed tile (FlashParams::non_finite).
  KvTile Get(const KvRows& kv, const micro::MicroKernels& mk, int64_t b, int64_t kh, int64_t kvb,
             bool* non_finite = nullptr);
  // Get with the check FlashParams::non_finite asks for, when p sets it
  // (sets the flag on a NaN or an infinity): rows the call reads in place
  // (!kv.tile_cache()) by the first user of the tile, which claims it in
  // `claimed` (one flag per (b, kv head, kvb)); copied rows as they are
  // copied (every computed tile is copied by its thread at least once).
  KvTile GetChecked(const KvRows& kv, const micro::MicroKernels& mk, const FlashParams& p,
                    std::vector<std::atomic<bool>>& claimed, int64_t b, int64_t kh, int64_t kvb);
  // At least 2: how many kv tiles of g fit in the copies.
  static int64_t Together(const Geometry& g);

 private:
  TileCopies copies_;
};

// Q^T (or dO^T) of rows [r0, r0 + rows) of head `head` of batch b of a
// [B, S, H, C] view: dst[c * ld + r] for c < C, zero for r >= rows. f32 views
// with unit inner stride go through the micro-kernels' transpose, others are
// widened to f32 rows first. Returns whether a packed value is a NaN or an
// infinity (widening keeps both), the check FlashParams::non_finite asks for.
bool PackTransposed(const micro::MicroKernels& mk, const TensorView& t, int64_t b, int64_t head,
                    int64_t r0, int64_t rows, float* dst, int64_t ld);

// Q^T of rows [r0, r0 + rows) as bf16 pairs, the layout of
// PackTransposedBf16Pairs (tiling/pack.h): dst[((c / 2) * ld + r) * 2 + c % 2],
// zero for r >= rows up to ld and for c = C when C is odd. Two adjacent bf16
// of a row are one 32-bit word, and these pairs are the transpose of the
// rows' words: bf16 views with unit inner stride, even C and 4-byte aligned
// rows go through the micro-kernels' 16 x 16 f32 transpose (moving words;
// its NaN/Inf answer means nothing for pairs and is not used), others
// through the slower element loop (docs/perf/DESIGN_MEASUREMENTS.md:
// Q^T of bf16 rows). ld >= RoundUp(rows, kVec).
void PackTransposedPairsBf16(const micro::MicroKernels& mk, const TensorView& t, int64_t b,
                             int64_t head, int64_t r0, int64_t rows, uint16_t* dst, int64_t ld);

// Grows a per-thread scratch buffer to at least n elements.
template <typename T>
T* Grow(AlignedBuffer<T>& buf, int64_t n) {
  if (buf.size() < static_cast<size_t>(n)) buf.Resize(static_cast<size_t>(n));
  return buf.data();
}

// The bf16 products of partial tiles skip what the mask rules out in
// panels of this many rows (keys or queries) and steps of this many
// elements: the AMX kernel's C blocks (2 x 2 tiles of 16) and one step of
// 16 pairs.
inline constexpr int64_t kBf16Panel = 32;

// The union of ranges[r] (hi exclusive, lo == hi: none) over rows [r0, r1),
// widened to multiples of `unit`: {0, 0} when no row has any.
std::pair<int64_t, int64_t> RangeSpan(micro::KRanges ranges, int64_t r0, int64_t r1, int64_t unit);

// GemmBf16Fn's C (+)= A B (m x n, k2 pairs) where row i of A is zero
// outside its elements [ranges.lo[i], ranges.hi[i]) (TileMask's ranges:
// P or dS rows of a partial tile): per panel of kBf16Panel rows, only the
// pairs some row of it needs, in whole kBf16Panel-element steps. So only
// exact zeros are left out (up to the sign of a zero sum, and 0 * inf = NaN
// terms are not formed, as in GemmF32RangesFn); a panel that
// needs none is zero with accumulate false and left as it is with true.
// A null ranges.lo: the whole product, one call.
void GemmBf16Panels(const micro::MicroKernels& mk, int64_t m, int64_t n, int64_t k2,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                    int64_t ldc, bool accumulate, micro::KRanges ranges);

// Integer counters per worker; Total() sums them in worker order.
struct WorkerStats {
  int64_t computed = 0, full = 0, partial = 0, skipped = 0, flops = 0;
  char pad[24];  // keeps workers' counters on separate cache lines
};
void AddStats(const std::vector<WorkerStats>& per_worker, KernelStats* stats);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_TILING_TILES_H_

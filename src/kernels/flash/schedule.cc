// The schedule choices of the flash loops (flash/schedule.h).
#include "src/kernels/flash/schedule.h"

#include <algorithm>
#include <cstdint>

#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {
namespace {

// Fewer (batch, kv head) pairs than this split their groups (BackwardHeadParts).
constexpr int64_t kMinBackwardTasks = 16;

}  // namespace

bool UseStackedHeads(const FlashParams& p) {
  const int64_t h = p.q.shape[2], hkv = p.k.shape[2], sq = p.q.shape[1];
  const bool head_independent = p.mask == nullptr || p.mask->num_heads() == 0;
  return hkv > 0 && h > hkv && head_independent && sq > 0 && 2 * sq <= p.blocks.q &&
         !UseDecodeStep(p);
}

bool UseDecodeStep(const FlashParams& p) {
  const DType dt = p.q.dtype;
  const int64_t sq = p.q.shape[1], h = p.q.shape[2], hkv = p.k.shape[2];
  const int64_t group = hkv > 0 ? std::max<int64_t>(1, h / hkv) : 1;
  return sq >= 1 && sq <= p.blocks.q && sq * group <= micro::kMaxDecodeShare &&
         (dt == DType::kF32 || dt == DType::kBF16) && (p.k.stride[3] == 1 || p.k.shape[3] == 1) &&
         (p.v.stride[3] == 1 || p.v.shape[3] == 1) &&
         micro::MicroKernelsFor(p.path).decode_step != nullptr;
}

int64_t ForwardHeadsTogether(const Geometry& g) {
  if (g.nqb != 1 || g.sq > micro::kVec || g.h < 2) return 1;
  return std::min(g.h, kMaxHeadsTogether);
}

int64_t ForwardKvSplits(const Geometry& g) {
  // At least kSplitTasks items where the tiles allow (fewer than twice as
  // many), ranges of at least kMinSplitTiles tiles. Decoding-shaped calls
  // (one q block of at most one vector of rows per head), whose items also
  // divide by kv heads (Run in flash/forward.cc), take ranges down to
  // kMinDecodingTiles tiles where they would have fewer than
  // kMinDecodingItems items: with 8-tile ranges an MQA step over up to 1920
  // keys (15 tiles at the default block size) was one item for one core.
  // Shorter ranges everywhere cost more than they gained (each item widens
  // its q rows, merges a partial result and starts its requests ahead cold):
  // docs/perf/DESIGN_MEASUREMENTS.md, decoding ranges.
  constexpr int64_t kSplitTasks = 16, kMinSplitTiles = 8;
  constexpr int64_t kMinDecodingItems = 4, kMinDecodingTiles = 2;
  const int64_t together = ForwardHeadsTogether(g);
  const int64_t tasks = together > 1 ? g.b * ((g.h + together - 1) / together) : g.b * g.h * g.nqb;
  if (tasks == 0 || tasks >= kSplitTasks) return 1;
  int64_t splits = std::clamp<int64_t>(
      std::min((kSplitTasks + tasks - 1) / tasks, g.nkvb / kMinSplitTiles), 1, kSplitTasks);
  const int64_t kv_items = g.b * g.hkv;  // items a decoding call has unsplit
  if (g.nqb == 1 && g.sq <= micro::kVec && kv_items > 0 && kv_items * splits < kMinDecodingItems) {
    splits = std::max(splits, std::min((kMinDecodingItems + kv_items - 1) / kv_items,
                                       g.nkvb / kMinDecodingTiles));
  }
  return splits;
}

int64_t BackwardHeadParts(const Geometry& g) {
  const int64_t pairs = g.b * g.hkv;
  // Parts after the first buffer their dK/dV tiles (whole tiles of padded
  // rows, as FlashBackward allocates them): (parts - 1) of those per pair,
  // kept within one f32 copy of q (what dq's accumulator takes anyway) or
  // 64 MiB.
  const int64_t per_part = pairs * g.nkvb * g.bkv * (g.ld_d + g.ld_dv) * int64_t{sizeof(float)};
  const int64_t cap = std::max<int64_t>(int64_t{64} << 20, g.b * g.sq * g.h * g.d * 4);
  int64_t best = 1;
  for (int64_t parts = 2; parts <= g.group && pairs * best < kMinBackwardTasks; ++parts) {
    if (g.group % parts != 0) continue;
    if ((parts - 1) * per_part > cap) break;
    best = parts;
  }
  return best;
}

bool BackwardInOnePass(const Geometry& g, int threads) {
  // The one-pass tasks are about equal (the heads of a part see the same
  // tiles unless the mask depends on the head; segments differ by batch);
  // with `threads` workers the busiest runs ceil(tasks / threads) of them.
  // Two passes spend 7 products per tile instead of 5 (1.4x), so one pass
  // wins while that imbalance costs at most 1.25x.
  const int64_t tasks = g.b * g.hkv * BackwardHeadParts(g);
  const int64_t t = std::max(1, threads);
  const int64_t rounds = (tasks + t - 1) / t;
  return t == 1 || 4 * rounds * t <= 5 * tasks;
}
}  // namespace ringsplash::kernels

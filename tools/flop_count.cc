// Allowed-pair counting over the block map.
#include "tools/flop_count.h"

#include <algorithm>
#include <vector>

#include "src/mask/block_map.h"
#include "tools/random_fill.h"

namespace ringsplash::cli {
namespace {
// Tile edge for counting: large enough that the map stays small, small
// enough that partial tiles (evaluated element by element) stay cheap.
constexpr int64_t kCountTile = 128;
}  // namespace

const char* PassName(Pass pass) {
  switch (pass) {
    case Pass::kFwd:
      return "fwd";
    case Pass::kBwd:
      return "bwd";
    case Pass::kFwdBwd:
      return "fwdbwd";
  }
  return "?";
}

double AllowedPairs(const Mask& mask, int64_t sq, int64_t skv, int64_t heads) {
  const std::vector<int64_t> q_pos = Iota(sq);
  const std::vector<int64_t> kv_pos = Iota(skv);
  const mask::BlockMap map =
      mask::BlockMap::Build(mask, q_pos, kv_pos, kCountTile, kCountTile, heads);
  std::vector<uint8_t> tile(static_cast<size_t>(kCountTile * kCountTile));
  double total = 0;
  for (int64_t plane = 0; plane < map.num_planes(); ++plane) {
    double plane_pairs = 0;
    for (int64_t qb = 0; qb < map.num_q_blocks(); ++qb) {
      const int64_t rows = std::min(kCountTile, sq - qb * kCountTile);
      for (const mask::BlockRun& run : map.Runs(plane, qb)) {
        if (run.kind == mask::BlockKind::kFull) {
          const int64_t first = run.begin * kCountTile;
          const int64_t last = std::min(skv, int64_t{run.end} * kCountTile);
          plane_pairs += static_cast<double>(rows) * static_cast<double>(last - first);
        } else if (run.kind == mask::BlockKind::kPartial) {
          for (int64_t kb = run.begin; kb < run.end; ++kb) {
            const int64_t cols = std::min(kCountTile, skv - kb * kCountTile);
            map.FillPartial(plane, qb, kb, tile.data(), kCountTile);
            int64_t n = 0;
            for (int64_t i = 0; i < rows; ++i) {
              for (int64_t j = 0; j < cols; ++j) n += tile[i * kCountTile + j] != 0;
            }
            plane_pairs += static_cast<double>(n);
          }
        }
      }
    }
    // A head-independent map has one plane standing for every head.
    total += map.num_planes() == 1 ? plane_pairs * static_cast<double>(heads) : plane_pairs;
  }
  return total;
}

double UsefulFlops(double pairs, int64_t batch, int64_t d, int64_t dv, Pass pass) {
  const double forward = 2.0 * static_cast<double>(batch) * static_cast<double>(d + dv) * pairs;
  switch (pass) {
    case Pass::kFwd:
      return forward;
    case Pass::kBwd:
      return 2.5 * forward;
    case Pass::kFwdBwd:
      return 3.5 * forward;
  }
  return forward;
}

}  // namespace ringsplash::cli

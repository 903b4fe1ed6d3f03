// Tile classification of Dense masks (src/mask/classify.cc) from their
// granule summary (src/mask/mask_node.h), against the mask's own element
// predicate.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "ringsplash/mask.h"
#include "src/mask/block_map.h"

namespace ringsplash::mask {
namespace {

// A Dense leaf is classified from its 16 x 16 granule summary, looking at
// elements only in mixed squares the rectangle cuts: exact both ways for any
// rectangle, aligned or not, inside the matrix or reaching out of it, for
// matrices whose sides are not multiples of 16 and for per-head matrices.
// The matrices are made of runs so that empty, full and mixed squares all occur.
TEST(DenseClassifyTest, ExactForEveryRectangle) {
  std::mt19937_64 rng(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int matrix = 0; matrix < 12; ++matrix) {
    const int64_t heads = matrix % 3 == 0 ? 2 : 0;
    const int64_t sq = uniform(1, 70), skv = uniform(1, 70);
    std::vector<uint8_t> values(static_cast<size_t>(std::max<int64_t>(heads, 1) * sq * skv));
    for (size_t i = 0; i < values.size();) {
      const size_t run = static_cast<size_t>(uniform(1, 40));
      const uint8_t bit = uniform(0, 1) ? 1 : 0;
      for (size_t j = 0; j < run && i < values.size(); ++j, ++i) values[i] = bit;
    }
    const Mask mask = Mask::Dense(values, heads, sq, skv);
    for (int iter = 0; iter < 600; ++iter) {
      const int64_t head = heads ? uniform(0, heads - 1) : 0;
      const int64_t q_lo = uniform(-5, sq + 2), q_hi = q_lo + uniform(0, 40);
      const int64_t kv_lo = uniform(-5, skv + 2), kv_hi = kv_lo + uniform(0, 40);
      int64_t allowed = 0;
      for (int64_t q = q_lo; q <= q_hi; ++q) {
        for (int64_t kv = kv_lo; kv <= kv_hi; ++kv) allowed += mask.Allowed(head, q, kv);
      }
      const int64_t total = (q_hi - q_lo + 1) * (kv_hi - kv_lo + 1);
      const BlockKind expected = allowed == 0       ? BlockKind::kEmpty
                                 : allowed == total ? BlockKind::kFull
                                                    : BlockKind::kPartial;
      ASSERT_EQ(ClassifyTile(mask, head, q_lo, q_hi, kv_lo, kv_hi), expected)
          << "matrix " << matrix << " [" << sq << ", " << skv << "] head " << head << " q [" << q_lo
          << "," << q_hi << "] kv [" << kv_lo << "," << kv_hi << "]";
    }
  }
}

}  // namespace
}  // namespace ringsplash::mask

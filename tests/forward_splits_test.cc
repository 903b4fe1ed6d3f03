// The forward's split of each q block's kv walk into ranges
// (ForwardKvSplits, flash/schedule.h) on geometries built by hand: the rule
// as schedule.h states it — up to 16 work items with ranges of at least 8
// tiles, and for decoding-shaped calls (one q block of at most micro::kVec
// rows per head) with fewer than 4 (batch, kv head) x ranges items, ranges
// down to 2 tiles until there are 4. Each expectation below is worked out
// from that statement, not read off the code. flash_schedule_test.cc runs
// such splits against the f64 reference on every path and thread count.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "src/kernels/flash/schedule.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {
namespace {

struct Case {
  const char* what;
  int64_t b, sq, h, hkv, nqb, nkvb;
  int64_t splits;
};

Geometry GeometryOf(const Case& c) {
  Geometry g;
  g.b = c.b;
  g.sq = c.sq;
  g.h = c.h;
  g.hkv = c.hkv;
  g.group = c.hkv > 0 ? c.h / c.hkv : 1;
  g.nqb = c.nqb;
  g.nkvb = c.nkvb;
  return g;
}

TEST(ForwardSplitsTest, FollowTheStatedRule) {
  const int64_t v = micro::kVec;
  const std::vector<Case> cases = {
      {"prefill: 256 tasks", 1, 4096, 8, 8, 32, 32, 1},
      {"4 tasks of 2 q blocks, 64 tiles: 16 items", 1, 200, 2, 2, 2, 64, 4},
      {"4 tasks, 12 tiles: not decoding-shaped, no 8-tile ranges", 1, 200, 2, 2, 2, 12, 1},
      {"MQA over 8 tiles: 4 ranges of 2", 1, 1, 8, 1, 1, 8, 4},
      {"MQA over 15 tiles: 4 ranges", 1, 1, 8, 1, 1, 15, 4},
      {"MQA over 16 tiles: 2 ranges of 8 are too few, 4", 1, 1, 8, 1, 1, 16, 4},
      {"MQA over 32 tiles: 4 ranges of 8", 1, 1, 8, 1, 1, 32, 4},
      {"MQA over 256 tiles: 16 ranges", 1, 1, 8, 1, 1, 256, 16},
      {"MQA over 5 tiles: 2 ranges of 2 or more", 1, 1, 8, 1, 1, 5, 2},
      {"MQA over 3 tiles: one range", 1, 1, 8, 1, 1, 3, 1},
      {"MQA over 1 tile", 1, 1, 8, 1, 1, 1, 1},
      {"MQA, batch 2, 8 tiles: 2 ranges make 4 items", 2, 1, 8, 1, 1, 8, 2},
      {"3 kv heads, 8 tiles: 2 ranges make 6 items", 1, 1, 6, 3, 1, 8, 2},
      {"4 kv heads, 8 tiles: 4 items unsplit", 1, 1, 32, 4, 1, 8, 1},
      {"one head, 8 tiles: 4 ranges", 1, 1, 1, 1, 1, 8, 4},
      {"MQA, a vector of rows per head: decoding-shaped", 1, v, 8, 1, 1, 8, 4},
      {"MQA, a row more: 8 tasks, not decoding-shaped", 1, v + 1, 8, 1, 1, 8, 1},
      {"no kv heads (degenerate): no decoding split", 1, 1, 8, 0, 1, 8, 1},
      {"no tasks", 0, 1, 8, 1, 1, 8, 1},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(ForwardKvSplits(GeometryOf(c)), c.splits) << c.what;
  }
}

}  // namespace
}  // namespace ringsplash::kernels

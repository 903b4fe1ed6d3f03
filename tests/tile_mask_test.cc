// TileMask (src/kernels/tiling/tiles.h) keeps the last masks it built under
// their mask::TileShapeKey and hands them out again for tiles with the same
// key. These tests build every partial tile of several maps twice — through
// one long-lived TileMask (reusing) and through a fresh TileMask per tile
// (always building) — and require identical bits and ranges, plus reuse
// exactly where the key says the masks are alike. End results of the flash
// kernels with these masks are checked against the f64 reference in
// flash_kernel_test.cc and property_test.cc.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash {
namespace {

struct Case {
  std::string name;
  Mask mask;
  int64_t h = 2;
  int64_t q_step = 1, kv_step = 1;  // positions first + step * i
  bool explicit_kv = false;         // kv positions not an arithmetic progression
  bool expect_reuse = true;
};

std::vector<int64_t> Positions(int64_t n, int64_t first, int64_t step) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = first + step * i;
  return p;
}

// Builds all partial tiles of the case's map (rows, or columns for the
// backward's dK/dV pass) and compares reused masks with fresh ones.
void CheckCase(const Case& c, bool by_column) {
  const int64_t sq = 200, skv = 230, d = 16;
  Tensor q(DType::kF32, {1, sq, c.h, d}), k(DType::kF32, {1, skv, 1, d}),
      v(DType::kF32, {1, skv, 1, d});
  std::vector<int64_t> q_pos = Positions(sq, 40, c.q_step);
  std::vector<int64_t> kv_pos = Positions(skv, 0, c.kv_step);
  if (c.explicit_kv) kv_pos[7] += 1;  // breaks the progression of kv block 0 only
  kernels::FlashParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.q_pos = q_pos.data();
  p.kv_pos = kv_pos.data();
  p.mask = &c.mask;
  p.blocks = {32, 16};
  p.path = KernelPath::kPortable;
  const kernels::Geometry g = kernels::Geometry::Of(p);
  const kernels::TilePlan plan(p, g, by_column);
  const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(KernelPath::kPortable);
  kernels::TileMask kept;
  kept.Reserve(g);
  const std::string what = c.name + (by_column ? " (columns)" : " (rows)");
  int64_t partial = 0;
  const int64_t rows = by_column ? g.nkvb : g.nqb;
  for (int64_t h = 0; h < c.h; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      for (const mask::BlockRun& run : plan.map().Runs(h, r)) {
        if (run.kind != mask::BlockKind::kPartial) continue;
        for (int64_t x = run.begin; x < run.end; ++x) {
          const int64_t qb = by_column ? x : r, kvb = by_column ? r : x;
          ++partial;
          kept.Fill(plan, mk, run.kind, h, 0, qb, kvb);
          kernels::TileMask fresh;
          fresh.Reserve(g);
          fresh.Fill(plan, mk, run.kind, h, 0, qb, kvb);
          const int64_t m = g.QRows(qb), n = g.KvRows(kvb);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t w = 0; w < kept.ldm(); ++w) {
              ASSERT_EQ(kept.bits()[j * kept.ldm() + w], fresh.bits()[j * fresh.ldm() + w])
                  << what << " head " << h << " tile " << qb << "," << kvb << " key " << j;
            }
            ASSERT_EQ(kept.queries_of_key().lo[j], fresh.queries_of_key().lo[j]) << what;
            ASSERT_EQ(kept.queries_of_key().hi[j], fresh.queries_of_key().hi[j]) << what;
          }
          for (int64_t i = 0; i < m; ++i) {
            ASSERT_EQ(kept.keys_of_query().lo[i], fresh.keys_of_query().lo[i]) << what;
            ASSERT_EQ(kept.keys_of_query().hi[i], fresh.keys_of_query().hi[i]) << what;
          }
        }
      }
    }
  }
  ASSERT_GT(partial, 4) << what << ": the case must have partial tiles to compare";
  EXPECT_EQ(kept.builds() + kept.reuses(), partial) << what;
  if (c.expect_reuse) {
    EXPECT_GT(kept.reuses(), 0) << what;
  } else {
    EXPECT_EQ(kept.reuses(), 0) << what;
  }
}

TEST(TileMaskTest, ReusedMasksEqualFreshOnes) {
  const std::vector<Case> cases = {
      {"causal & window", Mask::Causal() & Mask::Local(40, 0)},
      {"causal with offset", Mask::Causal(-20)},
      {"window | causal", Mask::Local(10, 10) | Mask::Causal(-60)},
      {"per-head windows", Mask::PerHead({Mask::Local(20, 5), Mask::Causal(3)})},
      {"striped positions", Mask::Causal(), 2, 2, 2},
      // Not a function of kv - q alone: chunk boundaries, dense entries.
      {"chunked", Mask::ChunkedCausal(24), 2, 1, 1, false, false},
      {"causal & dense",
       Mask::Causal() & Mask::Dense(std::vector<uint8_t>(260 * 250, 1), 0, 260, 250), 2, 1, 1,
       false, false},
  };
  for (const Case& c : cases) {
    CheckCase(c, /*by_column=*/false);
    CheckCase(c, /*by_column=*/true);
  }
}

// A kv block whose positions are not a progression has no key: its tiles
// are built every time, the others still reused.
TEST(TileMaskTest, ExplicitPositionsAreNeverReused) {
  Case c{"causal, explicit kv block 0", Mask::Causal(-20)};
  c.explicit_kv = true;
  CheckCase(c, /*by_column=*/false);
}

}  // namespace
}  // namespace ringsplash

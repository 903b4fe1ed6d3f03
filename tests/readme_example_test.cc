// The README's "Library in a dozen lines" snippet, compiled and checked against
// the f64 reference, so the front page never shows code that does not work.
#include <gtest/gtest.h>

#include "ringsplash/ringsplash.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

TEST(ReadmeExample, SingleDeviceAndRingMatchTheReference) {
  Rng rng(7);
  // B=1, S=64, H=4, Hkv=2, D=Dv=16: small, but the zigzag ring of 4 gets
  // 2 chunks of 8 rows per rank and the window crosses shard boundaries.
  ProblemSpec spec(1, 64, 64, 4, 2, 16, 16);
  OwnedInputs owned = RandomInputs(rng, spec);
  Tensor out_t(DType::kF32, {1, 64, 4, 16}), lse_t(DType::kF32, {1, 4, 64});
  Tensor ring_out_t(DType::kF32, {1, 64, 4, 16}), ring_lse_t(DType::kF32, {1, 4, 64});
  const TensorView q = owned.q.view(), k = owned.k.view(), v = owned.v.view();
  const TensorView out = out_t.view(), lse = lse_t.view();

  // --- the README snippet (window shrunk to fit the small problem) ---
  AttentionInputs in;
  in.q = q, in.k = k, in.v = v;
  AttentionOptions opt;
  opt.mask = Mask::Parse("causal & local:24,0");  // or Mask::Causal() & Mask::Local(24, 0)
  AttentionForward(in, opt, out, lse);

  RingRun run;
  run.num_ranks = 4;
  run.options.attention = opt;
  RingAttentionThreads(run, in, ring_out_t.view(), ring_lse_t.view());
  // --- end of snippet ---

  const RefResult ref = RunReference(owned, opt, nullptr);
  // f32 kernels accumulate ~64 terms per row in f32 and merge ring steps in
  // f32: errors are a few ulps of O(1) values, far below 1e-5 relative.
  EXPECT_LT(Compare(ToDoubles(out), ref.fwd.out).Relative(kMagnitudeFloor), 1e-5);
  EXPECT_LT(Compare(ToDoubles(ring_out_t.view()), ref.fwd.out).Relative(kMagnitudeFloor), 1e-5);
  EXPECT_LT(Compare(ToDoubles(ring_lse_t.view()), ref.fwd.lse).Relative(1.0), 1e-5);
}

}  // namespace
}  // namespace ringsplash::testing

// The README's snippets ("Library in a dozen lines", the decoding step), compiled and checked
// against the f64 reference, so the front page never shows code that does not work.
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

// The README's decoding snippet: the token at position len - 1 against the
// first len rows of a cache allocated for 64, equal to row len - 1 of the
// whole causal (windowed) forward of the reference.
TEST(ReadmeExample, DecodingStepMatchesTheReference) {
  Rng rng(8);
  ProblemSpec spec(1, 64, 64, 4, 2, 16, 16);
  const OwnedInputs owned = RandomInputs(rng, spec);
  AttentionOptions opt;
  opt.mask = Mask::Parse("causal & local:24,0");
  const RefResult ref = RunReference(owned, opt, nullptr);
  // The cache's buffers and sizes as the snippet names them.
  void* const k_cache = owned.k.data();
  void* const v_cache = owned.v.data();
  const int64_t B = 1, max_len = 64, Hkv = 2, D = 16, Dv = 16;
  for (const int64_t len : {1, 17, 40, 64}) {
    const TensorView q_new = owned.q.view().Narrowed(1, len - 1, 1);  // row len - 1 of q
    Tensor out_t(DType::kF32, {1, 1, 4, 16}), lse_t(DType::kF32, {1, 4, 1});
    const TensorView out_new = out_t.view(), lse_new = lse_t.view();

    // --- the README snippet ---
    // k_cache [B, max_len, Hkv, D], v_cache [B, max_len, Hkv, Dv]: your f32 buffers.
    AttentionInputs step;
    step.q = q_new;  // [B, 1, H, D]
    step.k = TensorView::KvCache(k_cache, DType::kF32, B, max_len, Hkv, D, len);
    step.v = TensorView::KvCache(v_cache, DType::kF32, B, max_len, Hkv, Dv, len);
    step.q_positions = {len - 1};                   // the token's position: causal sees the cache
    AttentionForward(step, opt, out_new, lse_new);  // out_new [B,1,H,Dv], lse_new [B,H,1]
    // --- end of snippet ---

    std::vector<double> want_out, want_lse;
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t c = 0; c < 16; ++c)
        want_out.push_back(ref.fwd.out[((len - 1) * 4 + h) * 16 + c]);
      want_lse.push_back(ref.fwd.lse[h * 64 + (len - 1)]);
    }
    // As above: a few ulps of O(1) values over <= 25 keys.
    EXPECT_LT(Compare(ToDoubles(out_new), want_out).Relative(kMagnitudeFloor), 1e-5) << len;
    EXPECT_LT(Compare(ToDoubles(lse_new), want_lse).Relative(1.0), 1e-5) << len;
  }
}

}  // namespace
}  // namespace ringsplash::testing

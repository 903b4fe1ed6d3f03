// Focused tests of the flash kernels (FlashForward / FlashBackward called
// directly) and the KernelPath functions (the micro-kernels themselves:
// micro_kernel_test.cc). Every numeric
// check compares against the f64 reference (tests/support/reference.h) or
// against another run of the same kernel where the claim is invariance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "src/kernels/combine.h"
#include "src/kernels/decode/stacked_heads.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/merge.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/thread_pool.h"
#include "src/kernels/tiling/tiles.h"
#include "tests/support/accuracy.h"
#include "tests/support/flash_problem.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using kernels::FlashParams;
using kernels::ThreadPool;
using testing::BitwiseEqual;
using testing::CheckAgainstReference;
using testing::Compare;
using testing::ExpectClose;
using testing::ExpectGradients;
using testing::Iota;
using testing::kF32Tol;
using testing::OwnedInputs;
using testing::Problem;
using testing::ProblemSpec;
using testing::Result;
using testing::Rng;
using testing::RoundsP;
using testing::RunConfig;
using testing::Shape;
using testing::SpecOf;
using testing::ToDoubleVec;

// --- KernelPath functions ---------------------------------------------------

TEST(KernelPathTest, NamesRoundTripAndBadNamesThrow) {
  for (KernelPath p : {KernelPath::kAuto, KernelPath::kPortable, KernelPath::kAvx2,
                       KernelPath::kAvx512, KernelPath::kAvx512Bf16, KernelPath::kAmx}) {
    EXPECT_EQ(ParseKernelPath(KernelPathName(p)), p);
  }
  EXPECT_THROW(ParseKernelPath("avx"), Error);
  EXPECT_THROW(ParseKernelPath("AVX2"), Error);
  EXPECT_THROW(ParseKernelPath(""), Error);
}

// What kAuto must pick on a CPU with features f: amx where usable,
// avx512_bf16 only where bf16 dot products are fast, else avx512, else avx2.
KernelPath ExpectedAutoPath(const kernels::CpuFeatures& f) {
  if (f.amx) return KernelPath::kAmx;
  if (f.avx512_bf16 && f.fast_bf16_dot) return KernelPath::kAvx512Bf16;
  if (f.avx512) return KernelPath::kAvx512;
  if (f.avx2) return KernelPath::kAvx2;
  return KernelPath::kPortable;
}

TEST(KernelPathTest, SupportedAndResolve) {
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), KernelPath::kPortable);
  const auto& f = kernels::DetectCpuFeatures();
  EXPECT_EQ(paths.size(), 1u + (f.avx2 ? 1u : 0u) + (f.avx512 ? 1u : 0u) +
                              (f.avx512_bf16 ? 1u : 0u) + (f.amx ? 1u : 0u));
  for (KernelPath p : paths) EXPECT_EQ(ResolveKernelPath(p), p);
  if (!f.avx2) {
    EXPECT_THROW(ResolveKernelPath(KernelPath::kAvx2), Error);
  }
  if (!f.avx512) {
    EXPECT_THROW(ResolveKernelPath(KernelPath::kAvx512), Error);
  }
  if (!f.avx512_bf16) {
    EXPECT_THROW(ResolveKernelPath(KernelPath::kAvx512Bf16), Error);
  }
  if (!f.amx) {
    EXPECT_THROW(ResolveKernelPath(KernelPath::kAmx), Error);
  }

  unsetenv("RINGSPLASH_KERNEL");
  EXPECT_EQ(ResolveKernelPath(KernelPath::kAuto), ExpectedAutoPath(f));
  setenv("RINGSPLASH_KERNEL", "portable", 1);
  EXPECT_EQ(ResolveKernelPath(KernelPath::kAuto), KernelPath::kPortable);
  // The environment only overrides kAuto.
  EXPECT_EQ(ResolveKernelPath(paths.back()), paths.back());
  setenv("RINGSPLASH_KERNEL", "fastest", 1);
  EXPECT_THROW(ResolveKernelPath(KernelPath::kAuto), Error);
  if (!f.avx512) {
    setenv("RINGSPLASH_KERNEL", "avx512", 1);
    EXPECT_THROW(ResolveKernelPath(KernelPath::kAuto), Error);
  }
  unsetenv("RINGSPLASH_KERNEL");
}

// Every CPU this library may meet, as far as this one can play it (a
// feature set can only be hidden, ScopedCpuFeaturesForTesting): the paths
// it supports, the one kAuto picks (amx, avx512_bf16 only where its dot
// products are fast, avx512, avx2, portable), and the refusal of every
// other path, requested directly or through RINGSPLASH_KERNEL.
TEST(KernelPathTest, ResolutionOnEveryCpuThisOneCanPlay) {
  unsetenv("RINGSPLASH_KERNEL");
  const kernels::CpuFeatures real = kernels::DetectCpuFeatures();
  struct Cpu {
    const char* name;
    kernels::CpuFeatures f;
  };
  const Cpu cpus[] = {
      {"no SIMD", {}},
      {"AVX2 only", {.avx2 = true}},
      {"AVX-512", {.avx2 = true, .avx512 = true}},
      {"AVX-512 BF16, slow dot (Intel)",
       {.avx2 = true, .avx512 = true, .avx512_bf16 = true, .fast_bf16_dot = false}},
      {"AVX-512 BF16, fast dot (AMD)",
       {.avx2 = true, .avx512 = true, .avx512_bf16 = true, .fast_bf16_dot = true}},
      {"AMX", {.avx2 = true, .avx512 = true, .avx512_bf16 = true, .amx = true}},
  };
  for (const Cpu& cpu : cpus) {
    const kernels::ScopedCpuFeaturesForTesting as(cpu.f);
    const kernels::CpuFeatures& f = kernels::DetectCpuFeatures();
    SCOPED_TRACE(cpu.name);
    // Only hidden, never added.
    EXPECT_TRUE(!f.avx512 || real.avx512);
    EXPECT_TRUE(!f.amx || real.amx);
    std::vector<KernelPath> expected = {KernelPath::kPortable};
    if (f.avx2) expected.push_back(KernelPath::kAvx2);
    if (f.avx512) expected.push_back(KernelPath::kAvx512);
    if (f.avx512_bf16) expected.push_back(KernelPath::kAvx512Bf16);
    if (f.amx) expected.push_back(KernelPath::kAmx);
    EXPECT_EQ(SupportedKernelPaths(), expected);
    EXPECT_EQ(ResolveKernelPath(KernelPath::kAuto), ExpectedAutoPath(f));
    for (KernelPath p : {KernelPath::kPortable, KernelPath::kAvx2, KernelPath::kAvx512,
                         KernelPath::kAvx512Bf16, KernelPath::kAmx}) {
      const bool ok = std::find(expected.begin(), expected.end(), p) != expected.end();
      if (ok) {
        EXPECT_EQ(ResolveKernelPath(p), p);
        continue;
      }
      EXPECT_THROW(ResolveKernelPath(p), Error) << KernelPathName(p);
      setenv("RINGSPLASH_KERNEL", KernelPathName(p), 1);
      try {
        ResolveKernelPath(KernelPath::kAuto);
        ADD_FAILURE() << "RINGSPLASH_KERNEL=" << KernelPathName(p) << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("RINGSPLASH_KERNEL: kernel path '"), std::string::npos)
            << e.what();
      }
      unsetenv("RINGSPLASH_KERNEL");
    }
  }
}

// --- FlashForward / FlashBackward against the f64 reference -------------------

TEST(FlashTest, HeadDimsAndRaggedShapesOnEveryPath) {
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, 1, 1},     {1, 37, 53, 2, 1, 16, 16},   {2, 45, 29, 2, 2, 64, 64},
      {1, 50, 70, 4, 2, 80, 80}, {1, 33, 40, 2, 2, 128, 128}, {1, 20, 24, 1, 1, 256, 256},
      {1, 40, 33, 2, 1, 64, 1},  {1, 17, 70, 3, 3, 16, 80},
  };
  uint64_t seed = 10;
  for (KernelPath path : SupportedKernelPaths()) {
    for (const Shape& sh : shapes) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = Mask::Causal();
        CheckAgainstReference(sh, dtype, s, /*segments=*/false, ++seed);
      }
    }
  }
}

// The paths that round P to bf16 for P V (avx512_bf16 and amx with bf16
// inputs) are held
// elsewhere to a worst-case bound of 2^-8 max|v| on every element, loose
// enough that a key dropped or counted twice by their tile loops (32-key
// steps, V pairs, padding) could pass. With q = k = 0 every logit is 0, so
// P = 1 before normalisation, exact in bf16: out_i is the mean of v over the
// keys row i may see with only f32 rounding, held to the f32 tolerance,
// where one key more or less moves it by ~|v_j - out_i| / 600 (>= 1e-4 of
// max|out| for most keys). Under the full mask the backward's P = 1/512 is
// exact in bf16 too, so dV = P^T dO is held to the f32 tolerance as well.
TEST(FlashTest, ExactProbabilitiesLeaveOnlyF32ErrorOnRoundingPaths) {
  int checked = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    if (!RoundsP(path)) continue;
    for (const Mask& mask : {Mask::Full(), Mask::Causal(600 - 64)}) {
      // Sq = 64 against Skv = 512 (full) and 600 (causal, bottom-right
      // aligned: rows see 537 to 600 keys); Dv = 48 pads the V pairs.
      const int64_t skv = mask.ToString() == "full" ? 512 : 600;
      ProblemSpec spec(1, 64, skv, 2, 1, 32, 48);
      spec.dtype = DType::kBF16;
      spec.qk_range = 0.0;
      Problem prob(760 + static_cast<uint64_t>(skv), spec);
      RunConfig s;
      s.path = path;
      s.mask = mask;
      s.blocks = {64, 128};
      const testing::RefProblem rp = prob.Ref(s);
      const testing::RefForward ref = testing::ReferenceForward(rp);
      const Result r = prob.Run(s, /*backward=*/true, &ref);
      const std::string what = std::string(KernelPathName(path)) + " " + mask.ToString();
      ExpectClose(r.out, ref.out, kF32Tol, "out " + what);
      ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
      if (skv == 512) {
        const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
        ExpectClose(r.dv, g.dv, kF32Tol, "dv " + what);
      }
      ++checked;
    }
  }
  if (checked == 0) GTEST_SKIP() << "no kernel path here rounds P to bf16";
}

TEST(FlashTest, MasksGqaAndBlockShapes) {
  const std::vector<Mask> masks = {Mask::Full(), Mask::Causal(7), Mask::Local(5, 9),
                                   Mask::ChunkedCausal(24),
                                   Mask::Causal() & Mask::Local(20, std::nullopt)};
  uint64_t seed = 100;
  for (KernelPath path : SupportedKernelPaths()) {
    for (const Mask& mask : masks) {
      RunConfig s;
      s.path = path;
      s.mask = mask;
      // bf16 too: kv blocks of 48 keys (not whole 32-key k steps of the
      // bf16 P V) on the avx512_bf16 and amx paths.
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        s.blocks = {16, 48};
        CheckAgainstReference({2, 70, 90, 4, 2, 32, 48}, dtype, s, false, ++seed);
        s.blocks = {64, 16};
        CheckAgainstReference({1, 70, 90, 6, 1, 24, 16}, dtype, s, true, ++seed);
      }
    }
    // Head dims whose bf16 pairs leave a vdpbf16ps remainder after whole
    // 16-pair AMX steps (D = 48: 24 pairs, Dv = 80: 40), forward and
    // backward. (Full mask: some masks above give exactly zero dq, which a
    // relative check cannot take.)
    RunConfig s;
    s.path = path;
    s.blocks = {32, 48};
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      CheckAgainstReference({1, 70, 90, 4, 2, 48, 80}, dtype, s, true, ++seed);
    }
  }
}

// Whether FlashForward on an f32 product path reads the K and V of `prob`
// through per-thread tile copies (KvTileCache): bf16 rows, f32 rows strided
// by other heads, or V rows of 512 bytes and more, in tiles used too rarely
// for a copy per call.
bool UsesTileCopies(const FlashParams& p) {
  const kernels::Geometry g = kernels::Geometry::Of(p);
  const kernels::TilePlan plan(p, g, /*by_column=*/false);
  ThreadPool pool(1);
  return kernels::KvRows(p, g, kernels::KvRows::KeyFormat::kF32, plan.UsesPerKvTile(), pool,
                         /*tile_cache=*/true)
      .tile_cache();
}

// Dense f32 K/V rows (one kv head) whose V rows are 512 bytes, which a tile
// used often copies per thread (L1 set aliasing): a decoding step — stacked
// where no decoding kernel takes it (UseDecodeStep; the stacked problem is
// built here directly), each tile used once — reads them in place instead (a
// copy would be a whole extra pass over K and V); the same rows under eight
// query rows per head, unstacked, are used four times per tile and copied.
// Both against the reference.
TEST(FlashTest, DecodingReadsDenseRowsInPlace) {
  RunConfig s;
  s.blocks = {16, 16};
  s.mask = Mask::Causal();
  const Shape decode{1, 1, 400, 4, 1, 32, 128};
  Problem prob(1400, SpecOf(decode));
  ThreadPool pool(1);
  const kernels::StackedHeads stacked(prob.Params(s), pool);
  EXPECT_FALSE(UsesTileCopies(stacked.params()));
  CheckAgainstReference(decode, DType::kF32, s, false, 1401, /*backward=*/false,
                        /*q_offset=*/399);
  const Shape prefill{1, 16, 400, 4, 1, 32, 128};
  Problem many(1402, SpecOf(prefill));
  RunConfig full = s;
  full.mask = Mask::Full();  // every tile for each of the 4 heads
  EXPECT_TRUE(UsesTileCopies(many.Params(full)));
  CheckAgainstReference(prefill, DType::kF32, s, false, 1403, /*backward=*/false,
                        /*q_offset=*/384);
}

// Sliding windows over [B, S, H, D] tensors: K and V tiles are copied per
// thread as tasks use them (bf16 rows widened to f32 in the copy on the f32
// product paths), tasks run in runs of neighbouring q blocks. The result
// matches the reference and does not depend on the thread count (which
// thread copied which tile).
TEST(FlashTest, WindowTileCopiesMatchReferenceOnAnyThreadCount) {
  uint64_t seed = 250;
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const Shape sh{2, 300, 300, 4, 2, 64, 48};
      RunConfig s;
      s.path = path;
      s.mask = Mask::Causal() & Mask::Local(40, std::nullopt);
      s.blocks = {32, 16};
      ProblemSpec spec = SpecOf(sh);
      spec.dtype = dtype;
      Problem prob(++seed, spec);
      // bf16 on a path with bf16 products reads K in place and V from the
      // tensor instead (no f32 tiles to copy).
      const bool f32_products =
          dtype == DType::kF32 || kernels::micro::MicroKernelsFor(path).gemm_bf16 == nullptr;
      if (f32_products) {
        ASSERT_TRUE(UsesTileCopies(prob.Params(s))) << DTypeName(dtype);
      }
      CheckAgainstReference(sh, dtype, s, /*segments=*/false, seed, /*backward=*/false);
      s.threads = 1;
      const Result r1 = prob.Run(s, false);
      for (int threads : {2, 3}) {
        s.threads = threads;
        const Result rn = prob.Run(s, false);
        EXPECT_TRUE(BitwiseEqual(r1, rn)) << threads << " " << DTypeName(dtype);
      }
    }
  }
}

// One thread runs these calls in turn, so its tile copies outlive each call:
// two shapes whose copies have the same size but split it differently
// between K and V (once read with the previous call's split), and a q block
// that uses more tiles than the cache has slots (least recently used
// copies are replaced while the block runs).
TEST(FlashTest, TileCopiesAcrossShapesAndEvictions) {
  struct Case {
    Shape shape;
    BlockSizes blocks;
  };
  const std::vector<Case> cases = {
      {{1, 40, 96, 2, 2, 16, 32}, {32, 32}},      // copies of 32 x (16 + 32) floats
      {{1, 40, 96, 2, 2, 16, 16}, {32, 48}},      // 48 x (16 + 16): same size
      {{1, 16, 4096, 2, 1, 128, 128}, {16, 16}},  // 256 tiles for one q block
  };
  uint64_t seed = 270;
  for (const Case& c : cases) {
    RunConfig s;
    s.path = SupportedKernelPaths().back();
    s.mask = Mask::Full();
    s.blocks = c.blocks;
    s.threads = 1;
    ASSERT_TRUE(UsesTileCopies(Problem(++seed, SpecOf(c.shape)).Params(s)));
    CheckAgainstReference(c.shape, DType::kF32, s, /*segments=*/false, seed, /*backward=*/false);
  }
}

// The backward packs the q side (Q^T, dO^T, Q, dO) per thread when every kv
// tile needs few q tiles (a window: 3 of 19 q blocks here), else once per
// call (a full mask over 19 q blocks: more than the per-thread copies hold).
// The forward computes q blocks in groups sharing each kv tile (4 per group
// on one thread here, 2 on two, 1 on three). All match the reference and give
// the same bits on 1, 2 and 3 threads (one- and two-pass backward schedules).
TEST(FlashTest, QBlockGroupsAndQTileCopiesOnAnyThreadCount) {
  uint64_t seed = 290;
  for (KernelPath path : SupportedKernelPaths()) {
    for (const Mask& mask : {Mask::Causal() & Mask::Local(20, 0), Mask::Full()}) {
      const Shape sh{1, 300, 300, 4, 2, 64, 48};
      RunConfig s;
      s.path = path;
      s.mask = mask;
      s.blocks = {16, 16};
      CheckAgainstReference(sh, DType::kF32, s, /*segments=*/false, ++seed);
      Problem prob(seed, SpecOf(sh));
      s.threads = 1;
      const Result r1 = prob.Run(s, true);
      for (int threads : {2, 3}) {
        s.threads = threads;
        const Result rn = prob.Run(s, true);
        EXPECT_TRUE(BitwiseEqual(r1, rn)) << threads;
      }
    }
  }
}

TEST(FlashTest, SoftCapWithHugeLogits) {
  uint64_t seed = 200;
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      ProblemSpec spec(1, 40, 50, 2, 1, 64, 64);
      spec.dtype = dtype;
      spec.qk_range = 12.0;  // |s| up to 144^2 * 64 / 8: logits ~1e3 before the cap
      Problem prob(++seed, spec);
      RunConfig s;
      s.path = path;
      s.softcap = 20.0f;
      s.mask = Mask::Causal();
      const testing::RefProblem rp = prob.Ref(s);
      const testing::RefForward ref = testing::ReferenceForward(rp);
      const Result r = prob.Run(s, true, &ref);
      const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
      double out_tol = kF32Tol;
      if (dtype == DType::kBF16 && RoundsP(path)) {
        out_tol = 2 * kF32Tol + testing::PRoundingSlack(rp.v, ref.out);
      }
      const std::string what = std::string(KernelPathName(path)) + " " + DTypeName(dtype);
      ExpectClose(r.out, ref.out, out_tol, "out " + what);
      ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
      // Gradients through the cap scale with |q|,|k| ~ 12, whose f32 logits
      // carry absolute error ~|s| 2^-24 ~ 1e-4 before the cap damps them: 1e-4.
      ExpectGradients(r, g, path, dtype, 1e-4, what, kF32Tol);
    }
  }
}

TEST(FlashTest, SegmentsWithQueryDocumentThatHasNoKeys) {
  for (KernelPath path : SupportedKernelPaths()) {
    ProblemSpec spec(2, 48, 48, 2, 1, 16, 16);
    Problem prob(300, spec);
    OwnedInputs& o = prob.owned();
    o.q_seg = Tensor(DType::kI32, {2, 48});
    o.kv_seg = Tensor(DType::kI32, {2, 48});
    int32_t* qs = o.q_seg.data_as<int32_t>();
    int32_t* ks = o.kv_seg.data_as<int32_t>();
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < 48; ++i) {
        // q: docs 1 | 7 | 2; kv: docs 1 | 2. Document 7 has no keys at all.
        qs[b * 48 + i] = i < 10 ? 1 : i < 30 ? 7 : 2;
        ks[b * 48 + i] = i < 20 ? 1 : 2;
      }
    }
    prob.Refresh();
    RunConfig s;
    s.path = path;
    s.blocks = {16, 16};
    s.mask = Mask::Full();
    const testing::RefProblem rp = prob.Ref(s);
    const testing::RefForward ref = testing::ReferenceForward(rp);
    const Result r = prob.Run(s, true, &ref);
    const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
    ExpectClose(r.out, ref.out, kF32Tol, "out");
    ExpectClose(r.lse, ref.lse, kF32Tol, "lse");
    ExpectClose(r.dq, g.dq, kF32Tol, "dq");
    ExpectClose(r.dk, g.dk, kF32Tol, "dk");
    ExpectClose(r.dv, g.dv, kF32Tol, "dv");
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t i = 10; i < 30; ++i) {
          EXPECT_EQ(r.lse[(b * 2 + h) * 48 + i], -std::numeric_limits<float>::infinity());
          for (int64_t c = 0; c < 16; ++c) {
            EXPECT_EQ(r.out[((b * 48 + i) * 2 + h) * 16 + c], 0.0f);
            EXPECT_EQ(r.dq[((b * 48 + i) * 2 + h) * 16 + c], 0.0f);
          }
        }
      }
    }
    for (const auto* v : {&r.out, &r.dq, &r.dk, &r.dv}) {
      for (float x : *v) ASSERT_FALSE(std::isnan(x));
    }
  }
}

TEST(FlashTest, StridedBhsdViewsAndF16Inputs) {
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
      ProblemSpec spec(2, 35, 41, 4, 2, 40, 24);
      spec.dtype = dtype;
      spec.bhsd = true;
      Problem prob(400, spec);
      RunConfig s;
      s.path = path;
      s.mask = Mask::Local(10, 3);
      const testing::RefProblem rp = prob.Ref(s);
      const testing::RefForward ref = testing::ReferenceForward(rp);
      const Result r = prob.Run(s, true, &ref);
      const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
      double out_tol = kF32Tol;
      if (dtype == DType::kBF16 && RoundsP(path)) {
        out_tol = 2 * kF32Tol + testing::PRoundingSlack(rp.v, ref.out);
      }
      const std::string what = std::string(KernelPathName(path)) + " " + DTypeName(dtype);
      ExpectClose(r.out, ref.out, out_tol, "out " + what);
      ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
      ExpectGradients(r, g, path, dtype, kF32Tol, what);
    }
  }
}

// FlashForwardBf16Out (the API's bf16 out without an f32 copy): its rows
// equal FlashForward's f32 rows rounded to bf16, bit for bit, with the same
// lse, on every path, for f32 and bf16 inputs, ragged shapes and rows
// without keys; it writes nothing past out. Also into a padded [B, H, Sq,
// Dv] layout with sinks, where it must equal FlashForward then ApplySinks
// (the f32 path of AttentionForward), rounded, and leave the padding alone;
// and with no keys at all. A finite value beyond bf16's range (reachable
// only from f32 inputs: bf16 v bounds out) is reported, not stored as an
// infinity.
TEST(FlashTest, Bf16OutEqualsRoundedF32OutAndReportsOverflow) {
  constexpr uint16_t kCanary = 0xABCD;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> sinks = {0.5f, -2.0f, 3.0f, -inf};  // [H]; -inf: no sink
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (const bool bhsd : {false, true}) {
        // Sq = 7: stacked query heads (decode/stacked_heads.h), sinks by head too.
        for (const int64_t sq : {37, 7}) {
          ProblemSpec spec(2, sq, 53, 4, 2, 32, 24);
          spec.dtype = dtype;
          Problem prob(600, spec);
          RunConfig s;
          s.path = path;
          s.mask = Mask::Causal(-5);  // the first five rows see no key
          FlashParams p = prob.Params(s);
          ThreadPool pool(2);
          const int64_t n = spec.b * spec.sq * spec.h * spec.dv;
          const auto rows = static_cast<size_t>(spec.b * spec.h * spec.sq);
          std::vector<float> out(static_cast<size_t>(n)), lse(rows), lse_bf(rows);
          kernels::Bf16Out direct;
          std::vector<uint16_t> bf;
          const int64_t ld = bhsd ? spec.dv + 3 : spec.dv;  // bhsd: rows padded by 3
          if (bhsd) {
            direct.stride[0] = spec.h * spec.sq * ld;
            direct.stride[1] = ld;
            direct.stride[2] = spec.sq * ld;
            direct.sinks = sinks.data();
            bf.assign(static_cast<size_t>(spec.b * spec.h * spec.sq * ld + 16), kCanary);
          } else {
            direct.stride[0] = spec.sq * spec.h * spec.dv;
            direct.stride[1] = spec.h * spec.dv;
            direct.stride[2] = spec.dv;
            bf.assign(static_cast<size_t>(n + 16), kCanary);
          }
          direct.data = bf.data();
          for (const bool empty : {false, true}) {
            if (empty && !bhsd) continue;
            if (empty) {  // no keys at all: every row's denominator is its sink
              p.k.shape[1] = 0;
              p.v.shape[1] = 0;
            }
            kernels::FlashForward(p, pool, out.data(), lse.data(), nullptr);
            if (bhsd) {
              kernels::ApplySinks({spec.b, spec.sq, spec.h, spec.dv}, out.data(), lse.data(),
                                  sinks.data());
            }
            ASSERT_TRUE(kernels::FlashForwardBf16Out(p, pool, direct, lse_bf.data(), nullptr));
            const std::string what = std::string(KernelPathName(path)) + " " + DTypeName(dtype) +
                                     " sq " + std::to_string(sq) +
                                     (bhsd ? " bhsd with sinks" : "") + (empty ? " no keys" : "");
            std::vector<bool> written(bf.size(), false);
            for (int64_t b = 0; b < spec.b; ++b) {
              for (int64_t i = 0; i < spec.sq; ++i) {
                for (int64_t h = 0; h < spec.h; ++h) {
                  for (int64_t c = 0; c < spec.dv; ++c) {
                    const int64_t at =
                        b * direct.stride[0] + i * direct.stride[1] + h * direct.stride[2] + c;
                    const float want =
                        out[static_cast<size_t>(((b * spec.sq + i) * spec.h + h) * spec.dv + c)];
                    ASSERT_EQ(bf[static_cast<size_t>(at)], F32ToBF16(want))
                        << what << " b " << b << " i " << i << " h " << h << " c " << c;
                    written[static_cast<size_t>(at)] = true;
                  }
                }
              }
            }
            for (size_t i = 0; i < bf.size(); ++i) {
              if (!written[i]) {
                ASSERT_EQ(bf[i], kCanary) << what << " padding or past out, " << i;
              }
            }
            EXPECT_EQ(std::memcmp(lse.data(), lse_bf.data(), rows * sizeof(float)), 0) << what;
          }
        }
      }
    }
  }
  ProblemSpec spec(1, 4, 1, 1, 1, 16, 16);  // one key: out = v exactly
  Problem prob(601, spec);
  StoreFromF32(prob.owned().v.view(), 5, 3.4e38f);  // finite in f32, beyond bf16
  prob.Refresh();
  ThreadPool pool(1);
  std::vector<uint16_t> bf(16 * 4);
  std::vector<float> lse(4);
  const kernels::Bf16Out direct{.data = bf.data(), .stride = {64, 16, 16}, .sinks = nullptr};
  EXPECT_FALSE(
      kernels::FlashForwardBf16Out(prob.Params(RunConfig{}), pool, direct, lse.data(), nullptr));
}

TEST(FlashTest, ShiftedGlobalPositionsAndEmptyKv) {
  // A ring step: q holds global rows 64..95, kv rows 0..47 under a causal
  // mask with a window, so some q rows see nothing.
  ProblemSpec spec(1, 32, 48, 2, 2, 16, 16);
  Problem prob(500, spec);
  prob.owned().q_pos.resize(32);
  prob.owned().kv_pos.resize(48);
  std::iota(prob.owned().q_pos.begin(), prob.owned().q_pos.end(), 64);
  std::iota(prob.owned().kv_pos.begin(), prob.owned().kv_pos.end(), 0);
  prob.Refresh();
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.blocks = {16, 16};
    s.mask = Mask::Causal() & Mask::Local(30, std::nullopt);
    const testing::RefProblem rp = prob.Ref(s);
    const testing::RefForward ref = testing::ReferenceForward(rp);
    const Result r = prob.Run(s, true, &ref);
    const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
    ExpectClose(r.out, ref.out, kF32Tol, "out");
    ExpectClose(r.lse, ref.lse, kF32Tol, "lse");
    ExpectClose(r.dq, g.dq, kF32Tol, "dq");
    ExpectClose(r.dk, g.dk, kF32Tol, "dk");
    ExpectClose(r.dv, g.dv, kF32Tol, "dv");
  }
  // Skv = 0: every row is empty.
  ProblemSpec empty = spec;
  empty.skv = 0;
  Problem e(501, empty);
  const Result r = e.Run(RunConfig{}, true);
  for (float x : r.out) EXPECT_EQ(x, 0.0f);
  for (float x : r.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (float x : r.dq) EXPECT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace ringsplash

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
#include "src/kernels/cpu_features.h"
#include "src/kernels/flash.h"
#include "src/kernels/flash_common.h"
#include "src/kernels/flash_merge.h"
#include "src/kernels/micro.h"
#include "src/kernels/thread_pool.h"
#include "tests/support/accuracy.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using kernels::FlashParams;
using kernels::ThreadPool;
using testing::Compare;
using testing::OwnedInputs;
using testing::ProblemSpec;
using testing::Rng;

// f32 tolerance, relative to the largest expected magnitude of a tensor. The
// kernels accumulate in f32 over at most a few hundred terms (D <= 256, Skv
// <= ~300 here); the f64 reference is exact to ~1e-16. Rounding of inputs of
// O(1) gives errors ~ sqrt(terms) * 2^-24 ~ 1e-6 of the largest magnitude, and
// the vectorised exp/tanh add ~1e-7 relative. 1e-5 leaves a 10x margin while
// still catching any real bug (a wrong mask entry or a dropped tile moves
// results by > 1e-2).
constexpr double kF32Tol = 1e-5;

std::vector<double> ToDoubleVec(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

struct RunConfig {
  Mask mask;
  float softcap = 0.0f;
  BlockSizes blocks{32, 32};
  KernelPath path = KernelPath::kPortable;
  int threads = 2;
};

// Kernel outputs of one forward (+ backward) run.
struct Result {
  std::vector<float> out, lse;  // [B, Sq, H, Dv], [B, H, Sq]
  std::vector<float> dq, dk, dv;
  KernelStats fwd_stats, bwd_stats;
};

// Whether two runs wrote bitwise identical outputs (and gradients, where
// they ran the backward); names the first array that differs.
::testing::AssertionResult BitwiseEqual(const Result& a, const Result& b) {
  const struct {
    const char* name;
    const std::vector<float>& x;
    const std::vector<float>& y;
  } arrays[] = {{"out", a.out, b.out},
                {"lse", a.lse, b.lse},
                {"dq", a.dq, b.dq},
                {"dk", a.dk, b.dk},
                {"dv", a.dv, b.dv}};
  for (const auto& arr : arrays) {
    if (arr.x.size() != arr.y.size() ||
        (!arr.x.empty() &&
         std::memcmp(arr.x.data(), arr.y.data(), arr.x.size() * sizeof(float)) != 0)) {
      return ::testing::AssertionFailure() << arr.name << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

class Problem {
 public:
  Problem(uint64_t seed, const ProblemSpec& spec) : rng_(seed), spec_(spec) {
    owned_ = testing::RandomInputs(rng_, spec);
    in_ = owned_.inputs();
    q_pos_ = in_.q_positions.empty() ? Iota(spec.sq) : in_.q_positions;
    kv_pos_ = in_.kv_positions.empty() ? Iota(spec.skv) : in_.kv_positions;
    scale_ = 1.0f / std::sqrt(static_cast<float>(spec.d));
    // dout in the inputs' dtype: with bf16 q, k, v and dout the amx path
    // runs all five of the backward's products on tiles (flash_backward.cc).
    dout_ = testing::RandomTensor(rng_, spec.dtype, {spec.b, spec.sq, spec.h, spec.dv});
  }

  OwnedInputs& owned() { return owned_; }
  const ProblemSpec& spec() const { return spec_; }
  // Call after changing owned() (e.g. segments, positions).
  void Refresh() {
    in_ = owned_.inputs();
    if (!owned_.q_pos.empty()) q_pos_ = owned_.q_pos;
    if (!owned_.kv_pos.empty()) kv_pos_ = owned_.kv_pos;
    in_.q_positions = q_pos_;
    in_.kv_positions = kv_pos_;
  }

  testing::RefProblem Ref(const RunConfig& s) const {
    AttentionOptions opt;
    opt.mask = s.mask;
    opt.scale = scale_;
    if (s.softcap > 0) opt.softcap = s.softcap;
    AttentionInputs in = in_;
    in.sinks = TensorView();
    in.q_positions = q_pos_;
    in.kv_positions = kv_pos_;
    return testing::MakeRefProblem(in, opt);
  }
  std::vector<double> Dout() const { return testing::ToDoubles(dout_.view()); }

  FlashParams Params(const RunConfig& s) const {
    FlashParams p;
    p.q = in_.q;
    p.k = in_.k;
    p.v = in_.v;
    p.q_segments = in_.q_segments;
    p.kv_segments = in_.kv_segments;
    p.q_pos = q_pos_.data();
    p.kv_pos = kv_pos_.data();
    p.mask = &s.mask;
    p.scale = scale_;
    p.softcap = s.softcap;
    p.blocks = s.blocks;
    p.path = s.path;
    return p;
  }

  // Forward; with `backward` also the backward, fed the reference's f32-rounded
  // lse and delta so its check isolates the backward kernel.
  Result Run(const RunConfig& s, bool backward, const testing::RefForward* ref = nullptr) const {
    const ProblemSpec& sp = spec_;
    Result r;
    r.out.assign(static_cast<size_t>(sp.b * sp.sq * sp.h * sp.dv), -7.0f);
    r.lse.assign(static_cast<size_t>(sp.b * sp.h * sp.sq), -7.0f);
    ThreadPool pool(s.threads);
    const FlashParams p = Params(s);
    kernels::FlashForward(p, pool, r.out.data(), r.lse.data(), &r.fwd_stats);
    if (!backward) return r;
    std::vector<float> lse(r.lse), delta(r.lse.size(), 0.0f);
    const std::vector<double> dout = Dout();
    for (int64_t b = 0; b < sp.b; ++b) {
      for (int64_t h = 0; h < sp.h; ++h) {
        for (int64_t i = 0; i < sp.sq; ++i) {
          const int64_t row = (b * sp.h + h) * sp.sq + i;
          double dl = 0;
          for (int64_t c = 0; c < sp.dv; ++c) {
            const int64_t o = ((b * sp.sq + i) * sp.h + h) * sp.dv + c;
            dl += dout[o] * (ref != nullptr ? ref->out[o] : r.out[o]);
          }
          delta[row] = static_cast<float>(dl);
          if (ref != nullptr) lse[row] = static_cast<float>(ref->lse[row]);
        }
      }
    }
    // Non-zero initial accumulators check that the kernel adds (+=).
    r.dq.assign(static_cast<size_t>(sp.b * sp.sq * sp.h * sp.d), 0.5f);
    r.dk.assign(static_cast<size_t>(sp.b * sp.skv * sp.hkv * sp.d), 0.5f);
    r.dv.assign(static_cast<size_t>(sp.b * sp.skv * sp.hkv * sp.dv), 0.5f);
    kernels::FlashBackward(p, pool, dout_.view(), lse.data(), delta.data(), r.dq.data(),
                           r.dk.data(), r.dv.data(), &r.bwd_stats);
    for (auto* vec : {&r.dq, &r.dk, &r.dv}) {
      for (float& x : *vec) x -= 0.5f;
    }
    return r;
  }

 private:
  Rng rng_;
  ProblemSpec spec_;
  OwnedInputs owned_;
  AttentionInputs in_;
  std::vector<int64_t> q_pos_, kv_pos_;
  float scale_ = 1.0f;
  Tensor dout_;
};

// Paths whose bf16 forward rounds P to bf16 for P V (the amx path's tiles).
bool RoundsP(KernelPath path) { return testing::RoundsBf16Operands(path, DType::kBF16); }

void ExpectClose(const std::vector<float>& actual, const std::vector<double>& expected, double tol,
                 const std::string& what) {
  const testing::Comparison c = Compare(ToDoubleVec(actual), expected);
  EXPECT_LE(c.Relative(), tol) << what << ": " << c.Describe();
}

// Element by element: |actual_e - expected_e| <= u * terms_e + allowance,
// where allowance = 2 * tol * max|expected| (twice the f32 check's bound: a
// different summation order) and u = 2^-8 (bf16's unit roundoff).
void ExpectWithinTerms(const std::vector<float>& actual, const std::vector<double>& expected,
                       const std::vector<double>& terms, double tol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_EQ(terms.size(), expected.size()) << what;
  const double u = std::ldexp(1.0, -8);
  const double allowance = 2 * tol * testing::MaxAbs(expected);
  double worst = -std::numeric_limits<double>::infinity();
  size_t at = 0;
  for (size_t e = 0; e < expected.size(); ++e) {
    const double excess = std::abs(actual[e] - expected[e]) - u * terms[e];
    if (!(excess <= worst)) {  // NaN wins
      worst = excess;
      at = e;
    }
  }
  EXPECT_LE(worst, allowance) << what << ": element " << at << " is " << actual[at] << ", expected "
                              << expected[at] << " within 2^-8 x " << terms[at];
}

// dq, dk and dv of run r against the reference g within `tol` (f32 math on
// the rounded inputs), relative to each tensor's largest magnitude. Where the
// path rounds P and dS to bf16 for its gradient products (the amx backward
// with bf16 q, k, v and dout: dtype is also dout's), each element errs by up
// to 2^-8 times the sum of the magnitudes of the terms the rounding touches
// (RefBackward::dq_ds_terms, dk_ds_terms, dv_terms; only one operand of each
// product is rounded, the other is an exact bf16 input), plus the f32 error.
void ExpectGradients(const Result& r, const testing::RefBackward& g, KernelPath path, DType dtype,
                     double tol, const std::string& what, double dv_tol = -1.0) {
  if (dv_tol < 0) dv_tol = tol;
  if (testing::RoundsBf16Operands(path, dtype)) {
    ExpectWithinTerms(r.dq, g.dq, g.dq_ds_terms, tol, "dq " + what);
    ExpectWithinTerms(r.dk, g.dk, g.dk_ds_terms, tol, "dk " + what);
    ExpectWithinTerms(r.dv, g.dv, g.dv_terms, dv_tol, "dv " + what);
    return;
  }
  ExpectClose(r.dq, g.dq, tol, "dq " + what);
  ExpectClose(r.dk, g.dk, tol, "dk " + what);
  ExpectClose(r.dv, g.dv, dv_tol, "dv " + what);
}

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

TEST(KernelPathTest, SupportedAndResolve) {
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), KernelPath::kPortable);
  const auto& f = kernels::DetectCpuFeatures();
  EXPECT_EQ(paths.size(), 1u + (f.avx2 ? 1u : 0u) + (f.avx512 ? 1u : 0u) +
                              (f.avx512_bf16 ? 1u : 0u) + (f.amx ? 1u : 0u));
  // Each wider path implies the narrower ones (AVX-512 CPUs have AVX2).
  EXPECT_TRUE(!f.avx512 || f.avx2);
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512);
  EXPECT_TRUE(!f.amx || f.avx512_bf16);
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
  // kAuto: amx where usable, avx512_bf16 only where bf16 dot products are
  // fast, else avx512, else avx2.
  const KernelPath best = f.amx                              ? KernelPath::kAmx
                          : f.avx512_bf16 && f.fast_bf16_dot ? KernelPath::kAvx512Bf16
                          : f.avx512                         ? KernelPath::kAvx512
                          : f.avx2                           ? KernelPath::kAvx2
                                                             : KernelPath::kPortable;
  EXPECT_EQ(ResolveKernelPath(KernelPath::kAuto), best);
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

// --- FlashForward / FlashBackward against the f64 reference -------------------

struct Shape {
  int64_t b, sq, skv, h, hkv, d, dv;
};

ProblemSpec SpecOf(const Shape& sh, DType dtype = DType::kF32, bool segments = false) {
  ProblemSpec spec(sh.b, sh.sq, sh.skv, sh.h, sh.hkv, sh.d, sh.dv);
  spec.dtype = dtype;
  spec.segments = segments;
  return spec;
}

void CheckAgainstReference(const Shape& sh, DType dtype, const RunConfig& s, bool segments,
                           uint64_t seed, bool backward = true) {
  Problem prob(seed, SpecOf(sh, dtype, segments));
  const testing::RefProblem rp = prob.Ref(s);
  const testing::RefForward ref = testing::ReferenceForward(rp);
  const Result r = prob.Run(s, backward, &ref);
  const std::string what = std::string(KernelPathName(s.path)) + " " + DTypeName(dtype) +
                           " d=" + std::to_string(sh.d) + " dv=" + std::to_string(sh.dv) +
                           " sq=" + std::to_string(sh.sq) + " skv=" + std::to_string(sh.skv);
  // bf16 products (avx512_bf16 and amx with bf16 inputs) compute S exactly
  // like f32 on the rounded inputs (bf16 x bf16 products are exact in f32);
  // amx also rounds P to bf16 (relative 2^-8, bf16's unit roundoff) for
  // P V. |out_i error| <= 2^-8 sum_j p_ij |v_j| <= 2^-8 max|v|, plus 2x the
  // f32 error allowance for the rest.
  double out_tol = kF32Tol;
  if (dtype == DType::kBF16 && RoundsP(s.path)) {
    out_tol = 2 * kF32Tol +
              std::ldexp(testing::MaxAbs(rp.v), -8) / std::max(1e-30, testing::MaxAbs(ref.out));
  }
  ExpectClose(r.out, ref.out, out_tol, "out " + what);
  ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
  if (!backward) return;
  const testing::RefBackward g = testing::ReferenceBackward(rp, prob.Dout());
  ExpectGradients(r, g, s.path, dtype, kF32Tol, what);
}

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
      // bf16 too: kv blocks of 48 keys (not whole 32-key AMX k steps) on
      // the amx path.
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

// Whether FlashForward reads the K and V of `prob` through per-thread tile
// copies (KvTileCache): f32 rows strided by other heads, or V rows of 512
// bytes and more, in tiles used too rarely for a copy per call.
bool UsesTileCopies(const Problem& prob, const RunConfig& s) {
  const FlashParams p = prob.Params(s);
  const kernels::Geometry g = kernels::Geometry::Of(p);
  const kernels::TilePlan plan(p, g, /*by_column=*/false);
  ThreadPool pool(1);
  return kernels::KvRows(p, g, kernels::KvRows::KeyFormat::kF32, plan.UsesPerKvTile(), pool,
                         /*tile_cache=*/true)
      .tile_cache();
}

// Sliding windows over [B, S, H, D] tensors: K and V tiles are copied per
// thread as tasks use them, tasks run in runs of neighbouring q blocks. The
// result matches the reference and does not depend on the thread count
// (which thread copied which tile).
TEST(FlashTest, WindowTileCopiesMatchReferenceOnAnyThreadCount) {
  uint64_t seed = 250;
  for (KernelPath path : SupportedKernelPaths()) {
    const Shape sh{2, 300, 300, 4, 2, 64, 48};
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal() & Mask::Local(40, std::nullopt);
    s.blocks = {32, 16};
    Problem prob(++seed, SpecOf(sh));
    ASSERT_TRUE(UsesTileCopies(prob, s));
    CheckAgainstReference(sh, DType::kF32, s, /*segments=*/false, seed, /*backward=*/false);
    s.threads = 1;
    const Result r1 = prob.Run(s, false);
    for (int threads : {2, 3}) {
      s.threads = threads;
      const Result rn = prob.Run(s, false);
      EXPECT_TRUE(BitwiseEqual(r1, rn)) << threads;
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
    ASSERT_TRUE(UsesTileCopies(Problem(++seed, SpecOf(c.shape)), s));
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
        out_tol = 2 * kF32Tol + std::ldexp(testing::MaxAbs(rp.v), -8) / testing::MaxAbs(ref.out);
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
        out_tol = 2 * kF32Tol + std::ldexp(testing::MaxAbs(rp.v), -8) / testing::MaxAbs(ref.out);
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
        ProblemSpec spec(2, 37, 53, 4, 2, 32, 24);
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

// --- Block sparsity, determinism, block-size invariance -----------------------

TEST(FlashTest, CausalSkipsEmptyTilesAndCountsFlops) {
  // S = 256, blocks 32 x 32: per (b, h) 8 x 8 tiles; causal computes the 36 on
  // or below the diagonal (8 partial diagonal ones) and skips 28.
  ProblemSpec spec(2, 256, 256, 2, 1, 16, 32);
  Problem prob(600, spec);
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal();
    const Result r = prob.Run(s, true);
    const int64_t heads = spec.b * spec.h;
    for (const KernelStats* st : {&r.fwd_stats, &r.bwd_stats}) {
      EXPECT_EQ(st->computed_blocks, heads * 36);
      EXPECT_EQ(st->partial_blocks, heads * 8);
      EXPECT_EQ(st->full_blocks, heads * 28);
      EXPECT_EQ(st->skipped_blocks, heads * 28);
    }
    const double tile = 32.0 * 32.0;
    EXPECT_EQ(r.fwd_stats.flops, heads * 36 * 2 * tile * (spec.d + spec.dv));
    const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
    if (kernels::BackwardInOnePass(g, s.threads)) {  // S, dP, dV, dK, dQ once
      EXPECT_EQ(r.bwd_stats.flops, heads * 36 * 2 * tile * (3.0 * spec.d + 2.0 * spec.dv));
    } else {  // dK/dV pass: S, dP, dV, dK; dQ pass: S, dP, dQ.
      EXPECT_EQ(r.bwd_stats.flops,
                heads * 36 * tile * (4.0 * (spec.d + spec.dv) + 2.0 * (2 * spec.d + spec.dv)));
    }
  }
}

TEST(FlashTest, BitwiseIdenticalAcrossThreadCounts) {
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      ProblemSpec spec(2, 100, 90, 4, 2, 32, 32);
      spec.dtype = dtype;
      spec.segments = true;
      Problem prob(700, spec);
      RunConfig s;
      s.path = path;
      s.mask = Mask::Causal(20);
      s.threads = 1;
      const Result r1 = prob.Run(s, true);
      for (int threads : {2, 3, 7}) {  // 7: two passes
        s.threads = threads;
        const Result rn = prob.Run(s, true);
        EXPECT_TRUE(BitwiseEqual(r1, rn));
      }
    }
  }
}

// The backward splits each kv head's group of query heads into parts when
// there are fewer than 16 (batch, kv head) pairs (MQA, small batches), so
// that its one-pass schedule has enough tasks. Each split: gradients against
// the reference, and bitwise the same on 1 to 4 and 7 threads, i.e. through
// both schedules (8 or 16 tasks on 7 threads take the two-pass one).
TEST(FlashTest, BackwardHeadPartsMatchReferenceOnAnyThreadCount) {
  struct Case {
    Shape shape;
    int64_t parts;  // the documented rule: the smallest divisor of the group
                    // giving >= 16 tasks, else the whole group
  };
  const std::vector<Case> cases = {
      {{2, 40, 50, 16, 8, 16, 16}, 1},  // 16 pairs: groups of 2 stay whole
      {{2, 40, 50, 16, 4, 16, 24}, 2},  // 8 pairs: groups of 4 in halves
      {{1, 40, 50, 8, 1, 16, 16}, 8},   // MQA: every query head its own part
  };
  uint64_t seed = 720;
  for (const Case& c : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = Mask::Causal(5);
        s.blocks = {16, 16};
        s.threads = 1;
        CheckAgainstReference(c.shape, dtype, s, /*segments=*/false, ++seed);
        Problem prob(seed, SpecOf(c.shape, dtype));
        const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
        EXPECT_EQ(kernels::BackwardHeadParts(g), c.parts);
        const Result r1 = prob.Run(s, true);
        for (int threads : {2, 3, 4, 7}) {
          s.threads = threads;
          EXPECT_EQ(kernels::BackwardInOnePass(g, threads), threads != 7);
          const Result rn = prob.Run(s, true);
          EXPECT_TRUE(BitwiseEqual(r1, rn))
              << KernelPathName(path) << " " << DTypeName(dtype) << " parts " << c.parts << ", "
              << threads << " threads";
        }
      }
    }
  }
  // The rule on long sequences, where the parts' dK/dV buffers ((parts - 1)
  // x 128 MiB here) must stay within one f32 copy of q (512 MiB): MQA at S =
  // 131072 takes 4 parts, not 8; 16 pairs take none.
  kernels::Geometry big;
  big.b = 1;
  big.sq = big.skv = 131072;
  big.h = 8;
  big.hkv = 1;
  big.group = 8;
  big.d = big.dv = 128;
  EXPECT_EQ(kernels::BackwardHeadParts(big), 4);
  big.sq = big.skv = 1024;  // small: the whole group
  EXPECT_EQ(kernels::BackwardHeadParts(big), 8);
  big.b = 16;
  EXPECT_EQ(kernels::BackwardHeadParts(big), 1);
  big.b = 2;
  big.h = 16;
  big.hkv = 4;
  big.group = 4;
  EXPECT_EQ(kernels::BackwardHeadParts(big), 2);

  // MQA on 2 threads: one pass (the five products once per tile).
  ProblemSpec spec(1, 64, 64, 8, 1, 16, 16);
  Problem prob(730, spec);
  RunConfig s;
  s.blocks = {16, 16};
  s.threads = 2;
  EXPECT_TRUE(kernels::BackwardInOnePass(kernels::Geometry::Of(prob.Params(s)), 2));
  const Result r = prob.Run(s, true);
  const double tiles = 8.0 * 4 * 4;
  EXPECT_EQ(r.bwd_stats.flops, tiles * 2 * 16 * 16 * (3.0 * 16 + 2.0 * 16));
}

// Rows [lo, lo + n) of a [B, S, H, C] view.
TensorView SliceRows(const TensorView& t, int64_t lo, int64_t n) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + lo * t.stride[1] * static_cast<int64_t>(DTypeSize(t.dtype));
  s.shape[1] = n;
  return s;
}

TEST(FlashTest, ForwardMergeEqualsForwardThenMergePartial) {
  ProblemSpec spec(2, 70, 90, 4, 2, 32, 48);
  Problem prob(900, spec);
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal(-10);  // early queries see nothing of the first slice
    const FlashParams p = prob.Params(s);
    const int64_t split = 37;
    FlashParams a = p, b = p;
    a.k = SliceRows(p.k, 0, split);
    a.v = SliceRows(p.v, 0, split);
    b.k = SliceRows(p.k, split, spec.skv - split);
    b.v = SliceRows(p.v, split, spec.skv - split);
    b.kv_pos = p.kv_pos + split;
    const size_t out_n = static_cast<size_t>(spec.b * spec.sq * spec.h * spec.dv);
    const size_t lse_n = static_cast<size_t>(spec.b * spec.h * spec.sq);
    ThreadPool pool(2);
    // Expected: forward of each slice, then MergePartial.
    std::vector<float> out(out_n), lse(lse_n), part(out_n), part_lse(lse_n);
    kernels::FlashForward(a, pool, out.data(), lse.data(), nullptr);
    std::vector<float> merged = out, merged_lse = lse;
    kernels::FlashForward(b, pool, part.data(), part_lse.data(), nullptr);
    kernels::MergePartial({spec.b, spec.sq, spec.h, spec.dv}, out.data(), lse.data(), part.data(),
                          part_lse.data());
    kernels::FlashForwardMerge(b, pool, merged.data(), merged_lse.data(), nullptr);
    EXPECT_EQ(std::memcmp(out.data(), merged.data(), out_n * 4), 0) << KernelPathName(path);
    EXPECT_EQ(std::memcmp(lse.data(), merged_lse.data(), lse_n * 4), 0) << KernelPathName(path);
    // And both equal the forward over all keys (f32 rounding of the merge).
    std::vector<float> whole(out_n), whole_lse(lse_n);
    kernels::FlashForward(p, pool, whole.data(), whole_lse.data(), nullptr);
    ExpectClose(merged, ToDoubleVec(whole), kF32Tol, "merged out");
    ExpectClose(merged_lse, ToDoubleVec(whole_lse), kF32Tol, "merged lse");
  }
}

TEST(FlashTest, BlockSizesChangeResultsOnlyByRounding) {
  ProblemSpec spec(1, 130, 150, 2, 1, 64, 64);
  spec.segments = true;
  Problem prob(800, spec);
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal(10) | Mask::Local(3, 3);
    s.blocks = {16, 16};
    const Result a = prob.Run(s, true);
    for (BlockSizes bs : {BlockSizes{64, 128}, BlockSizes{48, 32}, BlockSizes{256, 256}}) {
      s.blocks = bs;
      const Result b = prob.Run(s, true);
      // Both are f32 computations of the same sums in different orders.
      ExpectClose(b.out, ToDoubleVec(a.out), kF32Tol, "out");
      ExpectClose(b.lse, ToDoubleVec(a.lse), kF32Tol, "lse");
      ExpectClose(b.dq, ToDoubleVec(a.dq), kF32Tol, "dq");
      ExpectClose(b.dk, ToDoubleVec(a.dk), kF32Tol, "dk");
      ExpectClose(b.dv, ToDoubleVec(a.dv), kF32Tol, "dv");
    }
  }
}

}  // namespace
}  // namespace ringsplash

// AttentionForward / AttentionBackward against the f64 reference
// (tests/support/reference.h): every mask kind and combinations, dense masks,
// segments, sinks, soft cap, GQA/MQA, Dv != D, Sq != Skv, strided views,
// f32/bf16/f16, every supported KernelPath; plus empty rows, block-size and
// thread-count invariance. Block skipping is in attention_skipping_test.cc.
//
// Tolerances: f32 and the bf16/f16 error model are explained in
// tests/support/accuracy.{h,cc}.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringsplash/mask.h"
#include "src/kernels/validate.h"
#include "tests/support/accuracy.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

constexpr double kF32Tol = kF32Tolerance;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string PathName(KernelPath p) { return KernelPathName(p); }

void ExpectMatchesReference(const OwnedInputs& in, const AttentionOptions& opt,
                            const std::string& what, const Tolerances& tol = {}) {
  EXPECT_EQ(CheckAgainstReference(in, opt, tol), "") << what;
}

// ---- Masks ----------------------------------------------------------------

struct MaskCase {
  std::string name;
  Mask mask;
};
void PrintTo(const MaskCase& c, std::ostream* os) { *os << c.name; }

// Sizes shared by the mask cases: ragged blocks (40 and 56 are not multiples
// of the 16/32 block sizes used), GQA 4:2, Dv != D.
constexpr int64_t kB = 2, kSq = 40, kSkv = 56, kH = 4, kHkv = 2, kD = 32, kDv = 24;

Mask RandomDense(Rng& rng, int64_t heads, int64_t sq, int64_t skv, double p_allowed) {
  std::bernoulli_distribution allowed(p_allowed);
  std::vector<uint8_t> values(static_cast<size_t>(std::max<int64_t>(heads, 1) * sq * skv));
  for (uint8_t& x : values) x = allowed(rng) ? 1 : 0;
  return Mask::Dense(std::move(values), heads, sq, skv);
}

std::vector<MaskCase> MaskCases() {
  Rng rng(5);
  std::vector<MaskCase> c;
  c.push_back({"full", Mask::Full()});
  c.push_back({"causal", Mask::Causal()});
  c.push_back({"causal_offset_16", Mask::Causal(16)});
  c.push_back({"causal_offset_minus_5", Mask::Causal(-5)});  // first rows empty
  c.push_back({"local_8_0", Mask::Local(8, 0)});
  c.push_back({"local_3_5_offset_2", Mask::Local(3, 5, 2)});
  c.push_back({"local_unbounded_left", Mask::Local(std::nullopt, 4)});
  c.push_back({"local_unbounded_right", Mask::Local(6, std::nullopt)});
  c.push_back({"chunked_16", Mask::ChunkedCausal(16)});
  c.push_back({"chunked_7", Mask::ChunkedCausal(7)});
  c.push_back({"causal_and_local", Mask::Causal() & Mask::Local(10, 0)});
  c.push_back({"local_or_chunked", Mask::Local(2, 2) | Mask::ChunkedCausal(12)});
  c.push_back({"parsed", Mask::Parse("causal & local:20, | chunked:8")});
  c.push_back({"dense", RandomDense(rng, 0, kSq, kSkv, 0.3)});
  c.push_back({"dense_per_head", RandomDense(rng, kH, kSq, kSkv, 0.5)});
  c.push_back({"dense_and_causal", RandomDense(rng, 0, kSq, kSkv, 0.6) & Mask::Causal()});
  c.push_back({"per_head", Mask::PerHead({Mask::Causal(), Mask::Local(4, 4), Mask::Full(),
                                          Mask::ChunkedCausal(9)})});
  c.push_back({"per_head_or_dense",
               Mask::PerHead({Mask::Causal(), Mask::Causal(), Mask::Local(0, 0), Mask::Full()}) |
                   RandomDense(rng, 0, kSq, kSkv, 0.1)});
  return c;
}

class MaskTest : public ::testing::TestWithParam<MaskCase> {};

TEST_P(MaskTest, F32MatchesReference) {
  Rng rng(1);
  ProblemSpec spec{kB, kSq, kSkv, kH, kHkv, kD, kDv};
  const OwnedInputs in = RandomInputs(rng, spec);
  AttentionOptions opt;
  opt.mask = GetParam().mask;
  opt.block_sizes = {16, 32};
  opt.num_threads = 2;
  ExpectMatchesReference(in, opt, GetParam().name);
}

TEST_P(MaskTest, Bf16MatchesReference) {
  Rng rng(2);
  ProblemSpec spec{kB, kSq, kSkv, kH, kHkv, kD, kDv};
  spec.dtype = DType::kBF16;
  const OwnedInputs in = RandomInputs(rng, spec);
  AttentionOptions opt;
  opt.mask = GetParam().mask;
  opt.block_sizes = {16, 16};
  ExpectMatchesReference(in, opt, GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Masks, MaskTest, ::testing::ValuesIn(MaskCases()),
                         [](const auto& info) { return info.param.name; });

// ---- Features ---------------------------------------------------------------

struct FeatureCase {
  std::string name;
  ProblemSpec spec;
  Mask mask;
  std::optional<float> softcap;
  std::optional<float> scale;
  BlockSizes blocks{16, 32};
};
void PrintTo(const FeatureCase& c, std::ostream* os) { *os << c.name; }

std::vector<FeatureCase> FeatureCases() {
  std::vector<FeatureCase> c;
  auto add = [&c](const char* name, ProblemSpec s, Mask m) -> FeatureCase& {
    FeatureCase& f = c.emplace_back();
    f.name = name;
    f.spec = s;
    f.mask = std::move(m);
    return f;
  };
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const std::string suffix = std::string("_") + DTypeName(dt);
    ProblemSpec s{2, 24, 40, 4, 2, 16, 16};
    s.dtype = dt;
    ProblemSpec x = s;
    x.segments = true;
    add(("segments" + suffix).c_str(), x, Mask::Causal());
    x = s;
    x.sinks = true;
    add(("sinks" + suffix).c_str(), x, Mask::Local(5, 0));
    x.segments = true;
    add(("sinks_segments" + suffix).c_str(), x, Mask::Full());
    x = s;
    x.h = 6;
    x.hkv = 3;
    add(("gqa_6_3" + suffix).c_str(), x, Mask::Causal());
    x.hkv = 1;
    x.sinks = true;
    add(("mqa" + suffix).c_str(), x, Mask::ChunkedCausal(10));
    x = s;
    x.d = 24;
    x.dv = 40;
    add(("dv_gt_d" + suffix).c_str(), x, Mask::Causal());
    x.d = 48;
    x.dv = 8;
    add(("dv_lt_d" + suffix).c_str(), x, Mask::Full());
    x = s;
    x.bhsd = true;
    x.sinks = true;
    add(("bhsd_views" + suffix).c_str(), x, Mask::Causal());
    x = s;
    x.qk_range = 3.0;
    FeatureCase& sc = add(("softcap" + suffix).c_str(), x, Mask::Causal());
    sc.softcap = 4.0f;
    FeatureCase& scale = add(("explicit_scale" + suffix).c_str(), s, Mask::Full());
    scale.scale = 0.37f;
  }
  ProblemSpec s{1, 8, 8, 2, 1, 1, 1};
  add("d_1", s, Mask::Causal());
  s = ProblemSpec{1, 20, 24, 2, 2, 256, 256};
  add("d_256", s, Mask::Causal()).blocks = {32, 16};
  s = ProblemSpec{3, 17, 33, 2, 1, 20, 12};
  add("odd_sizes_batch_3", s, Mask::Local(4, 4)).blocks = {16, 16};
  s = ProblemSpec{1, 24, 40, 2, 2, 16, 16};
  add("sq_lt_skv_causal_offset", s, Mask::Causal(16));
  s = ProblemSpec{1, 40, 24, 2, 2, 16, 16};
  add("sq_gt_skv_causal", s, Mask::Causal());
  return c;
}

class FeatureTest : public ::testing::TestWithParam<FeatureCase> {};

TEST_P(FeatureTest, MatchesReference) {
  const FeatureCase& c = GetParam();
  Rng rng(3);
  OwnedInputs in = RandomInputs(rng, c.spec);
  if (c.spec.segments) {
    // Documents: q row ranges use ids {0, 1, 2} (some rows of batch 1 get an
    // id no key has, so they have no allowed key at all).
    int32_t* q = in.q_seg.data_as<int32_t>();
    for (int64_t i = 0; i < c.spec.sq / 4; ++i) q[c.spec.sq + i] = 77;
  }
  AttentionOptions opt;
  opt.mask = c.mask;
  opt.softcap = c.softcap;
  opt.scale = c.scale;
  opt.block_sizes = c.blocks;
  opt.num_threads = 3;
  ExpectMatchesReference(in, opt, c.name);
}

INSTANTIATE_TEST_SUITE_P(Features, FeatureTest, ::testing::ValuesIn(FeatureCases()),
                         [](const auto& info) { return info.param.name; });

// Pre-cap logits of ~1e3 with a soft cap of 20. q and k hold small integers
// and the scale is a power of two, so every logit is exact in f32 and in the
// bf16 product path: the test measures the cap and the softmax, not the
// rounding of 1e3-sized dot products (whose absolute error, ~1e3 * u, would
// otherwise dominate any relative tolerance).
TEST(SoftCapTest, LargeLogitsAreCapped) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Rng rng(4);
    ProblemSpec spec{1, 24, 40, 2, 1, 16, 16};
    spec.dtype = dt;
    OwnedInputs in = RandomInputs(rng, spec);
    std::uniform_int_distribution<int> small(-12, 12);
    for (Tensor* t : {&in.q, &in.k}) {
      std::vector<double> vals(static_cast<size_t>(t->numel()));
      for (double& x : vals) x = small(rng);
      FromDoubles(vals, t->view());
    }
    AttentionOptions opt;
    opt.scale = 2.0f;  // |logit| up to 2 * 16 * 144 = 4608, typically ~1e3
    opt.softcap = 20.0f;
    opt.mask = Mask::Causal();
    const RefProblem p = MakeRefProblem(in.inputs(), opt);
    double max_raw = 0;
    for (int64_t i = 0; i < 24 * 2; ++i)
      for (int64_t j = 0; j < 40; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < 16; ++d) dot += p.q[i * 16 + d] * p.k[j * 16 + d];
        max_raw = std::max(max_raw, std::fabs(2.0 * dot));
      }
    EXPECT_GT(max_raw, 500.0);  // the test really exercises large logits
    // The cap's derivative 1 - tanh^2 is formed in f32 from the capped
    // logit, so it carries an absolute error ~2u even where its exact value
    // is ~0 (|raw| >> cap), and different tanh approximations (libm on the
    // portable path, polynomials on AVX-512) err differently. Each such term
    // adds up to 2u * p * |dp - D| * scale * |k| ~ 2 * 6e-8 * 1 * 30 * 24
    // ~ 1e-4 to gradients of magnitude O(1..10): gradient tolerance 1e-4
    // (absolute floor for the bf16 check too). A wrong derivative (or none)
    // is O(1) off.
    Tolerances tol;
    tol.f32_grad = 1e-4;
    tol.low_grad_slack = 1e-4;
    ExpectMatchesReference(in, opt, std::string("softcap_large_") + DTypeName(dt), tol);
  }
}

// ---- Empty rows -------------------------------------------------------------

// Rows with no allowed key (mask or segments): out exactly 0, lse -inf (or
// the sink), zero gradients for them and no NaN anywhere.
TEST(EmptyRowsTest, ZeroOutputsMinusInfLseZeroGradients) {
  for (bool sinks : {false, true}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (KernelPath path : SupportedKernelPaths()) {
        Rng rng(6);
        ProblemSpec spec{2, 32, 32, 2, 1, 16, 16};
        spec.dtype = dt;
        spec.sinks = sinks;
        spec.segments = true;
        OwnedInputs in = RandomInputs(rng, spec);
        // Batch 0: every q row in document 5, which no key has. Batch 1:
        // causal with offset -8 leaves rows 0..7 empty.
        int32_t* q = in.q_seg.data_as<int32_t>();
        int32_t* kv = in.kv_seg.data_as<int32_t>();
        for (int i = 0; i < 32; ++i) {
          q[i] = 5;
          kv[i] = 1;
          q[32 + i] = 0;
          kv[32 + i] = 0;
        }
        AttentionOptions opt;
        opt.mask = Mask::Causal(-8);
        opt.kernel_path = path;
        opt.block_sizes = {16, 16};
        const Tensor dout = RandomTensor(rng, dt, OutShape(in));
        const ApiResult r = RunAttention(in, opt, &dout, ApiRun{dt, dt, false});
        SCOPED_TRACE(std::string(DTypeName(dt)) + " " + PathName(path) + (sinks ? " sinks" : ""));
        for (const auto* v : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv, &r.dsinks}) {
          EXPECT_FALSE(HasNaN(*v));
        }
        const std::vector<double> sink_values =
            sinks ? ToDoubles(in.sinks.view()) : std::vector<double>{};
        for (int64_t h = 0; h < 2; ++h) {
          const double empty_lse = sinks ? sink_values[h] : -kInf;
          for (int64_t i = 0; i < 32; ++i) {
            EXPECT_EQ(r.lse[(0 * 2 + h) * 32 + i], empty_lse) << "b0 h" << h << " i" << i;
            if (i < 8) {
              EXPECT_EQ(r.lse[(1 * 2 + h) * 32 + i], empty_lse) << "b1 row " << i;
            }
          }
        }
        // Batch 0 entirely: out 0, dq 0, dk 0, dv 0. Batch 1 rows 0..7: out 0, dq 0.
        for (int64_t i = 0; i < 32 * 2 * 16; ++i) {
          ASSERT_EQ(r.out[i], 0.0) << i;
          ASSERT_EQ(r.dq[i], 0.0) << i;
        }
        for (int64_t i = 0; i < 32 * 16; ++i) {
          ASSERT_EQ(r.dk[i], 0.0) << i;
          ASSERT_EQ(r.dv[i], 0.0) << i;
        }
        for (int64_t i = 32 * 2 * 16; i < (32 + 8) * 2 * 16; ++i) {
          ASSERT_EQ(r.out[i], 0.0) << i;
          ASSERT_EQ(r.dq[i], 0.0) << i;
        }
        // The rest still matches the reference.
        if (dt == DType::kF32) {
          const Errors e = ErrorsOf(r, RunReference(in, opt, &dout));
          EXPECT_LT(std::max({e.out, e.lse, e.dq, e.dk, e.dv, e.dsinks}), kF32Tol) << e.Describe();
        }
      }
    }
  }
}

// ---- Strided outputs, output dtypes ------------------------------------------

// out/dq/dk/dv written through [B, H, S, D] strided views, in bf16 and f32,
// equal the contiguous f32 results (rounded to the output dtype).
TEST(OutputViewsTest, StridedAndConvertedOutputsEqualContiguousF32) {
  Rng rng(7);
  ProblemSpec spec{2, 24, 40, 4, 2, 16, 24};
  spec.dtype = DType::kBF16;
  spec.sinks = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  AttentionOptions opt;
  opt.mask = Mask::Causal(8);
  opt.block_sizes = {16, 16};
  const Tensor dout = RandomTensor(rng, DType::kBF16, OutShape(in));
  // Backward reads out, so feed both runs the same out: f32 outputs first.
  const ApiResult f32 = RunAttention(in, opt, &dout, ApiRun{DType::kF32, DType::kF32, false});
  const ApiResult strided = RunAttention(in, opt, &dout, ApiRun{DType::kF32, DType::kF32, true});
  EXPECT_EQ(f32.out, strided.out);
  EXPECT_EQ(f32.lse, strided.lse);
  EXPECT_EQ(f32.dq, strided.dq);
  EXPECT_EQ(f32.dk, strided.dk);
  EXPECT_EQ(f32.dv, strided.dv);
  EXPECT_EQ(f32.dsinks, strided.dsinks);
  const ApiResult bf = RunAttention(in, opt, &dout, ApiRun{DType::kBF16, DType::kBF16, true});
  for (size_t i = 0; i < f32.out.size(); ++i) ASSERT_EQ(bf.out[i], RoundToBF16(f32.out[i])) << i;
  EXPECT_EQ(bf.lse, f32.lse);
  // The bf16 gradients differ from the f32 ones by (a) their own rounding to
  // bf16, <= u = 2^-8 of each element, and (b) delta = dout . out taken from
  // the bf16-rounded out: |d delta_i| <= u * sum_e |dout_ie out_ie|, which
  // enters ds_ij = p_ij (dp_ij - delta_i) like any O(u) relative change of
  // the delta term. Both are a few u relative to the largest gradient:
  // 0.02 ~ 5u. Dropping or mis-indexing a gradient is O(1).
  for (auto [a, b] : {std::pair{&bf.dq, &f32.dq}, {&bf.dk, &f32.dk}, {&bf.dv, &f32.dv}}) {
    for (double x : *a) ASSERT_EQ(x, RoundToBF16(x));
    EXPECT_LT(Compare(*a, *b).Relative(), 0.02);
  }
}

// A bf16 out (contiguous or a [B, H, S, D] layout, with or without sinks) is
// written by the kernel directly (no f32 copy of out): it must equal the f32
// out of the same call rounded to bf16, bit for bit (the same f32 row, sinks
// applied, is rounded the same way), with the same lse — on every path, with
// a NaN input too (the call is then redone in f32 and poisoned, as for f32
// outputs).
TEST(OutputViewsTest, DirectBf16OutEqualsRoundedF32Out) {
  // decoding: 3 query rows per head (stacked heads, decode/stacked_heads.h) over
  // 600 keys (split over ranges of kv tiles, ForwardKvSplits).
  for (const bool decoding : {false, true}) {
    for (const bool sinks : {false, true}) {
      Rng rng(8);
      ProblemSpec spec{2, 40, 56, 4, 2, 32, 24};
      if (decoding) {
        spec.sq = 3;
        spec.skv = 600;
      }
      spec.dtype = DType::kBF16;
      spec.sinks = sinks;
      OwnedInputs in = RandomInputs(rng, spec);
      AttentionOptions opt;
      opt.mask = decoding ? Mask::Full() : Mask::Causal(8) & Mask::Local(20, std::nullopt);
      opt.block_sizes = {16, 32};
      for (bool poisoned : {false, true}) {
        if (poisoned) {
          StoreFromF32(in.k.view(), in.k.view().Offset(1, 30, 1, 3),
                       std::numeric_limits<float>::quiet_NaN());
        }
        for (KernelPath path : SupportedKernelPaths()) {
          opt.kernel_path = path;
          const ApiResult f32 =
              RunAttention(in, opt, nullptr, ApiRun{DType::kF32, DType::kF32, false});
          for (const bool strided : {false, true}) {  // strided: a [B, H, S, D] bf16 out
            const ApiResult bf =
                RunAttention(in, opt, nullptr, ApiRun{DType::kBF16, DType::kF32, strided});
            const std::string what = PathName(path) + (poisoned ? " poisoned" : "") +
                                     (sinks ? " sinks" : "") + (strided ? " strided" : "") +
                                     (decoding ? " decoding" : "");
            ASSERT_EQ(bf.out.size(), f32.out.size());
            int nans = 0;
            for (size_t i = 0; i < f32.out.size(); ++i) {
              if (std::isnan(f32.out[i])) {
                ASSERT_TRUE(std::isnan(bf.out[i])) << what << " " << i;
                ++nans;
                continue;
              }
              ASSERT_EQ(bf.out[i], RoundToBF16(f32.out[i])) << what << " " << i;
            }
            EXPECT_EQ(nans > 0, poisoned) << what;
            ASSERT_EQ(bf.lse.size(), f32.lse.size());
            for (size_t i = 0; i < f32.lse.size(); ++i) {
              ASSERT_TRUE(bf.lse[i] == f32.lse[i] ||
                          (std::isnan(bf.lse[i]) && std::isnan(f32.lse[i])))
                  << what << " lse " << i;
            }
          }
        }
      }
    }
  }
}

// StridesNest decides which bf16 outputs the kernels write from several
// threads directly: only views whose elements are certainly distinct.
TEST(OutputViewsTest, StridesNestOnlyForDisjointLayouts) {
  auto view = [](std::vector<int64_t> shape, std::vector<int64_t> stride) {
    TensorView t = TensorView::Contiguous(nullptr, DType::kBF16, shape);
    for (size_t i = 0; i < stride.size(); ++i) t.stride[i] = stride[i];
    return t;
  };
  EXPECT_TRUE(kernels::StridesNest(view({2, 5, 3, 4}, {60, 12, 4, 1})));   // [B, S, H, D]
  EXPECT_TRUE(kernels::StridesNest(view({2, 5, 3, 4}, {60, 4, 20, 1})));   // [B, H, S, D]
  EXPECT_TRUE(kernels::StridesNest(view({2, 5, 3, 4}, {105, 21, 7, 1})));  // padded rows
  EXPECT_TRUE(kernels::StridesNest(view({1, 5, 1, 4}, {0, 4, 0, 1})));     // size-1 dims
  EXPECT_FALSE(kernels::StridesNest(view({2, 5, 3, 4}, {60, 12, 2, 1})));  // heads overlap rows
  EXPECT_FALSE(kernels::StridesNest(view({2, 5, 3, 4}, {60, 8, 20, 1})));  // S inside H, too close
  EXPECT_FALSE(kernels::StridesNest(view({2, 5, 3, 4}, {60, 12, 4, 0})));  // broadcast D
}

// Outputs that are views into larger buffers (padded rows): the API writes
// exactly the viewed elements and leaves the padding alone.
TEST(OutputViewsTest, PaddedViewsAreWrittenExactly) {
  Rng rng(17);
  ProblemSpec spec(2, 20, 30, 2, 1, 16, 8);
  spec.sinks = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  AttentionOptions opt;
  opt.mask = Mask::Causal(4);
  opt.block_sizes = {16, 16};
  const ApiResult expected = RunAttention(in, opt, nullptr);
  constexpr float kSentinel = 12345.0f;
  Tensor out_buf(DType::kF32, {2, 20, 2, 8 + 3});  // Dv padded by 3
  Tensor lse_buf(DType::kF32, {2, 2, 20 + 5});     // Sq padded by 5
  std::fill_n(out_buf.data_as<float>(), out_buf.numel(), kSentinel);
  std::fill_n(lse_buf.data_as<float>(), lse_buf.numel(), kSentinel);
  TensorView out = out_buf.view();
  out.shape[3] = 8;
  TensorView lse = lse_buf.view();
  lse.shape[2] = 20;
  AttentionForward(in.inputs(), opt, out, lse);
  EXPECT_EQ(ToDoubles(out), expected.out);
  EXPECT_EQ(ToDoubles(lse), expected.lse);
  for (int64_t i = 0; i < out_buf.numel(); ++i) {
    if (i % 11 >= 8) {
      ASSERT_EQ(out_buf.data_as<float>()[i], kSentinel) << i;
    }
  }
  for (int64_t i = 0; i < lse_buf.numel(); ++i) {
    if (i % 25 >= 20) {
      ASSERT_EQ(lse_buf.data_as<float>()[i], kSentinel) << i;
    }
  }
}

// ---- Invariance ---------------------------------------------------------------

// Block sizes are tuning knobs: every choice matches the reference, and they
// agree with each other to float rounding.
TEST(InvarianceTest, BlockSizes) {
  Rng rng(8);
  ProblemSpec spec{2, 50, 70, 4, 2, 16, 16};
  spec.sinks = true;
  spec.segments = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  AttentionOptions opt;
  opt.mask = Mask::Causal() & Mask::Local(30, 0);
  opt.softcap = 5.0f;
  const RefResult ref = RunReference(in, opt, &dout);
  std::vector<ApiResult> runs;
  for (BlockSizes bs : {BlockSizes{16, 16}, BlockSizes{16, 64}, BlockSizes{48, 32},
                        BlockSizes{64, 128}, BlockSizes{128, 16}}) {
    opt.block_sizes = bs;
    runs.push_back(RunAttention(in, opt, &dout));
    const Errors e = ErrorsOf(runs.back(), ref);
    EXPECT_LT(std::max({e.out, e.lse, e.dq, e.dk, e.dv, e.dsinks}), kF32Tol)
        << bs.q << "x" << bs.kv << ": " << e.Describe();
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT_LT(Compare(runs[i].out, runs[0].out).Relative(), kF32Tol);
    EXPECT_LT(Compare(runs[i].dq, runs[0].dq).Relative(), kF32Tol);
    EXPECT_LT(Compare(runs[i].dk, runs[0].dk).Relative(), kF32Tol);
  }
}

// Each task owns its output rows and sums in a fixed order: results are
// bitwise identical for 1, 2 and 3 threads, on every path and dtype.
TEST(InvarianceTest, ThreadCountIsBitwiseIrrelevant) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (KernelPath path : SupportedKernelPaths()) {
      Rng rng(9);
      ProblemSpec spec{2, 60, 60, 4, 1, 32, 16};
      spec.dtype = dt;
      spec.sinks = true;
      const OwnedInputs in = RandomInputs(rng, spec);
      const Tensor dout = RandomTensor(rng, dt, OutShape(in));
      AttentionOptions opt;
      opt.mask = Mask::Causal();
      opt.kernel_path = path;
      opt.block_sizes = {16, 16};
      opt.num_threads = 1;
      const ApiResult one = RunAttention(in, opt, &dout);
      for (int threads : {2, 3}) {
        opt.num_threads = threads;
        const ApiResult r = RunAttention(in, opt, &dout);
        SCOPED_TRACE(std::string(DTypeName(dt)) + " " + PathName(path) + " threads " +
                     std::to_string(threads));
        EXPECT_EQ(r.out, one.out);
        EXPECT_EQ(r.lse, one.lse);
        EXPECT_EQ(r.dq, one.dq);
        EXPECT_EQ(r.dk, one.dk);
        EXPECT_EQ(r.dv, one.dv);
        EXPECT_EQ(r.dsinks, one.dsinks);
        EXPECT_EQ(r.fwd.computed_blocks, one.fwd.computed_blocks);
        EXPECT_EQ(r.fwd.flops, one.fwd.flops);
      }
      // And a repeated call (cached pool) repeats itself.
      opt.num_threads = 1;
      EXPECT_EQ(RunAttention(in, opt, &dout).dq, one.dq);
    }
  }
}

// Concurrent callers (e.g. ranks of the threads communicator calling the
// single-device API) each get their own cached pool and the same results.
TEST(InvarianceTest, ConcurrentCallsAgree) {
  Rng rng(15);
  ProblemSpec spec(1, 40, 40, 2, 1, 16, 16);
  spec.sinks = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  AttentionOptions opt;
  opt.mask = Mask::Causal();
  opt.block_sizes = {16, 16};
  opt.num_threads = 2;
  const ApiResult expected = RunAttention(in, opt, &dout);
  std::vector<ApiResult> results(3);
  std::vector<std::thread> callers;
  for (size_t t = 0; t < results.size(); ++t) {
    callers.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep) results[t] = RunAttention(in, opt, &dout);
    });
  }
  for (std::thread& t : callers) t.join();
  for (const ApiResult& r : results) {
    EXPECT_EQ(r.out, expected.out);
    EXPECT_EQ(r.dq, expected.dq);
    EXPECT_EQ(r.dsinks, expected.dsinks);
  }
}

// RINGSPLASH_KERNEL=<path> makes the entry points run kAuto calls on that
// path: under it, a kAuto call gives bitwise the result of a call naming the
// path (forward and backward, f32 and bf16 inputs). The paths' own results
// differ (bf16 inputs: avx512_bf16 rounds P; f32: FMA and summation order),
// so a variable the entry points did not read would give some path's kAuto
// call another path's result.
TEST(InvarianceTest, KernelEnvironmentVariableSelectsThePathOfAutoCalls) {
  const char* saved = std::getenv("RINGSPLASH_KERNEL");
  const std::optional<std::string> restore =
      saved ? std::optional<std::string>(saved) : std::nullopt;
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Rng rng(16);
    ProblemSpec spec(1, 33, 47, 2, 2, 16, 16);
    spec.dtype = dtype;
    const OwnedInputs in = RandomInputs(rng, spec);
    const Tensor dout = RandomTensor(rng, dtype, OutShape(in));
    AttentionOptions opt;
    opt.mask = Mask::Local(9, 3);
    std::vector<ApiResult> named;
    for (const KernelPath path : paths) {
      opt.kernel_path = path;
      named.push_back(RunAttention(in, opt, &dout));
    }
    opt.kernel_path = KernelPath::kAuto;
    int distinct = 0;
    for (size_t i = 0; i < paths.size(); ++i) {
      SCOPED_TRACE(PathName(paths[i]));
      setenv("RINGSPLASH_KERNEL", KernelPathName(paths[i]), 1);
      const ApiResult r = RunAttention(in, opt, &dout);
      EXPECT_EQ(r.out, named[i].out);
      EXPECT_EQ(r.lse, named[i].lse);
      EXPECT_EQ(r.dq, named[i].dq);
      EXPECT_EQ(r.dk, named[i].dk);
      EXPECT_EQ(r.dv, named[i].dv);
      bool unlike_all_before = true;
      for (size_t j = 0; j < i; ++j) {
        if (named[j].out == named[i].out && named[j].dq == named[i].dq) unlike_all_before = false;
      }
      distinct += unlike_all_before ? 1 : 0;
    }
    if (paths.size() > 1) {
      EXPECT_GT(distinct, 1) << "every path gave the same results: the check above cannot tell "
                                "which path ran";
    }
  }
  if (restore) {
    setenv("RINGSPLASH_KERNEL", restore->c_str(), 1);
  } else {
    unsetenv("RINGSPLASH_KERNEL");
  }
}

// Block sizes far beyond the sequence tile it as one block, exactly as a
// block of its length rounded up to 16 does: scratch follows the rows, not
// the knob (a block of 2^40 on 8 tokens used to throw std::bad_alloc, and
// 2^20 took over a GB).
TEST(InvarianceTest, HugeBlockSizesActLikeOneBlock) {
  Rng rng(17);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec(1, 8, 20, 2, 1, 16, 16));
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  AttentionOptions opt;
  opt.mask = Mask::Causal(12);
  opt.block_sizes = {16, 32};
  const ApiResult fitted = RunAttention(in, opt, &dout);
  for (const BlockSizes huge :
       {BlockSizes{int64_t{1} << 40, int64_t{1} << 40}, BlockSizes{int64_t{1} << 20, 32},
        BlockSizes{16, int64_t{1} << 24}}) {
    opt.block_sizes = huge;
    const ApiResult r = RunAttention(in, opt, &dout);
    EXPECT_EQ(r.out, fitted.out) << huge.q << " x " << huge.kv;
    EXPECT_EQ(r.lse, fitted.lse) << huge.q << " x " << huge.kv;
    EXPECT_EQ(r.dq, fitted.dq) << huge.q << " x " << huge.kv;
    EXPECT_EQ(r.dk, fitted.dk) << huge.q << " x " << huge.kv;
  }
  EXPECT_EQ(CheckF32(in, opt, SupportedKernelPaths()), "");
}

// ---- Positions -------------------------------------------------------------------

// Global positions given explicitly equal the same mask with an offset, and
// match the reference (what a ring step relies on).
TEST(PositionsTest, ExplicitPositionsMatchOffsetMask) {
  Rng rng(13);
  OwnedInputs in = RandomInputs(rng, ProblemSpec{1, 24, 40, 2, 2, 16, 16});
  AttentionOptions shifted;
  shifted.mask = Mask::Causal();
  shifted.block_sizes = {16, 16};
  for (int64_t i = 0; i < 24; ++i) in.q_pos.push_back(100 + 16 + i);
  for (int64_t j = 0; j < 40; ++j) in.kv_pos.push_back(100 + j);
  EXPECT_EQ(CheckF32(in, shifted, SupportedKernelPaths()), "");
  const ApiResult a = RunAttention(in, shifted, nullptr);
  OwnedInputs plain = ConvertInputs(in, DType::kF32);
  plain.q_pos.clear();
  plain.kv_pos.clear();
  AttentionOptions offset = shifted;
  offset.mask = Mask::Causal(16);
  const ApiResult b = RunAttention(plain, offset, nullptr);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
}

// Striped (non-contiguous) positions, as a striped ring layout produces.
TEST(PositionsTest, StridedPositionsWithWindow) {
  Rng rng(14);
  OwnedInputs in = RandomInputs(rng, ProblemSpec{2, 32, 32, 2, 1, 16, 16});
  for (int64_t i = 0; i < 32; ++i) {
    in.q_pos.push_back(4 * i + 1);
    in.kv_pos.push_back(4 * i + 3);
  }
  AttentionOptions opt;
  opt.mask = Mask::Local(20, 0) | Mask::ChunkedCausal(32);
  opt.block_sizes = {16, 16};
  EXPECT_EQ(CheckF32(in, opt, SupportedKernelPaths()), "");
}

// Threads of this process: one entry each in /proc/self/task (Linux).
int ProcessThreads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Waits up to 5 s for the thread count to reach `want` (a joined thread can
// still be listed for a moment after join returns); returns the last count.
int WaitForThreads(int want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int n = ProcessThreads();
  while (n != want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    n = ProcessThreads();
  }
  return n;
}

TEST(ReleaseCachedThreadsTest, EndsTheKeptWorkersAndLaterCallsStartNewOnes) {
  ReleaseCachedThreads();  // pools earlier tests in this process kept
  const int base = WaitForThreads(ProcessThreads());
  Rng rng(21);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec{1, 64, 64, 4, 2, 32, 32});
  AttentionOptions opt;
  opt.mask = Mask::Causal();
  opt.block_sizes = {16, 16};
  opt.num_threads = 4;  // the caller is worker 0: the pool has 3 threads of its own
  const ApiResult first = RunAttention(in, opt, nullptr);
  EXPECT_EQ(WaitForThreads(base + 3), base + 3) << "the pool is kept between calls";
  ReleaseCachedThreads();
  EXPECT_EQ(WaitForThreads(base), base) << "ReleaseCachedThreads left threads running";
  const ApiResult second = RunAttention(in, opt, nullptr);
  EXPECT_EQ(first.out, second.out);  // a fresh pool computes the same, bit for bit
  EXPECT_EQ(first.lse, second.lse);
  EXPECT_EQ(WaitForThreads(base + 3), base + 3);
  ReleaseCachedThreads();
  ReleaseCachedThreads();  // nothing kept: a no-op
  EXPECT_EQ(WaitForThreads(base), base);
}

}  // namespace
}  // namespace ringsplash::testing

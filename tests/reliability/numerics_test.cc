// Numerical robustness (issue #6.4), single device and ring, against the f64
// reference (tests/support/reference.h):
//   - NaN / Inf inputs poison exactly the outputs that depend on them (the
//     rule is in poison.h and docs/RELIABILITY.md) — in particular a masked
//     key or value never leaks into a row that does not attend to it, even
//     inside a partially masked tile (0 * NaN);
//   - logits around 1e4 without a soft cap (and sinks of that size) neither
//     overflow nor lose the answer;
//   - fully masked rows give out 0, lse -inf (or the sink), zero gradients,
//     never NaN;
//   - an f16 result that does not fit in f16 is reported, not stored as inf.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "tests/reliability/poison.h"
#include "tests/support/accuracy.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// f32 tolerances as in tests/attention_test.cc: every output element is a
// D-term dot product, an online softmax over Skv <= 96 keys and a weighted
// sum, so the rounding error is O((D + Skv) u) ~ 1e-5 relative to the
// largest magnitude; gradients add one more such sum (1e-4).
constexpr double kOutTol = 2e-5;
constexpr double kGradTol = 2e-4;

AttentionOptions WithMask(const Mask& mask) {
  AttentionOptions opt;
  opt.mask = mask;
  return opt;
}

// Sets every element of one row of a [B, S, Heads, X] tensor to `value`.
void SetRow(Tensor& t, int64_t b, int64_t s, int64_t head, double value) {
  const TensorView v = t.view();
  for (int64_t x = 0; x < v.shape[3]; ++x) StoreFromF32(v, v.Offset(b, s, head, x), value);
}

// Results of RingAttentionThreads in RunAttention's format.
ApiResult RunRingThreads(const OwnedInputs& owned, const AttentionOptions& opt, const Tensor& dout,
                         int ranks, Layout layout) {
  const AttentionInputs in = owned.inputs();
  const int64_t b = in.q.shape[0], sq = in.q.shape[1], h = in.q.shape[2], d = in.q.shape[3];
  const int64_t skv = in.k.shape[1], hkv = in.k.shape[2], dv = in.v.shape[3];
  Tensor out(DType::kF32, {b, sq, h, dv}), lse(DType::kF32, {b, h, sq});
  Tensor dq(DType::kF32, {b, sq, h, d}), dk(DType::kF32, {b, skv, hkv, d});
  Tensor dvt(DType::kF32, {b, skv, hkv, dv}), dsinks(DType::kF32, {h});
  RingRun run;
  run.num_ranks = ranks;
  run.options.layout = layout;
  run.options.attention = opt;
  run.options.attention.num_threads = 1;
  const TensorView ds = in.sinks.defined() ? dsinks.view() : TensorView();
  RingAttentionThreads(run, in, out.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                       dvt.view(), ds);
  ApiResult r;
  r.out = ToDoubles(out.view());
  r.lse = ToDoubles(lse.view());
  r.dq = ToDoubles(dq.view());
  r.dk = ToDoubles(dk.view());
  r.dv = ToDoubles(dvt.view());
  if (in.sinks.defined()) r.dsinks = ToDoubles(dsinks.view());
  return r;
}

// Checks `api` against one direction of the poison rule for inputs `in`
// (poisoned) and dout, on the forward outputs (out, lse) or the gradients.
// rounds_p: the run's path rounded P to bf16 for P V (RoundsBf16Operands),
// so clean rows of out may err by 2^-8 max|v| more (accuracy.cc's model).
enum class Outputs { kForward, kBackward };
void ExpectPoisonRule(const OwnedInputs& in, const AttentionOptions& opt, const Tensor& dout,
                      const ApiResult& api, const std::string& what, PoisonCheck check,
                      Outputs which, bool rounds_p = false) {
  const AttentionInputs ai = in.inputs();
  const PoisonMap pm = PoisonMap::Of(ai, opt, &dout);
  const OwnedInputs clean = CleanCopy(in);
  const Tensor clean_dout = CleanCopy(dout);
  const RefResult ref = RunReference(clean, opt, &clean_dout);
  const double out_tol =
      kOutTol + (rounds_p ? PRoundingSlack(ToDoubles(clean.v.view()), ref.fwd.out) : 0.0);
  const int64_t sq = ai.q.shape[1], h = ai.q.shape[2], d = ai.q.shape[3];
  const int64_t dv = ai.v.shape[3];
  // [B, Sq, H, X] element -> [B, H, Sq] row flag.
  auto bsh_row = [&](int64_t x) {
    return [=](int64_t idx) {
      const int64_t r = idx / x;  // (b * Sq + i) * H + head
      const int64_t head = r % h, i = (r / h) % sq, b = r / (h * sq);
      return (b * h + head) * sq + i;
    };
  };
  auto per = [](int64_t x) { return [=](int64_t idx) { return idx / x; }; };
  std::string errors;
  if (which == Outputs::kForward) {
    errors += CheckPoisonPattern(api.out, ref.fwd.out, pm.out, bsh_row(dv), out_tol, "out", check);
    errors += CheckPoisonPattern(api.lse, ref.fwd.lse, pm.lse, per(1), kOutTol, "lse", check);
  } else {
    errors += CheckPoisonPattern(api.dq, ref.bwd.dq, pm.dq, bsh_row(d), kGradTol, "dq", check);
    errors += CheckPoisonPattern(api.dk, ref.bwd.dk, pm.dk, per(d), kGradTol, "dk", check);
    errors += CheckPoisonPattern(api.dv, ref.bwd.dv, pm.dv, per(dv), kGradTol, "dv", check);
    if (ai.sinks.defined()) {
      errors += CheckPoisonPattern(api.dsinks, ref.bwd.dsinks, pm.dsinks, per(1), kGradTol,
                                   "dsinks", check);
    }
  }
  EXPECT_EQ(errors, "") << what;
}

struct PoisonCase {
  std::string name;
  Mask mask;
  bool segments = false;
  bool sinks = false;
  // Applied to the (finite) random inputs and dout.
  void (*poison)(OwnedInputs&, Tensor& dout) = nullptr;
};

std::vector<PoisonCase> PoisonCases() {
  return {
      {"NaN in one q row, causal", Mask::Causal(), false, false,
       [](OwnedInputs& in, Tensor&) { SetRow(in.q, 0, 37, 1, kNaN); }},
      {"+Inf in one k row, causal (rows before it share its tiles)", Mask::Causal(), false, false,
       [](OwnedInputs& in, Tensor&) { SetRow(in.k, 0, 50, 0, kInf); }},
      {"NaN in one v row, local window", Mask::Local(10, 10), false, false,
       [](OwnedInputs& in, Tensor&) { SetRow(in.v, 0, 50, 0, kNaN); }},
      {"-Inf in k and NaN in v of one key, segments", Mask::Full(), true, false,
       [](OwnedInputs& in, Tensor&) {
         SetRow(in.k, 0, 20, 0, -kInf);
         SetRow(in.v, 0, 20, 0, kNaN);
       }},
      {"NaN in one dout row, causal + sinks", Mask::Causal(), false, true,
       [](OwnedInputs&, Tensor& dout) { SetRow(dout, 0, 70, 1, kNaN); }},
      {"NaN q rows without any allowed key (inside partial tiles)", Mask::Causal(-50), false, false,
       [](OwnedInputs& in, Tensor&) {
         SetRow(in.q, 0, 40, 0, kNaN);
         SetRow(in.q, 0, 41, 1, kInf);
       }},
      // Keys 46.. pair with no query (row 95 sees keys <= 45) but share a
      // computed tile with key 45: only the kernels' own check of the k/v
      // rows they read can catch these (no out, lse or delta shows them).
      {"Inf k and NaN v rows without any allowed key pair (inside partial tiles)",
       Mask::Causal(-50), false, false,
       [](OwnedInputs& in, Tensor&) {
         SetRow(in.k, 0, 46, 1, kInf);
         SetRow(in.v, 0, 47, 0, kNaN);
       }},
  };
}

OwnedInputs PoisonProblem(const PoisonCase& c, Tensor* dout) {
  ProblemSpec spec;
  spec.b = 1;
  spec.sq = 96;
  spec.skv = 96;
  // Two kv heads: K rows strided by the other head, so the forward reads
  // K and V through its per-thread tile copies (and checks those).
  spec.h = 4;
  spec.hkv = 2;
  spec.d = 16;
  spec.dv = 16;
  spec.sinks = c.sinks;
  spec.segments = c.segments;
  Rng rng(2024);
  OwnedInputs in = RandomInputs(rng, spec);
  *dout = RandomTensor(rng, DType::kF32, OutShape(in));
  c.poison(in, *dout);
  return in;
}

// Runs every poison case on every kernel path and two tilings, and on rings
// of 3 thread ranks, and checks one direction of the rule on one set of
// outputs.
void CheckAllPoisonCases(PoisonCheck check, Outputs which) {
  for (const PoisonCase& c : PoisonCases()) {
    Tensor dout;
    const OwnedInputs in = PoisonProblem(c, &dout);
    const PoisonMap pm = PoisonMap::Of(in.inputs(), WithMask(c.mask), &dout);
    if (c.name.find("without any allowed key") == std::string::npos) {
      // The case really poisons something and leaves something clean.
      EXPECT_GT(pm.count_out() + std::count(pm.dq.begin(), pm.dq.end(), 1), 0) << c.name;
      EXPECT_LT(pm.count_out(), static_cast<int64_t>(pm.out.size())) << c.name;
    }
    for (KernelPath path : SupportedKernelPaths()) {
      for (const BlockSizes blocks : {BlockSizes{}, BlockSizes{16, 32}}) {
        AttentionOptions opt;
        opt.mask = c.mask;
        opt.kernel_path = path;
        opt.block_sizes = blocks;
        opt.num_threads = 2;
        const ApiResult api = RunAttention(in, opt, &dout);
        ExpectPoisonRule(in, opt, dout, api,
                         c.name + ", path " + KernelPathName(path) + ", blocks " +
                             std::to_string(blocks.q) + "x" + std::to_string(blocks.kv),
                         check, which);
      }
    }
    AttentionOptions opt;
    opt.mask = c.mask;
    opt.block_sizes = {16, 16};
    for (Layout layout : {Layout::kContiguous, Layout::kZigzag}) {
      const ApiResult api = RunRingThreads(in, opt, dout, 3, layout);
      ExpectPoisonRule(in, opt, dout, api, c.name + ", ring of 3, " + LayoutName(layout), check,
                       which);
    }
    // 12 query rows per rank and q blocks of 32: every step's forward stacks
    // the two query heads of each kv head into rows (decode/stacked_heads.h).
    opt.block_sizes = {32, 32};
    const ApiResult api = RunRingThreads(in, opt, dout, 8, Layout::kZigzag);
    ExpectPoisonRule(in, opt, dout, api, c.name + ", ring of 8, stacked heads", check, which);
  }
}

// A non-finite input never reaches a forward output that does not depend on
// it — in particular not through a masked entry of a partially masked tile
// (P = 0 times a NaN/Inf value, or a NaN logit that the mask removes).
TEST(NumericsPoison, ForwardConfinedToDependentRows) {
  CheckAllPoisonCases(PoisonCheck::kConfinement, Outputs::kForward);
}

// The same for the gradients (dS K, dS^T Q and P^T dO over masked entries).
TEST(NumericsPoison, BackwardConfinedToDependentRows) {
  CheckAllPoisonCases(PoisonCheck::kConfinement, Outputs::kBackward);
}

// A row that does depend on a non-finite input is non-finite: the NaN is
// reported, not silently turned into an empty row (out 0, lse -inf) or a
// finite value.
TEST(NumericsPoison, DependentForwardRowsAreNonFinite) {
  CheckAllPoisonCases(PoisonCheck::kPropagation, Outputs::kForward);
}

TEST(NumericsPoison, DependentGradientsAreNonFinite) {
  CheckAllPoisonCases(PoisonCheck::kPropagation, Outputs::kBackward);
}

// Decoding-sized calls: 4 query rows of an MQA group run stacked (one head
// of 16 rows, decode/stacked_heads.h), or of 4 MHA heads taken together kv tile by
// kv tile (ForwardHeadsTogether), split over ranges of kv tiles
// (ForwardKvSplits); one query row runs in decoding mode on the AVX-512/AVX2
// paths (UseDecodeStep: its kernel's check is the logits and accumulators it
// computes). The NaN/Inf check must still see every row it reads: a NaN key
// or an infinite value the mask rules out stays out — in a tile no query
// computes, or inside one that is computed (alone: nothing else makes the
// call redo) — and an infinite value, a key whose logit is -inf (one
// infinite element against a negative query element: not to be taken for a
// masked key), a NaN key under a soft cap and a NaN query reach exactly
// their rows.
void StackedOrTogetherDecodingStep(const ProblemSpec& spec) {
  AttentionOptions opt;
  opt.mask = Mask::Local(std::nullopt, 250);  // key <= q + 250; q at 0..3
  opt.block_sizes = {16, 16};
  opt.num_threads = 2;
  const int64_t q_row = std::min<int64_t>(2, spec.sq - 1);
  for (const std::string scenario : {"masked keys", "masked value", "inf value", "-inf logit",
                                     "NaN key, soft cap", "NaN query"}) {
    Rng rng(2025);
    OwnedInputs in = RandomInputs(rng, spec);
    const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
    if (scenario == "masked keys") {
      SetRow(in.k, 0, 300, 0, kNaN);  // in a tile no query computes
      SetRow(in.k, 0, 255, 0, kNaN);  // in tile [240, 256), computed
    }
    if (scenario == "masked value") SetRow(in.v, 0, 254, 0, kInf);  // in tile [240, 256)
    if (scenario == "inf value") SetRow(in.v, 0, 100, 0, kInf);     // seen by every query
    if (scenario == "-inf logit") {
      const TensorView k = in.k.view(), q = in.q.view();
      StoreFromF32(k, k.Offset(0, 120, 0, 0), kInf);
      StoreFromF32(q, q.Offset(0, q_row, 0, 0), -1.0f);
    }
    // The soft cap's tanh maps NaN to a finite logit: the check must come first.
    opt.softcap = scenario == "NaN key, soft cap" ? std::optional<float>(30.0f) : std::nullopt;
    if (scenario == "NaN key, soft cap") SetRow(in.k, 0, 120, 0, kNaN);
    if (scenario == "NaN query") SetRow(in.q, 0, q_row, 1, kNaN);
    for (KernelPath path : SupportedKernelPaths()) {
      opt.kernel_path = path;
      const ApiResult api = RunAttention(in, opt, &dout);
      const std::string what = std::string(spec.sq == 1    ? "one row"
                                           : spec.hkv == 1 ? "stacked"
                                                           : "heads together") +
                               " decoding, " + DTypeName(spec.dtype) + ", path " +
                               KernelPathName(path) + ", " + scenario;
      for (const PoisonCheck check : {PoisonCheck::kConfinement, PoisonCheck::kPropagation}) {
        ExpectPoisonRule(in, opt, dout, api, what, check, Outputs::kForward,
                         RoundsBf16Operands(path, spec.dtype));
      }
    }
  }
}

TEST(NumericsPoison, StackedAndSplitDecodingSteps) {
  for (const int64_t sq : {4, 1}) {
    for (const int64_t hkv : {1, 4}) {
      // bf16 too: the decoding kernel reads bf16 K and V rows in place, and
      // the tile loop reads them as bf16 pairs on avx512_bf16 and amx.
      for (const DType dtype : {DType::kF32, DType::kBF16}) {
        ProblemSpec spec(1, sq, 400, 4, hkv, 16, 16);
        spec.dtype = dtype;
        StackedOrTogetherDecodingStep(spec);
      }
      // D = Dv = 32: the AVX-512 step reads bf16 rows as word pairs.
      ProblemSpec pairs(1, sq, 400, 4, hkv, 32, 32);
      pairs.dtype = DType::kBF16;
      StackedOrTogetherDecodingStep(pairs);
    }
  }
}

// 16-bit inputs reach the forward's NaN/Inf check along other roads: widened
// to f32 before the Q^T transpose (which flags them) and as K/V tiles are
// copied or packed on the f32 kernel paths, read as bf16 pairs and checked
// separately on avx512_bf16. NaN and inf stay what
// they are in bf16 and f16, so the same rows must come out non-finite — and
// only those: a check that missed a value would leave it in a product,
// where it reaches rows that do not depend on it.
TEST(NumericsPoison, ForwardPoisonRuleWith16BitInputs) {
  for (const PoisonCase& c : PoisonCases()) {
    Tensor dout;
    const OwnedInputs f32 = PoisonProblem(c, &dout);
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      const OwnedInputs in = ConvertInputs(f32, dtype);
      for (KernelPath path : SupportedKernelPaths()) {
        AttentionOptions opt;
        opt.mask = c.mask;
        opt.kernel_path = path;
        opt.block_sizes = {16, 32};
        opt.num_threads = 2;
        const ApiResult api = RunAttention(in, opt, nullptr);
        for (const PoisonCheck check : {PoisonCheck::kConfinement, PoisonCheck::kPropagation}) {
          ExpectPoisonRule(in, opt, dout, api,
                           c.name + ", " + DTypeName(dtype) + ", path " + KernelPathName(path),
                           check, Outputs::kForward, RoundsBf16Operands(path, dtype));
        }
      }
    }
  }
}

// Sinks are parameters, not data: a NaN or +inf sink is refused up front
// with an Error naming sinks[h] (validate.cc) instead of poisoning a whole
// head; -inf is "no sink for this head" (NumericsSinks below).
TEST(NumericsPoison, NanAndPlusInfSinksAreRefused) {
  Rng rng(5);
  ProblemSpec spec(1, 16, 16, 2, 2, 16, 16);
  spec.sinks = true;
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    OwnedInputs in = RandomInputs(rng, spec);
    in.sinks.data_as<float>()[1] = bad;
    Tensor out(DType::kF32, {1, 16, 2, 16}), lse(DType::kF32, {1, 2, 16});
    try {
      AttentionForward(in.inputs(), AttentionOptions{}, out.view(), lse.view());
      ADD_FAILURE() << "a sink of " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("sinks[1]: expected a finite value or -inf", 0), 0u)
          << e.what();
    }
  }
}

// ---- Large logits -------------------------------------------------------

// q and k hold integers in [-100, 100] and D = 16, so every dot product is
// exact in f32 (|sum| <= 1.6e5 < 2^24) and in bf16/f16 storage; with the
// default scale 1/4 (exact) the logits are exact integers/4 of magnitude up
// to ~1e4. The only rounding left is in exp() and the sums: the kernels may
// form s * log2(e) in f32, an absolute exponent error of about
// |s| * 2u ~ 1e4 * 1.2e-7 = 1.2e-3 per logit, which moves each probability by
// that relative amount; out moves by at most ~2 * that * max|v| and the
// gradients by a few times that relative to their largest value. Tolerances:
// out 1e-2 * max|v|, lse 1e-5 * max|lse|, gradients 2e-2 * their max. An
// overflow (exp(1e4) = inf) gives inf/NaN; a wrong row under such a peaked
// softmax picks another v row: errors of O(1).
OwnedInputs LargeLogitProblem(DType dtype, bool sinks, Rng& rng) {
  ProblemSpec spec;
  spec.b = 1;
  spec.sq = 128;
  spec.skv = 128;
  spec.h = 2;
  spec.hkv = 1;
  spec.d = 16;
  spec.dv = 16;
  spec.sinks = sinks;
  OwnedInputs in = RandomInputs(rng, spec);
  std::uniform_int_distribution<int> dist(-100, 100);
  auto integers = [&](Tensor& t) {
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (double& x : v) x = dist(rng);
    t = TensorFromDoubles(v, dtype, t.shape());
  };
  integers(in.q);
  integers(in.k);
  in.v = TensorFromDoubles(ToDoubles(in.v.view()), dtype, in.v.shape());
  if (sinks) {
    // Head 0's sink lies above every logit: it takes nearly all of each
    // row's probability (out ~ 0, lse ~ the sink). Head 1's lies at the
    // median of its rows' lse without a sink, so it shares the denominator
    // with the keys in about half the rows and dsinks[1] is far from 0 (the
    // test checks that under the full mask): a dsinks counted twice, or
    // lost, shows.
    AttentionInputs no_sinks = in.inputs();
    no_sinks.sinks = TensorView();
    const RefForward plain = ReferenceForward(MakeRefProblem(no_sinks, AttentionOptions{}));
    std::vector<double> lse1(plain.lse.begin() + spec.sq, plain.lse.begin() + 2 * spec.sq);
    std::nth_element(lse1.begin(), lse1.begin() + spec.sq / 2, lse1.end());
    const float s[] = {1.2e4f, static_cast<float>(lse1[static_cast<size_t>(spec.sq / 2)])};
    std::memcpy(in.sinks.data(), s, sizeof s);
  }
  return in;
}

double MaxAbsLogit(const OwnedInputs& in) {
  const RefProblem p = MakeRefProblem(in.inputs(), AttentionOptions{});
  double m = 0;
  for (int64_t i = 0; i < p.sq; ++i) {
    for (int64_t h = 0; h < p.h; ++h) {
      for (int64_t j = 0; j < p.skv; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < p.d; ++e) {
          dot += p.q[((i * p.h) + h) * p.d + e] * p.k[(j * p.hkv + h / (p.h / p.hkv)) * p.d + e];
        }
        m = std::max(m, std::fabs(p.scale * dot));
      }
    }
  }
  return m;
}

void ExpectLargeLogitsMatch(const ApiResult& api, const RefResult& ref, const OwnedInputs& in,
                            const std::string& what) {
  const double max_v = MaxAbs(ToDoubles(in.v.view()));
  const Comparison out = Compare(api.out, ref.fwd.out);
  const Comparison lse = Compare(api.lse, ref.fwd.lse);
  EXPECT_FALSE(out.nonfinite_mismatch) << what << ": out " << out.Describe();
  EXPECT_FALSE(lse.nonfinite_mismatch) << what << ": lse " << lse.Describe();
  EXPECT_LE(out.max_abs_err, 1e-2 * max_v) << what << ": out " << out.Describe();
  EXPECT_LE(lse.Relative(1.0), 1e-5) << what << ": lse " << lse.Describe();
  const std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>
      grads[] = {{"dq", {&api.dq, &ref.bwd.dq}},
                 {"dk", {&api.dk, &ref.bwd.dk}},
                 {"dv", {&api.dv, &ref.bwd.dv}},
                 {"dsinks", {&api.dsinks, &ref.bwd.dsinks}}};
  // Measured against the sum of each gradient's terms' magnitudes where
  // that is larger (Errors): under such peaked softmaxes the gradients
  // cancel to ~1e-4 where a sink or a second key holds a small share, while
  // their terms are O(10), and the f32 lse (rounded by up to 5e-4 at |lse| ~
  // 8000) moves each p by that much relative to it, i.e. the terms.
  const Errors e = ErrorsOf(api, ref);
  const double errs[] = {e.dq, e.dk, e.dv, e.dsinks};
  for (size_t g = 0; g < std::size(grads); ++g) {
    EXPECT_LE(errs[g], 2e-2) << what << ": " << grads[g].first << " "
                             << Compare(*grads[g].second.first, *grads[g].second.second).Describe()
                             << " (" << e.Describe() << ")";
  }
}

TEST(NumericsLargeLogits, NoOverflowWithoutSoftCap) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool sinks : {false, true}) {
      Rng rng(55);
      const OwnedInputs in = LargeLogitProblem(dtype, sinks, rng);
      const double max_logit = MaxAbsLogit(in);
      ASSERT_GT(max_logit, 5e3) << "the test must really reach logits of order 1e4";
      ASSERT_LT(max_logit, 4e4);
      const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
      for (const Mask& mask : {Mask::Full(), Mask::Causal()}) {
        AttentionOptions opt;
        opt.mask = mask;
        const RefResult ref = RunReference(in, opt, &dout);
        if (sinks && mask.ToString() == "full") {
          // Not vacuous: head 1's sink shares the denominator of the rows
          // whose lse lies near it (the median row: half of it), so its
          // gradient is of the order of those rows' D_i = dout_i . out_i.
          EXPECT_GT(std::fabs(ref.bwd.dsinks[1]), 1e-2);
        }
        for (KernelPath path : SupportedKernelPaths()) {
          opt.kernel_path = path;
          const std::string what = std::string(DTypeName(dtype)) + (sinks ? " sinks " : " ") +
                                   mask.ToString() + " path " + KernelPathName(path) +
                                   ", max |logit| " + std::to_string(max_logit);
          ExpectLargeLogitsMatch(RunAttention(in, opt, &dout), ref, in, what);
        }
        // The ring merges partial (out, lse) pairs whose lse differ by ~1e4.
        ExpectLargeLogitsMatch(RunRingThreads(in, opt, dout, 4, Layout::kZigzag), ref, in,
                               std::string(DTypeName(dtype)) + " ring of 4, " + mask.ToString());
      }
    }
  }
}

// ---- Fully masked rows --------------------------------------------------

// Rows with no allowed key: out exactly 0, lse exactly -inf (or exactly the
// sink), dq exactly 0, keys nobody attends to get dk = dv = 0, and no NaN
// anywhere; the rest matches the reference (kOutTol / kGradTol as above;
// 16-bit inputs only change the values, which the reference sees as stored,
// except on a path that rounds P to bf16 for P V: `path`, see below).
// `grads_on_ref_out`: the errors of the same backward given the reference's
// out and lse (BackwardOnReference, RingBackwardOnReference), needed where
// `path` rounds P.
void ExpectEmptyRowsClean(const OwnedInputs& in, const ApiResult& api, const RefResult& ref,
                          KernelPath path, const std::string& what,
                          const Errors* grads_on_ref_out) {
  const AttentionInputs ai = in.inputs();
  const int64_t sq = ai.q.shape[1], h = ai.q.shape[2], dv = ai.v.shape[3], d = ai.q.shape[3];
  int64_t empty_rows = 0;
  for (size_t r = 0; r < ref.fwd.lse.size(); ++r) {
    const bool empty = ref.fwd.lse[r] == -kInf;
    const int64_t head = static_cast<int64_t>(r) / sq % h;
    const bool sink_only = ai.sinks.defined() &&
                           ref.fwd.lse[r] == static_cast<double>(in.sinks.data_as<float>()[head]);
    if (!empty && !sink_only) continue;
    ++empty_rows;
    if (empty) {
      EXPECT_EQ(api.lse[r], -kInf) << what << " lse row " << r;
    } else {
      EXPECT_NEAR(api.lse[r], ref.fwd.lse[r], 1e-6) << what << " lse row " << r;
    }
    const int64_t b = static_cast<int64_t>(r) / (h * sq), i = static_cast<int64_t>(r) % sq;
    for (int64_t e = 0; e < dv; ++e) {
      EXPECT_EQ(api.out[static_cast<size_t>(((b * sq + i) * h + head) * dv + e)], 0.0)
          << what << " out row " << r;
    }
    for (int64_t e = 0; e < d; ++e) {
      EXPECT_EQ(api.dq[static_cast<size_t>(((b * sq + i) * h + head) * d + e)], 0.0)
          << what << " dq row " << r;
    }
  }
  EXPECT_GT(empty_rows, 0) << what << ": the case must have empty rows";
  // A head whose sink is -inf has no sink: exp(-inf - lse) = 0 in every
  // term of its dsinks, exactly (also where lse is -inf: no NaN).
  for (int64_t head = 0; ai.sinks.defined() && head < h; ++head) {
    if (in.sinks.data_as<float>()[head] == -std::numeric_limits<float>::infinity()) {
      EXPECT_EQ(api.dsinks[static_cast<size_t>(head)], 0.0) << what << " dsinks " << head;
    }
  }
  for (const std::vector<double>* v :
       {&api.out, &api.lse, &api.dq, &api.dk, &api.dv, &api.dsinks}) {
    EXPECT_FALSE(HasNaN(*v)) << what;
  }
  for (size_t x = 0; x < ref.bwd.dk.size(); ++x) {
    if (ref.bwd.dk[x] == 0.0) {
      EXPECT_EQ(api.dk[x], 0.0) << what << " dk " << x;
    }
  }
  for (size_t x = 0; x < ref.bwd.dv.size(); ++x) {
    if (ref.bwd.dv[x] == 0.0) {
      EXPECT_EQ(api.dv[x], 0.0) << what << " dv " << x;
    }
  }
  // Every path and dtype computes in f32 on the stored inputs, except that
  // avx512_bf16 and amx round P to bf16 (relative 2^-8) for P V with bf16
  // inputs: out then errs by up to 2^-8 max|v| more (PRoundingSlack,
  // relative to ErrorsOf's measure). dout is f32 here, so the backward's
  // products stay f32 (accuracy.h, RoundsBf16Operands), but D = dout . out
  // carries out's rounding into every gradient: there the gradients are held
  // to kGradTol on the reference's out and lse instead (the own run's are
  // checked above for exact zeros and NaN).
  const bool rounds = RoundsBf16Operands(path, ai.q.dtype);
  const Errors e = ErrorsOf(api, ref);
  const double out_slack =
      rounds ? PRoundingSlack(ToDoubles(in.v.view()), ref.fwd.out, kMagnitudeFloor) : 0.0;
  EXPECT_LT(e.out, kOutTol + out_slack) << what << ": " << e.Describe();
  EXPECT_LT(e.lse, kOutTol) << what << ": " << e.Describe();
  ASSERT_TRUE(!rounds || grads_on_ref_out != nullptr) << what;
  const Errors& g = rounds ? *grads_on_ref_out : e;
  EXPECT_LT(std::max({g.dq, g.dk, g.dv, g.dsinks}), kGradTol)
      << what << (rounds ? " (backward on the reference's out): " : ": ") << g.Describe();
}

TEST(NumericsEmptyRows, SingleDeviceAndRing) {
  struct Case {
    std::string name;
    Mask mask;
    bool sinks, segments;
    bool minus_inf_sink = false;  // head 1's sink is -inf: no sink for it
  };
  const Case cases[] = {
      {"causal:-40 (first 40 rows empty)", Mask::Causal(-40), false, false},
      {"causal:-40 with sinks", Mask::Causal(-40), true, false},
      {"causal:-40, sinks, head 1's -inf", Mask::Causal(-40), true, false, true},
      {"segments with ids no key has", Mask::Full(), false, true},
      {"everything masked", Mask::Causal(-1000), false, false},
      {"everything masked, sinks", Mask::Causal(-1000), true, false},
      {"everything masked, sinks, head 1's -inf", Mask::Causal(-1000), true, false, true},
  };
  for (const Case& c : cases) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      ProblemSpec spec;
      spec.b = 2;
      spec.sq = 96;
      spec.skv = 96;
      spec.h = 2;
      spec.hkv = 2;
      spec.d = 16;
      spec.dv = 8;
      spec.dtype = dtype;
      spec.sinks = c.sinks;
      Rng rng(8);
      OwnedInputs in = RandomInputs(rng, spec);
      if (c.minus_inf_sink) in.sinks.data_as<float>()[1] = -std::numeric_limits<float>::infinity();
      if (c.segments) {
        // q ids 0..2, kv ids 1..3: q rows of document 0 have no key at all.
        in.q_seg = RandomSegments(rng, spec.b, spec.sq, 3, 0);
        in.kv_seg = RandomSegments(rng, spec.b, spec.skv, 3, 1);
      }
      const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
      AttentionOptions opt;
      opt.mask = c.mask;
      const RefResult ref = RunReference(in, opt, &dout);
      const std::string what = c.name + " " + DTypeName(dtype);
      const bool rounds_auto = RoundsBf16Operands(KernelPath::kAuto, dtype);
      for (KernelPath path : SupportedKernelPaths()) {
        opt.kernel_path = path;
        const Errors on_ref =
            RoundsBf16Operands(path, dtype) ? BackwardOnReference(in, opt, dout, ref) : Errors{};
        ExpectEmptyRowsClean(in, RunAttention(in, opt, &dout), ref, path,
                             what + " path " + KernelPathName(path), &on_ref);
      }
      opt.kernel_path = KernelPath::kAuto;
      for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped}) {
        // RunRingThreads' one kernel thread per rank.
        AttentionOptions ring_opt = opt;
        ring_opt.num_threads = 1;
        const Errors on_ref =
            rounds_auto ? RingBackwardOnReference(in, ring_opt, dout, ref, 4, layout) : Errors{};
        ExpectEmptyRowsClean(in, RunRingThreads(in, opt, dout, 4, layout), ref, KernelPath::kAuto,
                             what + " ring of 4 " + LayoutName(layout), &on_ref);
      }
    }
  }
}

// ---- Sinks of -inf -----------------------------------------------------

// A sink of -inf is "no sink for this head" (SPEC §2.4): exp(-inf) = 0 joins
// the denominator. So a call whose sinks are all -inf must equal the same
// call without sinks BITWISE (out, lse, dq, dk, dv: the sink step leaves
// such rows as they are), with dsinks exactly 0 — on every kernel path, for
// f32 and for bf16 inputs with a bf16 out (which the kernel writes itself,
// applying sinks row by row), single device and rings of 3 in each layout.
// Empty rows are included (causal:-20: rows 0..19 have no key). The mixed
// case (one finite sink, one -inf) is checked against the f64 reference by
// NumericsEmptyRows above.
TEST(NumericsSinks, MinusInfSinksEqualNoSinksBitwise) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    ProblemSpec spec(2, 48, 48, 4, 2, 16, 8);
    spec.dtype = dtype;
    spec.sinks = true;
    Rng rng(21);
    OwnedInputs with = RandomInputs(rng, spec);
    for (int64_t h = 0; h < spec.h; ++h) {
      with.sinks.data_as<float>()[h] = -std::numeric_limits<float>::infinity();
    }
    OwnedInputs without = ConvertInputs(with, dtype);
    without.sinks = Tensor();
    const Tensor dout = RandomTensor(rng, dtype, OutShape(with));
    AttentionOptions opt;
    opt.mask = Mask::Causal(-20);
    opt.block_sizes = {16, 16};
    ApiRun run;
    run.out_dtype = dtype;
    auto expect_same = [&](const ApiResult& a, const ApiResult& b, const std::string& what) {
      EXPECT_EQ(a.out, b.out) << what;
      EXPECT_EQ(a.lse, b.lse) << what;
      EXPECT_EQ(a.dq, b.dq) << what;
      EXPECT_EQ(a.dk, b.dk) << what;
      EXPECT_EQ(a.dv, b.dv) << what;
      EXPECT_EQ(a.dsinks, std::vector<double>(static_cast<size_t>(spec.h), 0.0)) << what;
      EXPECT_EQ(a.lse[0], -kInf) << what << ": row 0 has no key and no sink";
    };
    for (KernelPath path : SupportedKernelPaths()) {
      opt.kernel_path = path;
      const std::string what = std::string(DTypeName(dtype)) + " path " + KernelPathName(path);
      expect_same(RunAttention(with, opt, &dout, run), RunAttention(without, opt, &dout, run),
                  what);
    }
    opt.kernel_path = KernelPath::kAuto;
    for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped}) {
      expect_same(RunRingThreads(with, opt, dout, 3, layout),
                  RunRingThreads(without, opt, dout, 3, layout),
                  std::string(DTypeName(dtype)) + " ring of 3 " + LayoutName(layout));
    }
  }
}

// ---- f16 overflow -------------------------------------------------------

// An f16 gradient whose value exceeds the f16 range (65504) must be reported
// (an Error naming the output), not silently stored as infinity. Here dv_0 =
// sum_i p_i0 dout_i with a single key (p = 1) and 128 rows of dout = 1000:
// dv_0 = 128000 in every element. q, k, v, dout are all representable in f16.
TEST(NumericsF16, GradientOverflowIsReported) {
  const int64_t sq = 128;
  Tensor q(DType::kF16, {1, sq, 1, 16}), k(DType::kF16, {1, 1, 1, 16});
  Tensor v(DType::kF16, {1, 1, 1, 16}), dout(DType::kF16, {1, sq, 1, 16});
  FromDoubles(std::vector<double>(static_cast<size_t>(dout.numel()), 1000.0), dout.view());
  FromDoubles(std::vector<double>(16, 1.0), v.view());
  AttentionInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  Tensor out(DType::kF16, {1, sq, 1, 16}), lse(DType::kF32, {1, 1, sq});
  AttentionForward(in, AttentionOptions{}, out.view(), lse.view());
  Tensor dq(DType::kF16, {1, sq, 1, 16}), dk(DType::kF16, {1, 1, 1, 16});
  Tensor dv(DType::kF16, {1, 1, 1, 16});
  try {
    AttentionBackward(in, AttentionOptions{}, out.view(), lse.view(), dout.view(), dq.view(),
                      dk.view(), dv.view(), TensorView());
    ADD_FAILURE() << "dv = 128000 does not fit in f16 (max 65504) but no Error was thrown; dv[0] "
                  << "was stored as " << LoadAsF32(dv.view(), 0);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("dv", 0), 0u) << e.what();
  }
  // The same call with f32 gradients is fine and exact.
  Tensor dv32(DType::kF32, {1, 1, 1, 16}), dq32(DType::kF32, {1, sq, 1, 16});
  Tensor dk32(DType::kF32, {1, 1, 1, 16});
  AttentionBackward(in, AttentionOptions{}, out.view(), lse.view(), dout.view(), dq32.view(),
                    dk32.view(), dv32.view(), TensorView());
  EXPECT_EQ(dv32.data_as<float>()[0], 128000.0f);
}

}  // namespace
}  // namespace ringsplash::testing

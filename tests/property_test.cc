// Randomised configurations (fixed seed) of the public API against the f64
// reference: batch, lengths, heads, GQA ratio, head dims, dtype, a random
// mask expression (leaves of every kind, & and |, dense, per-head), sinks,
// soft cap, segments, global positions (shifted or striped), block sizes,
// threads and kernel path. Forward and backward. Each failure prints its
// configuration so it can be reproduced. Tolerances: tests/support/accuracy.h,
// and a check that its low-precision bounds are tight enough to fail.
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "tests/support/accuracy.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

constexpr int kConfigs = 200;

int64_t Pick(Rng& rng, std::initializer_list<int64_t> values) {
  std::uniform_int_distribution<size_t> d(0, values.size() - 1);
  return *(values.begin() + d(rng));
}
int64_t Uniform(Rng& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool Coin(Rng& rng, double p) { return std::bernoulli_distribution(p)(rng); }

// A structured leaf (no dense): causal, local, chunked or full.
Mask StructuredLeaf(Rng& rng) {
  switch (Uniform(rng, 0, 3)) {
    case 0:
      return Mask::Causal(Uniform(rng, -8, 8));
    case 1: {
      auto side = [&rng]() -> std::optional<int64_t> {
        if (Coin(rng, 0.2)) return std::nullopt;
        return Uniform(rng, 0, 20);
      };
      return Mask::Local(side(), side(), Uniform(rng, -6, 6));
    }
    case 2:
      return Mask::ChunkedCausal(Uniform(rng, 1, 20));
    default:
      return Mask::Full();
  }
}

// Any leaf. Dense leaves cover global positions [0, extent_q) x [0, extent_kv).
Mask Leaf(Rng& rng, int64_t h, int64_t extent_q, int64_t extent_kv) {
  const int64_t kind = Uniform(rng, 0, 9);
  if (kind <= 5) return StructuredLeaf(rng);
  if (kind <= 7) {
    const int64_t heads = Coin(rng, 0.5) ? 0 : h;
    const double p = std::uniform_real_distribution<double>(0.05, 0.9)(rng);
    std::vector<uint8_t> values(
        static_cast<size_t>(std::max<int64_t>(heads, 1) * extent_q * extent_kv));
    for (uint8_t& x : values) x = Coin(rng, p) ? 1 : 0;
    return Mask::Dense(std::move(values), heads, extent_q, extent_kv);
  }
  std::vector<Mask> per_head;
  for (int64_t i = 0; i < h; ++i) per_head.push_back(StructuredLeaf(rng));
  return Mask::PerHead(std::move(per_head));
}

Mask RandomMask(Rng& rng, int depth, int64_t h, int64_t extent_q, int64_t extent_kv) {
  if (depth == 0 || Coin(rng, 0.5)) return Leaf(rng, h, extent_q, extent_kv);
  const Mask a = RandomMask(rng, depth - 1, h, extent_q, extent_kv);
  const Mask b = RandomMask(rng, depth - 1, h, extent_q, extent_kv);
  return Coin(rng, 0.5) ? (a & b) : (a | b);
}

// Global positions of `n` rows: 0..n-1, shifted, or striped.
std::vector<int64_t> RandomPositions(Rng& rng, int64_t n, std::string& how) {
  std::vector<int64_t> pos;
  const int64_t kind = Uniform(rng, 0, 3);
  if (kind <= 1) {
    how += "default";
    return pos;
  }
  if (kind == 2) {
    const int64_t shift = Uniform(rng, 1, 20);
    for (int64_t i = 0; i < n; ++i) pos.push_back(shift + i);
    how += "shift " + std::to_string(shift);
  } else {
    const int64_t stride = Uniform(rng, 2, 4), phase = Uniform(rng, 0, stride - 1);
    for (int64_t i = 0; i < n; ++i) pos.push_back(stride * i + phase);
    how += "stride " + std::to_string(stride) + " phase " + std::to_string(phase);
  }
  return pos;
}

TEST(PropertyTest, RandomConfigurationsMatchReference) {
  Rng rng(20240601);
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  int failures = 0;
  for (int config = 0; config < kConfigs; ++config) {
    ProblemSpec spec;
    spec.b = Uniform(rng, 1, 2);
    spec.sq = Uniform(rng, 1, 80);
    spec.skv = Uniform(rng, 1, 80);
    spec.hkv = Uniform(rng, 1, 3);
    spec.h = spec.hkv * Uniform(rng, 1, 3);
    spec.d = Pick(rng, {1, 3, 8, 16, 17, 32, 64});
    spec.dv = Coin(rng, 0.5) ? spec.d : Pick(rng, {1, 5, 16, 24, 64});
    spec.dtype = static_cast<DType>(
        Pick(rng, {static_cast<int64_t>(DType::kF32), static_cast<int64_t>(DType::kF32),
                   static_cast<int64_t>(DType::kBF16), static_cast<int64_t>(DType::kF16)}));
    spec.sinks = Coin(rng, 0.4);
    spec.segments = Coin(rng, 0.3);
    spec.bhsd = Coin(rng, 0.2);
    spec.qk_range = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
    OwnedInputs in = RandomInputs(rng, spec);
    std::string positions = "q ";
    in.q_pos = RandomPositions(rng, spec.sq, positions);
    positions += ", kv ";
    in.kv_pos = RandomPositions(rng, spec.skv, positions);
    if (spec.segments && Coin(rng, 0.5)) {
      // A q document that no key belongs to: rows without any allowed key.
      in.q_seg.data_as<int32_t>()[0] = 1000;
    }

    const int64_t extent_q = in.q_pos.empty() ? spec.sq : in.q_pos.back() + 1;
    const int64_t extent_kv = in.kv_pos.empty() ? spec.skv : in.kv_pos.back() + 1;
    AttentionOptions opt;
    opt.mask = RandomMask(rng, 2, spec.h, extent_q, extent_kv);
    if (Coin(rng, 0.3)) opt.softcap = std::uniform_real_distribution<float>(1.0f, 30.0f)(rng);
    if (Coin(rng, 0.2)) opt.scale = std::uniform_real_distribution<float>(0.05f, 0.5f)(rng);
    opt.block_sizes = {Pick(rng, {16, 32, 48, 64}), Pick(rng, {16, 32, 48, 64})};
    opt.num_threads = static_cast<int>(Uniform(rng, 1, 3));
    const KernelPath path = paths[static_cast<size_t>(Uniform(rng, 0, paths.size() - 1))];

    std::ostringstream what;
    what << "config " << config << ": B=" << spec.b << " Sq=" << spec.sq << " Skv=" << spec.skv
         << " H=" << spec.h << " Hkv=" << spec.hkv << " D=" << spec.d << " Dv=" << spec.dv << " "
         << DTypeName(spec.dtype) << " mask=" << opt.mask.ToString() << " sinks=" << spec.sinks
         << " segments=" << spec.segments << " bhsd=" << spec.bhsd
         << " softcap=" << (opt.softcap ? std::to_string(*opt.softcap) : "none")
         << " scale=" << (opt.scale ? std::to_string(*opt.scale) : "default")
         << " blocks=" << opt.block_sizes.q << "x" << opt.block_sizes.kv
         << " threads=" << opt.num_threads << " path=" << KernelPathName(path)
         << " positions: " << positions;
    std::string result;
    try {
      result = spec.dtype == DType::kF32 ? CheckF32(in, opt, {path})
                                         : CheckLowPrecision(in, opt, {path});
    } catch (const std::exception& e) {
      result = std::string("threw: ") + e.what();
    }
    if (!result.empty()) {
      ADD_FAILURE() << what.str() << "\n" << result;
      if (++failures >= 5) break;  // enough to diagnose; keeps the log short
    }
  }
}

// The low-precision bounds see a bf16 rounding that a path does not
// declare: bf16 results of a path that rounds P (and dS) to bf16 for its
// products (avx512_bf16, amx) meet their own bounds (ReferenceBounds with
// the P-rounding slack), but exceed on out and on every gradient the bounds
// of a path that rounds nothing (portable, same problem and dtype): P's
// rounding, relative 2^-8 per element, leaves errors of ~1e-3 of max|out|,
// ~100x the f32 model's 1e-5. Were the slack granted on every path (as
// CheckLowPrecision once did, and the f16 bound with 2^-11), the second half
// would fail.
TEST(PropertyTest, LowPrecisionBoundsSeeUndeclaredBf16Rounding) {
  std::vector<KernelPath> rounding;
  for (KernelPath p : SupportedKernelPaths()) {
    if (RoundsBf16Operands(p, DType::kBF16)) rounding.push_back(p);
  }
  if (rounding.empty()) {
    GTEST_SKIP() << "no kernel path of this CPU rounds P to bf16 (avx512_bf16 and amx need "
                    "AVX512_BF16 / AMX-BF16)";
  }
  Rng rng(31);
  ProblemSpec spec(1, 96, 96, 4, 2, 32, 32);
  spec.dtype = DType::kBF16;
  spec.sinks = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kBF16, OutShape(in));
  AttentionOptions opt;
  opt.mask = Mask::Causal();
  const RefResult ref = RunReference(in, opt, &dout);
  const std::vector<double> v = ToDoubles(in.v.view());
  const Errors strict = ReferenceBounds(ref, v, KernelPath::kPortable, DType::kBF16, DType::kBF16);
  for (KernelPath path : rounding) {
    opt.kernel_path = path;
    const std::string what = std::string("path ") + KernelPathName(path);
    Errors e = BackwardOnReference(in, opt, dout, ref);
    const Errors fwd = ErrorsOf(RunAttention(in, opt, nullptr), ref);
    e.out = fwd.out;
    e.lse = fwd.lse;
    EXPECT_EQ(ExceedsBounds(what, e, ReferenceBounds(ref, v, path, DType::kBF16, DType::kBF16)),
              "");
    EXPECT_GT(e.out, strict.out) << what << ": " << e.Describe();
    EXPECT_GT(e.dq, strict.dq) << what << ": " << e.Describe();
    EXPECT_GT(e.dk, strict.dk) << what << ": " << e.Describe();
    EXPECT_GT(e.dv, strict.dv) << what << ": " << e.Describe();
  }
}

}  // namespace
}  // namespace ringsplash::testing

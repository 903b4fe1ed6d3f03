// `ringsplash attend` end to end: the test writes random .npy inputs, runs
// the binary, and compares every output file with the f64 reference
// (tests/support/reference.h) computed by the test itself on the same
// values. One case per option; ring sizes 2 and 3 with every layout on the
// threads backend; the MPI backend under mpirun when MPI is built.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/mask.h"
#include "tests/cli/cli_test_util.h"
#include "tests/support/test_util.h"
#include "tools/npy.h"

namespace ringsplash::testing {
namespace {

struct AttendCase {
  std::string name;
  ProblemSpec spec{1, 48, 48, 4, 2, 16, 16};  // file dtype spec.dtype: f32 or f16
  std::string mask = "full";
  enum class Dense { kNone, kBool2d, kU8PerHead, kI64 } dense = Dense::kNone;
  std::optional<double> softcap, scale;
  bool backward = false;
  std::string dtype = "f32";  // --dtype
  int ranks = 1;
  std::string layout = "zigzag";
  bool mpi = false;
  std::vector<std::string> extra;
};

// gtest prints parameters on failure: the name, not 288 raw bytes.
void PrintTo(const AttendCase& c, std::ostream* os) { *os << c.name; }

void Save(const std::string& path, const Tensor& t) {
  npy::WriteNpy(path, npy::FromDType(t.dtype()), t.shape(), t.data());
}

// Random bool mask [heads, sq, skv] (heads 0: [sq, skv]), ~70% allowed.
std::vector<uint8_t> RandomDense(Rng& rng, int64_t heads, int64_t sq, int64_t skv) {
  std::bernoulli_distribution allowed(0.7);
  std::vector<uint8_t> m(static_cast<size_t>(std::max<int64_t>(heads, 1) * sq * skv));
  for (uint8_t& x : m) x = allowed(rng) ? 1 : 0;
  return m;
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs one case and checks every output against the reference.
void RunCase(const AttendCase& c) {
  SCOPED_TRACE(c.name);
  ScratchDir dir;
  Rng rng(std::hash<std::string>{}(c.name));
  const ProblemSpec& s = c.spec;
  const OwnedInputs in = RandomInputs(rng, s);
  Save(dir / "q.npy", in.q);
  Save(dir / "k.npy", in.k);
  Save(dir / "v.npy", in.v);
  std::vector<std::string> args = {"attend",        "--q",   dir / "q.npy",   "--k",
                                   dir / "k.npy",   "--v",   dir / "v.npy",   "--out",
                                   dir / "out.npy", "--lse", dir / "lse.npy", "--mask",
                                   c.mask};
  std::vector<std::string> outputs = {"out.npy", "lse.npy"};

  AttentionOptions opt;
  opt.mask = Mask::Parse(c.mask);
  if (c.dense != AttendCase::Dense::kNone) {
    const int64_t heads = c.dense == AttendCase::Dense::kU8PerHead ? s.h : 0;
    std::vector<uint8_t> m = RandomDense(rng, heads, s.sq, s.skv);
    std::vector<int64_t> shape = {s.sq, s.skv};
    if (heads) shape.insert(shape.begin(), heads);
    if (c.dense == AttendCase::Dense::kI64) {
      std::vector<int64_t> wide(m.begin(), m.end());
      for (int64_t& x : wide) x *= 3;  // any non-zero integer means allowed
      npy::WriteNpy(dir / "mask.npy", npy::NpyType::kI64, shape, wide.data());
    } else {
      npy::WriteNpy(dir / "mask.npy", heads ? npy::NpyType::kU8 : npy::NpyType::kBool, shape,
                    m.data());
    }
    opt.mask = opt.mask & Mask::Dense(m, heads, s.sq, s.skv);
    args = Concat(args, {"--dense-mask", dir / "mask.npy"});
  }
  if (c.softcap) {
    opt.softcap = static_cast<float>(*c.softcap);
    args = Concat(args, {"--softcap", std::to_string(*c.softcap)});
  }
  if (c.scale) {
    opt.scale = static_cast<float>(*c.scale);
    args = Concat(args, {"--scale", std::to_string(*c.scale)});
  }
  if (s.sinks) {
    Save(dir / "sinks.npy", in.sinks);
    args = Concat(args, {"--sinks", dir / "sinks.npy"});
  }
  if (s.segments) {
    Save(dir / "qs.npy", in.q_seg);
    Save(dir / "ks.npy", in.kv_seg);
    args = Concat(args, {"--q-segments", dir / "qs.npy", "--kv-segments", dir / "ks.npy"});
  }
  Tensor dout;
  if (c.backward) {
    dout = RandomTensor(rng, s.dtype, {s.b, s.sq, s.h, s.dv});
    Save(dir / "dout.npy", dout);
    args = Concat(args, {"--dout", dir / "dout.npy", "--dq", dir / "dq.npy", "--dk", dir / "dk.npy",
                         "--dv", dir / "dv.npy"});
    outputs.insert(outputs.end(), {"dq.npy", "dk.npy", "dv.npy"});
    if (s.sinks) {
      args = Concat(args, {"--dsinks", dir / "dsinks.npy"});
      outputs.push_back("dsinks.npy");
    }
  }
  args = Concat(args,
                {"--dtype", c.dtype, "--layout", c.layout, "--backend", c.mpi ? "mpi" : "threads"});
  if (!c.mpi) args = Concat(args, {"--ranks", std::to_string(c.ranks)});
  args = Concat(args, c.extra);
  const std::vector<std::string> inputs_listing = dir.List();

  CommandResult r;
  if (c.mpi) {
#ifdef RINGSPLASH_MPIEXEC
    r = RunCommand(Concat({RINGSPLASH_MPIEXEC, "--oversubscribe", "-np", std::to_string(c.ranks),
                           RINGSPLASH_CLI},
                          args),
                   180);
#endif
  } else {
    r = RunCli(args);
  }
  ASSERT_EQ(r.status, 0) << r.err;
  if (!c.mpi) {
    EXPECT_EQ(r.err, "");
  }

  // Exactly the inputs and the requested outputs: no temporaries left.
  std::vector<std::string> want_listing = inputs_listing;
  want_listing.insert(want_listing.end(), outputs.begin(), outputs.end());
  std::sort(want_listing.begin(), want_listing.end());
  EXPECT_EQ(dir.List(), want_listing);

  // The reference sees what the CLI computed on: inputs rounded to bf16
  // under --dtype bf16 (sinks stay f32), as stored otherwise.
  const DType compute = c.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  const OwnedInputs ref_in =
      compute == DType::kBF16 ? ConvertInputs(in, DType::kBF16) : ConvertInputs(in, DType::kF32);
  Tensor ref_dout;
  if (c.backward) {
    ref_dout = TensorFromDoubles(ToDoubles(dout.view()), compute, dout.shape());
  }
  const RefResult ref = RunReference(ref_in, opt, c.backward ? &ref_dout : nullptr);

  ApiResult got;
  std::vector<int64_t> shape;
  got.out = ReadF32(dir / "out.npy", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{s.b, s.sq, s.h, s.dv}));
  got.lse = ReadF32(dir / "lse.npy", &shape);
  EXPECT_EQ(shape, (std::vector<int64_t>{s.b, s.h, s.sq}));
  if (c.backward) {
    got.dq = ReadF32(dir / "dq.npy", &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{s.b, s.sq, s.h, s.d}));
    got.dk = ReadF32(dir / "dk.npy", &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{s.b, s.skv, s.hkv, s.d}));
    got.dv = ReadF32(dir / "dv.npy", &shape);
    EXPECT_EQ(shape, (std::vector<int64_t>{s.b, s.skv, s.hkv, s.dv}));
    if (s.sinks) got.dsinks = ReadF32(dir / "dsinks.npy", &shape);
  }
  // f32: the kernels accumulate in f32 over <= 48 keys of magnitude <= 1, so
  // rounding stays near 48 * 2^-24 ~ 3e-6 relative to the largest value;
  // 1e-4 leaves a wide margin yet catches any wrong mask, position or merge
  // (those err by O(1)). bf16: inputs are rounded identically on both sides
  // but the kernels round probabilities and products to bf16 (2^-8 ~ 4e-3
  // relative per element), so 3e-2.
  const double tol = compute == DType::kBF16 ? 3e-2 : 1e-4;
  const Errors e = ErrorsOf(got, ref);
  EXPECT_LE(e.out, tol) << e.Describe();
  EXPECT_LE(e.lse, tol) << e.Describe();
  if (c.backward) {
    EXPECT_LE(e.dq, tol) << e.Describe();
    EXPECT_LE(e.dk, tol) << e.Describe();
    EXPECT_LE(e.dv, tol) << e.Describe();
    EXPECT_LE(e.dsinks, tol) << e.Describe();
  }
}

AttendCase Case(std::string name) {
  AttendCase c;
  c.name = std::move(name);
  return c;
}

std::vector<AttendCase> OptionCases() {
  std::vector<AttendCase> cases;
  cases.push_back(Case("full"));
  {
    AttendCase c = Case("causal_mqa_dv_differs");
    c.mask = "causal";
    c.spec.hkv = 1;
    c.spec.dv = 8;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("negative_causal_offset_empty_rows");
    c.mask = "causal:-3";  // rows 0..2 see nothing: lse -inf, out 0
    cases.push_back(c);
  }
  for (const char* m :
       {"local:5,3", "chunked:16", "causal & local:8,", "local:4,4 | chunked:16", "local:,2,-1"}) {
    AttendCase c = Case(std::string("mask ") + m);
    c.mask = m;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("dense_bool_and_causal");
    c.mask = "causal";
    c.dense = AttendCase::Dense::kBool2d;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("dense_u8_per_head");
    c.dense = AttendCase::Dense::kU8PerHead;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("dense_int64");
    c.dense = AttendCase::Dense::kI64;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("softcap_and_scale");
    c.softcap = 5.0;
    c.scale = 0.3;
    c.spec.qk_range = 3.0;  // large enough scores that the cap matters
    cases.push_back(c);
  }
  {
    AttendCase c = Case("sinks");
    c.spec.sinks = true;
    c.mask = "causal";
    cases.push_back(c);
  }
  {
    AttendCase c = Case("segments");
    c.spec.segments = true;
    c.mask = "causal";
    cases.push_back(c);
  }
  {
    // D and Dv at the kernels' limit (256, docs/CLI.md): accepted; the CLI's
    // own check of the limit must not be off by one. (256-term dot products
    // round to ~256 * 2^-24 ~ 2e-5 relative: within the f32 tolerance.)
    AttendCase c = Case("largest_head_dims");
    c.spec.d = 256;
    c.spec.dv = 256;
    c.mask = "causal";
    cases.push_back(c);
  }
  {
    // Parentheses group mask terms (docs/CLI.md).
    AttendCase c = Case("mask_parentheses");
    c.mask = "(causal | local:4,4) & chunked:16";
    cases.push_back(c);
  }
  {
    AttendCase c = Case("batch2_q_shorter_than_kv");
    c.spec.b = 2;
    c.spec.sq = 24;
    c.mask = "causal:24";  // queries are the last 24 positions of 48 keys
    cases.push_back(c);
  }
  {
    AttendCase c = Case("f16_inputs");
    c.spec.dtype = DType::kF16;
    c.mask = "causal";
    cases.push_back(c);
  }
  {
    AttendCase c = Case("backward_everything");
    c.backward = true;
    c.mask = "causal";
    c.spec.sinks = true;
    c.spec.segments = true;
    c.softcap = 4.0;
    c.extra = {"--threads-per-rank", "2", "--comm-timeout", "30"};
    cases.push_back(c);
  }
  {
    AttendCase c = Case("backward_dense_per_head");
    c.backward = true;
    c.dense = AttendCase::Dense::kU8PerHead;
    cases.push_back(c);
  }
  {
    AttendCase c = Case("bf16_forward_backward");
    c.dtype = "bf16";
    c.backward = true;
    c.mask = "causal";
    cases.push_back(c);
  }
  return cases;
}

class AttendOptionTest : public ::testing::TestWithParam<AttendCase> {};
TEST_P(AttendOptionTest, MatchesReference) { RunCase(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cli, AttendOptionTest, ::testing::ValuesIn(OptionCases()),
                         [](const auto& info) {
                           std::string n = info.param.name;
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n + "_" + std::to_string(info.index);
                         });

// Ring sizes 2 and 3, every layout, forward + backward with the features
// that depend on global positions (causal window, segments, sinks).
std::vector<AttendCase> RingCases(bool mpi) {
  std::vector<AttendCase> cases;
  for (int ranks : mpi ? std::vector<int>{2} : std::vector<int>{2, 3}) {
    for (const char* layout : {"contiguous", "zigzag", "striped"}) {
      AttendCase c =
          Case(std::string(mpi ? "mpi" : "threads") + std::to_string(ranks) + "_" + layout);
      c.ranks = ranks;
      c.layout = layout;
      c.mpi = mpi;
      c.mask = "causal & local:20,";
      c.backward = true;
      c.spec.sinks = true;
      c.spec.segments = true;
      c.extra = {"--threads-per-rank", "1"};
      cases.push_back(c);
    }
  }
  {
    // 2-D context parallelism: U = 2 Ulysses groups around the ring
    // (threads: 4 ranks, a ring of 2 groups; MPI: 2 ranks, pure Ulysses).
    AttendCase c = Case(mpi ? "mpi2_ulysses2_striped" : "threads4_ulysses2_zigzag");
    c.ranks = mpi ? 2 : 4;
    c.layout = mpi ? "striped" : "zigzag";
    c.mpi = mpi;
    c.mask = "causal & local:20,";
    c.backward = true;
    c.spec.sinks = true;
    c.spec.segments = true;
    c.extra = {"--threads-per-rank", "1", "--ulysses", "2"};
    cases.push_back(c);
  }
  if (mpi) {
    AttendCase c = Case("mpi2_dense_gqa_forward_only");
    c.ranks = 2;
    c.mpi = true;
    c.dense = AttendCase::Dense::kBool2d;
    c.mask = "causal";
    cases.push_back(c);
    // Each MPI rank reads only its own rows of the mask file (DenseRows):
    // strided and zigzag rows, an 8-byte and a per-head mask, backward too.
    c = Case("mpi2_dense_i64_striped_backward");
    c.ranks = 2;
    c.mpi = true;
    c.layout = "striped";
    c.dense = AttendCase::Dense::kI64;
    c.backward = true;
    cases.push_back(c);
    c = Case("mpi2_dense_per_head_zigzag_backward");
    c.ranks = 2;
    c.mpi = true;
    c.layout = "zigzag";
    c.dense = AttendCase::Dense::kU8PerHead;
    c.mask = "causal";
    c.backward = true;
    cases.push_back(c);
  }
  return cases;
}

class AttendRingTest : public ::testing::TestWithParam<AttendCase> {};
TEST_P(AttendRingTest, MatchesReference) {
  if (GetParam().mpi) {
#ifndef RINGSPLASH_MPIEXEC
    GTEST_SKIP() << "built without MPI";
#endif
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  RunCase(GetParam());
}
INSTANTIATE_TEST_SUITE_P(Threads, AttendRingTest, ::testing::ValuesIn(RingCases(false)),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Mpi, AttendRingTest, ::testing::ValuesIn(RingCases(true)),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace ringsplash::testing

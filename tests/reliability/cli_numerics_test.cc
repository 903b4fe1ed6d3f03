// Input conversion and environment checks of `ringsplash attend` (issue
// #6.4, 6.6): values that do not survive the conversion to the compute dtype
// are reported, a malformed RINGSPLASH_FAULT is an error naming the variable,
// and the NaN rule holds end to end (a NaN in one query row leaves the other
// rows' outputs finite).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"
#include "tools/npy.h"

namespace ringsplash::testing {
namespace {

const std::vector<int64_t> kShape = {1, 32, 2, 16};

// q, k, v [1, 32, 2, 16] f32 in [-1, 1]; `edit_q` may change q first.
void WriteInputs(const ScratchDir& dir, void (*edit_q)(std::vector<float>&) = nullptr) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (const char* name : {"q.npy", "k.npy", "v.npy"}) {
    std::vector<float> data(32 * 2 * 16);
    for (float& x : data) x = dist(rng);
    if (edit_q != nullptr && std::string(name) == "q.npy") edit_q(data);
    npy::WriteNpy(dir / name, npy::NpyType::kF32, kShape, data.data());
  }
}

std::vector<std::string> Attend(const ScratchDir& dir, std::vector<std::string> extra) {
  std::vector<std::string> a = {"attend",      "--q",   dir / "q.npy",  "--k", dir / "k.npy", "--v",
                                dir / "v.npy", "--out", dir / "out.npy"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// An f32 value beyond the bf16 range (FLT_MAX rounds up to infinity in bf16)
// under --dtype bf16: the user must be told which file holds it — silently
// computing with an infinity is not acceptable. (An error or a warning on
// stderr both count as telling; the message must name the file.)
TEST(CliNumerics, Bf16ConversionOverflowIsReported) {
  const ScratchDir dir;
  WriteInputs(dir, [](std::vector<float>& q) { q[5] = std::numeric_limits<float>::max(); });
  const CommandResult r = RunCli(Attend(dir, {"--dtype", "bf16"}));
  const bool told =
      r.err.find("q.npy") != std::string::npos &&
      (r.err.find("overflow") != std::string::npos || r.err.find("range") != std::string::npos);
  EXPECT_TRUE(told) << "status " << r.status << ", stderr: " << r.err;
}

// The same values in f32 are fine: the check is about the conversion.
TEST(CliNumerics, LargeFiniteF32InputsAreAcceptedInF32) {
  const ScratchDir dir;
  WriteInputs(dir, [](std::vector<float>& q) { q[5] = 1e30f; });
  const CommandResult r = RunCli(Attend(dir, {}));
  EXPECT_EQ(r.status, 0) << r.err;
}

TEST(CliNumerics, MalformedFaultSpecIsAnErrorNamingTheVariable) {
  const ScratchDir dir;
  WriteInputs(dir);
  std::vector<std::string> argv = {"env", "RINGSPLASH_FAULT=1-2", RINGSPLASH_CLI};
  for (const std::string& a : Attend(dir, {"--ranks", "2"})) argv.push_back(a);
  const CommandResult r = RunCommand(argv);
  EXPECT_NE(r.status, 0);
  EXPECT_LT(r.status, 124);
  EXPECT_NE(r.err.find("RINGSPLASH_FAULT"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("'1-2'"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "out.npy"));
}

// A NaN in one query row through the whole command (ring of 2): only that
// row's output is non-finite (docs/RELIABILITY.md, "NaN and Inf").
TEST(CliNumerics, NaNQueryRowStaysInItsRow) {
  const ScratchDir dir;
  // Row 9 of head 1: elements [9 * 2 * 16 + 16, 9 * 2 * 16 + 32).
  WriteInputs(dir, [](std::vector<float>& q) {
    for (int e = 0; e < 16; ++e) q[9 * 32 + 16 + e] = std::numeric_limits<float>::quiet_NaN();
  });
  const CommandResult r = RunCli(Attend(dir, {"--ranks", "2", "--mask", "causal"}));
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<int64_t> shape;
  const std::vector<double> out = ReadF32(dir / "out.npy", &shape);
  ASSERT_EQ(out.size(), 32u * 2 * 16);
  for (int64_t i = 0; i < 32; ++i) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t e = 0; e < 16; ++e) {
        const double x = out[static_cast<size_t>((i * 2 + h) * 16 + e)];
        if (i == 9 && h == 1) continue;  // the poisoned row: see numerics_test.cc
        EXPECT_TRUE(std::isfinite(x)) << "row " << i << " head " << h;
      }
    }
  }
}

// Flag values tests/cli/cli_errors_test.cc does not cover: each is a usage
// error (status 2) naming the flag, with no output file created.
TEST(CliOptions, RemainingBadValuesAreUsageErrorsNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string flag;
  };
  const Case cases[] = {
      {{"--comm-timeout", "nan"}, "--comm-timeout"},
      {{"--comm-timeout", "inf"}, "--comm-timeout"},
      {{"--comm-timeout", "-5"}, "--comm-timeout"},
      {{"--scale", "nan"}, "--scale"},
      {{"--scale", "-1"}, "--scale"},
      {{"--softcap", "inf"}, "--softcap"},
      {{"--ranks", "5000"}, "--ranks"},
      {{"--threads-per-rank", "x"}, "--threads-per-rank"},
      {{"--layout", ""}, "--layout"},
      {{"--mask", ""}, "--mask"},
  };
  for (const Case& c : cases) {
    const ScratchDir dir;
    WriteInputs(dir);
    const CommandResult r = RunCli(Attend(dir, c.args));
    EXPECT_EQ(r.status, 2) << c.args[0] << " " << c.args[1] << ": " << r.err;
    EXPECT_NE(r.err.find(c.flag), std::string::npos) << c.args[1] << ": " << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "out.npy")) << c.args[0] << " " << c.args[1];
  }
}

}  // namespace
}  // namespace ringsplash::testing

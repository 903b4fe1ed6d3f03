// The command's front door: --version, help, `bench` JSON and `demo`.
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace ringsplash::testing {
namespace {

std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

TEST(Cli, VersionAndHelp) {
  CommandResult r = RunCli({"--version"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.out.rfind("ringsplash ", 0), 0u) << r.out;

  r = RunCli({});  // no subcommand: the help
  EXPECT_EQ(r.status, 0);
  for (const char* word : {"attend", "bench", "demo"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << r.out;
  }
  for (const char* sub : {"attend", "bench", "demo"}) {
    r = RunCli({sub, "--help"});
    EXPECT_EQ(r.status, 0) << sub;
    EXPECT_NE(r.out.find("--"), std::string::npos) << sub;
  }
  r = RunCli({"attend", "--help"});
  for (const char* flag : {"--dense-mask", "--q-segments", "--dsinks", "--layout", "--backend",
                           "--comm-timeout", "--threads-per-rank", "--softcap"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
}

// Allowed pairs counted here by brute force over every (q, kv) pair — the
// check on `flops`, which bench counts from the block map.
double BruteForcePairs(int64_t sq, int64_t skv, bool (*allowed)(int64_t, int64_t)) {
  double n = 0;
  for (int64_t i = 0; i < sq; ++i)
    for (int64_t j = 0; j < skv; ++j) n += allowed(i, j);
  return n;
}

// A two-rank zigzag ring bench (fwd + bwd, blocks of 32) of `mask` over
// sequences of 192 and 384 tokens, one JSON line per sequence length.
std::vector<std::string> RingBenchArgs(const std::string& mask) {
  return {"bench",      "--seq",    "192,384",    "--heads",   "4",
          "--kv-heads", "2",        "--head-dim", "16",        "--v-head-dim",
          "8",          "--mask",   mask,         "--ranks",   "2",
          "--layout",   "zigzag",   "--pass",     "fwdbwd",    "--threads-per-rank",
          "1",          "--warmup", "0",          "--block-q", "32",
          "--block-kv", "32"};
}

TEST(Cli, BenchCheckEmitsOneJsonObjectPerSeqWithAllFields) {
  std::vector<std::string> args = RingBenchArgs("causal & local:100,");
  constexpr int kIters = 2;  // and no warmup: RingBenchArgs
  for (const char* a : {"--iters", "2", "--check"}) args.push_back(a);
  const auto started = std::chrono::steady_clock::now();
  const CommandResult r = RunCli(args, 300);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  // The same bench with causal alone, for the tile counts only (one
  // iteration, no check: the counts are per iteration and do not depend on
  // either).
  std::vector<std::string> causal_args = RingBenchArgs("causal");
  for (const char* a : {"--iters", "1"}) causal_args.push_back(a);
  const CommandResult causal = RunCli(causal_args, 300);
  ASSERT_EQ(causal.status, 0) << causal.err;
  const std::vector<nlohmann::json> causal_lines = JsonLines(causal.out);
  ASSERT_EQ(causal_lines.size(), 2u) << causal.out;
  const int64_t seqs[] = {192, 384};
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json& j = lines[i];
    SCOPED_TRACE(j.dump());
    for (const char* f : {"config",
                          "seconds",
                          "flops",
                          "gflops",
                          "peak_gflops",
                          "fraction_of_peak",
                          "computed_blocks",
                          "skipped_blocks",
                          "compute_seconds",
                          "comm_wait_seconds",
                          "imbalance",
                          "max_rel_err",
                          "kernel_flops",
                          "rank_flops",
                          "peak_method",
                          "kv_bytes",
                          "kv_gb_per_s",
                          "peak_threads",
                          "peak_measurements",
                          "peak_unreliable",
                          "read_gb_per_s",
                          "fraction_of_bandwidth",
                          "bandwidth_unreliable"}) {
      EXPECT_TRUE(j.contains(f)) << f;
    }
    const nlohmann::json& c = j["config"];
    EXPECT_EQ(c["seq"], seqs[i]);
    EXPECT_EQ(c["q_seq"], seqs[i]);
    EXPECT_EQ(c["ranks"], 2);
    EXPECT_EQ(c["heads"], 4);
    EXPECT_EQ(c["kv_heads"], 2);
    EXPECT_EQ(c["pass"], "fwdbwd");
    EXPECT_EQ(c["layout"], "zigzag");
    EXPECT_EQ(c["mask"], "causal & local:100,");
    EXPECT_EQ(j["compute_seconds"].size(), 2u);
    EXPECT_EQ(j["comm_wait_seconds"].size(), 2u);
    EXPECT_GT(j["seconds"].get<double>(), 0);
    EXPECT_GT(j["peak_gflops"].get<double>(), 0);
    EXPECT_GT(j["computed_blocks"].get<int64_t>(), 0);
    // The window skips tiles causal alone computes (SPEC §3; §6: the seed,
    // with causal on, dropped every other mask): every tile causal rules out
    // the composition rules out too, and some tiles hold only pairs more
    // than 100 apart (at 192 tokens, rank 0's query block [160, 192) against
    // its key block [0, 32)). Causal alone would pass a "> 0" check, so the
    // counts are compared, over the same tiles (same layout and blocks).
    const nlohmann::json& cj = causal_lines[i];
    EXPECT_EQ(cj["config"]["seq"], seqs[i]);
    EXPECT_EQ(j["computed_blocks"].get<int64_t>() + j["skipped_blocks"].get<int64_t>(),
              cj["computed_blocks"].get<int64_t>() + cj["skipped_blocks"].get<int64_t>());
    EXPECT_GT(j["skipped_blocks"].get<int64_t>(), cj["skipped_blocks"].get<int64_t>())
        << "causal alone: " << cj.dump();
    // The ring equals the single-device kernel to f32 rounding (sampled rows
    // over <= 384 keys: ~1e-6); 1e-4 catches any real error (O(1)). The
    // check that computes max_rel_err is itself tested against the f64
    // reference in bench_check_test.cc.
    EXPECT_LT(j["max_rel_err"].get<double>(), 1e-4);
    // flops = 3.5 (fwd+bwd) * 2 * B * (D + Dv) * H * pairs.
    const double pairs = BruteForcePairs(
        seqs[i], seqs[i], [](int64_t q, int64_t k) { return q >= k && k >= q - 100; });
    EXPECT_DOUBLE_EQ(j["flops"].get<double>(), 3.5 * 2 * 1 * (16 + 8) * 4 * pairs);
    // K and V: B * S * Hkv * (D + Dv) f32 values.
    EXPECT_DOUBLE_EQ(j["kv_bytes"].get<double>(), 1.0 * seqs[i] * 2 * (16 + 8) * 4);
    // The time and the rates against clocks other than the bench's own: the
    // iteration time each gives (flops and kv_bytes are exact, above) is at
    // least the kernel time every rank spent in an iteration
    // (compute_seconds, from the ring's own step timers; with two
    // iterations the median time is their mean, as compute_seconds is; 0.1
    // ms for the ranks leaving the barrier before rank 0 reads its clock),
    // and both iterations fit in the whole command's wall time. A figure in
    // the wrong unit or over the wrong time is off by far more.
    const double by_gflops = j["flops"].get<double>() / (j["gflops"].get<double>() * 1e9);
    const double by_kv_rate = j["kv_bytes"].get<double>() / (j["kv_gb_per_s"].get<double>() * 1e9);
    for (const double t : {j["seconds"].get<double>(), by_gflops, by_kv_rate}) {
      for (const nlohmann::json& rank_compute : j["compute_seconds"]) {
        EXPECT_LE(rank_compute.get<double>(), t + 1e-4) << t;
      }
      EXPECT_LT(kIters * t, elapsed) << t;
    }
  }
}

// `imbalance` (max / mean of the ranks' kernel FLOPs) follows the layout: a
// causal mask over 2 ranks in 32 x 32 tiles at 384 tokens gives each zigzag
// rank 39 of its 6 x 12 tiles per head (chunks of 96 rows, 3 tiles each:
// chunk 0 against itself 6, chunk 3 against all 27 + 6; chunk 1 9 + 6,
// chunk 2 18 + 6), while the contiguous layout's rank 0 (rows 0..191)
// computes 21 and rank 1 57 (36 full tiles against rank 0's keys and 21 of
// its own): imbalance 57 / 39 = 1.46. An imbalance computed over the wrong
// figures, or a layout ignored, misses both.
TEST(Cli, BenchImbalanceFollowsTheLayout) {
  std::vector<double> imbalance;
  for (const char* layout : {"zigzag", "contiguous"}) {
    const CommandResult r = RunCli(
        {"bench",  "--seq",   "384", "--heads",   "2",    "--head-dim",         "16", "--mask",
         "causal", "--ranks", "2",   "--layout",  layout, "--threads-per-rank", "1",  "--warmup",
         "0",      "--iters", "1",   "--block-q", "32",   "--block-kv",         "32"},
        300);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    SCOPED_TRACE(j.dump());
    ASSERT_EQ(j["rank_flops"].size(), 2u);
    imbalance.push_back(j["imbalance"].get<double>());
  }
  EXPECT_NEAR(imbalance[0], 1.0, 0.02);
  EXPECT_NEAR(imbalance[1], 57.0 / 39.0, 0.02);
}

TEST(Cli, BenchSingleDeviceDefaultsAndBf16) {
  const CommandResult r = RunCli({"bench", "--seq", "256", "--heads", "2", "--head-dim", "32",
                                  "--dtype", "bf16", "--iters", "1", "--warmup", "0", "--check"},
                                 300);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& j = lines[0];
  EXPECT_EQ(j["config"]["ranks"], 1);
  EXPECT_EQ(j["config"]["dtype"], "bf16");
  EXPECT_EQ(j["config"]["mask"], "full");
  EXPECT_EQ(j["config"]["pass"], "fwd");
  EXPECT_EQ(j["config"]["v_head_dim"], 32);
  // Full mask: every pair; forward only.
  EXPECT_DOUBLE_EQ(j["flops"].get<double>(), 2.0 * (32 + 32) * 2 * 256.0 * 256.0);
  // bf16 K and V, 2 bytes each (kv_heads defaults to heads).
  EXPECT_DOUBLE_EQ(j["kv_bytes"].get<double>(), 256.0 * 2 * (32 + 32) * 2);
  EXPECT_EQ(j["skipped_blocks"], 0);
  // Same bf16 inputs on both sides, different tilings: bf16 rounding of
  // probabilities only (see demo.cc), well under 3e-2.
  EXPECT_LT(j["max_rel_err"].get<double>(), 3e-2);
}

// bench --ulysses: 4 thread ranks in 2 Ulysses groups, checked in the same
// run against the single-device kernel (bench_check), all-to-all time
// reported per rank; U not dividing --heads is a usage error.
TEST(Cli, BenchUlyssesGridChecksAndReportsAllToAll) {
  const CommandResult r =
      RunCli({"bench",  "--seq",   "512",    "--heads",  "4", "--kv-heads", "2", "--head-dim",
              "32",     "--mask",  "causal", "--ranks",  "4", "--ulysses",  "2", "--pass",
              "fwdbwd", "--iters", "1",      "--warmup", "0", "--check"},
             300);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& j = lines[0];
  EXPECT_EQ(j["config"]["ulysses"], 2);
  ASSERT_EQ(j["all_to_all_seconds"].size(), 4u);
  for (const auto& s : j["all_to_all_seconds"]) EXPECT_GT(s.get<double>(), 0.0);
  // f32 against the single-device kernel: reordered f32 sums only.
  EXPECT_LT(j["max_rel_err"].get<double>(), 1e-4);

  const CommandResult bad =
      RunCli({"bench", "--seq", "512", "--heads", "3", "--ranks", "4", "--ulysses", "2"}, 60);
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("--ulysses: 2 must divide --heads 3"), std::string::npos) << bad.err;
}

TEST(Cli, DemoPrintsItsTableAndPasses) {
  const CommandResult r = RunCli({"demo", "--seq", "512"}, 300);
  ASSERT_EQ(r.status, 0) << r.err << r.out;
  for (const char* word : {"ringsplash demo", "4 ranks", "zigzag", "GQA 4:1", "causal", "GFLOP/s",
                           "comm wait", "balance", "PASS"}) {
    EXPECT_NE(r.out.find(word), std::string::npos) << word << "\n" << r.out;
  }
  // A percentage of peak, or on a busy machine none (tools/peak.h).
  EXPECT_TRUE(r.out.find("% of peak") != std::string::npos ||
              r.out.find("n/a (peak measurement unreliable on a busy machine)") !=
                  std::string::npos)
      << r.out;
  // One table row per rank.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NE(r.out.find("\n     " + std::to_string(rank) + "  "), std::string::npos) << r.out;
  }
  EXPECT_EQ(r.err, "");
}

TEST(Cli, DemoJson) {
  const CommandResult r =
      RunCli({"demo", "--seq", "256", "--ranks", "2", "--layout", "striped", "--json"}, 300);
  ASSERT_EQ(r.status, 0) << r.err << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["config"]["ranks"], 2);
  EXPECT_EQ(j["config"]["layout"], "striped");
  EXPECT_EQ(j["config"]["pass"], "fwdbwd");
  EXPECT_EQ(j["check"]["pass"], true);
  for (const char* t : {"out", "lse", "dq", "dk", "dv"}) {
    EXPECT_TRUE(j["check"]["rel_err"].contains(t)) << t;
  }
}

TEST(Cli, BenchUnderMpi) {
#ifndef RINGSPLASH_MPIEXEC
  GTEST_SKIP() << "built without MPI";
#else
  const CommandResult r = RunCliUnderMpi(
      2,
      {"bench",      "--backend", "mpi",    "--seq",    "128",    "--heads", "2",
       "--head-dim", "16",        "--mask", "causal",   "--pass", "fwdbwd",  "--threads-per-rank",
       "1",          "--iters",   "1",      "--warmup", "0",      "--check"},
      180);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;  // rank 0 only
  EXPECT_EQ(lines[0]["config"]["backend"], "mpi");
  EXPECT_EQ(lines[0]["config"]["ranks"], 2);
  EXPECT_EQ(lines[0]["compute_seconds"].size(), 2u);
  EXPECT_LT(lines[0]["max_rel_err"].get<double>(), 1e-4);
#endif
}

// The MPI backend's tuning variables are checked, not ignored when
// malformed: every rank fails with a line naming the variable.
TEST(Cli, BadMpiTuningVariableIsAnError) {
#ifndef RINGSPLASH_MPIEXEC
  GTEST_SKIP() << "built without MPI";
#else
  const std::pair<const char*, const char*> bad[] = {{"RINGSPLASH_MPI_POLL_US", "fast"},
                                                     {"RINGSPLASH_MPI_POLL_US", "-5"},
                                                     {"RINGSPLASH_MPI_PROGRESS", "sometimes"}};
  for (const auto& [name, value] : bad) {
    SCOPED_TRACE(std::string(name) + "=" + value);
    const CommandResult r =
        RunCliUnderMpi(2,
                       {"bench", "--backend", "mpi", "--seq", "64", "--heads", "1", "--head-dim",
                        "16", "--iters", "1", "--warmup", "0"},
                       180, {std::string(name) + "=" + value});
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find(std::string(name) + ": expected"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(value), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
#endif
}

}  // namespace
}  // namespace ringsplash::testing

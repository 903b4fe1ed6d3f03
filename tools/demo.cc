// `ringsplash demo`: GQA causal ring attention, forward + backward, checked.
#include "tools/demo.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include "ringsplash/ring.h"
#include "tools/bench.h"
#include "tools/bench_run.h"
#include "tools/cli_common.h"
#include "tools/peak.h"
#include "tools/pending_outputs.h"
#include "tools/progress.h"

namespace ringsplash::cli {
namespace {

// Ring vs single-device differ only by float rounding (different summation
// order of the same f32 accumulations), ~1e-6 relative in f32. bf16 inputs
// are identical on both sides, but the kernels round probabilities to bf16
// per tile, and tiles fall differently on the ring: ~1e-3 relative.
// The bounds leave an order of magnitude of margin.
constexpr double kTolF32 = 1e-3;
constexpr double kTolBF16 = 3e-2;

// "out 1.1e-07, lse 9.8e-08, ...": each checked tensor's error.
std::string ErrorList(const BenchResult& r) {
  std::string list;
  if (!r.check) return list;
  for (const auto& [name, err] : r.check->errors) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%s%s %.1e", list.empty() ? "" : ", ", name.c_str(), err);
    list += buf;
  }
  return list;
}

// Only for a passed check: a failure prints nothing on stdout.
void PrintTable(const BenchResult& r, double tol) {
  const BenchConfig& c = r.config;
  const double fwd_tflop = r.flops / 3.5 / 1e12;
  std::printf("ringsplash demo: exact ring attention on this machine\n\n");
  std::printf("  %-12s %d ranks on threads, %s layout, %d kernel thread%s per rank (%s)\n", "ring",
              c.ranks, LayoutName(c.layout), c.threads_per_rank, c.threads_per_rank == 1 ? "" : "s",
              r.kernel_path.c_str());
  std::printf("  %-12s B=%lld S=%lld H=%lld Hkv=%lld (GQA %lld:1) D=%lld, mask %s, %s\n", "problem",
              static_cast<long long>(c.batch), static_cast<long long>(c.seq),
              static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.heads / c.kv_heads), static_cast<long long>(c.head_dim),
              c.mask.c_str(), DTypeName(c.dtype));
  std::printf("  %-12s forward %.2f s + backward %.2f s = %.2f s\n", "time", r.forward_seconds,
              r.backward_seconds, r.seconds);
  std::printf("  %-12s %.1f GFLOP/s useful (%.3f TFLOP forward, x3.5 with backward)\n",
              "throughput", r.gflops, fwd_tflop);
  PeakFraction fraction;
  fraction.of_peak = r.fraction_of_peak;
  if (r.amx_peak_gflops > 0) fraction.of_tile_peak = r.fraction_of_amx_peak;
  fraction.unreliable_reason = r.peak_unreliable_reason;
  std::printf("  %-12s %.1f GFLOP/s measured (%s, %d threads): %s\n", "peak", r.peak_gflops,
              r.peak_method.c_str(), r.peak_threads, DescribeFraction(fraction).c_str());
  const double total_blocks = static_cast<double>(r.computed_blocks + r.skipped_blocks);
  std::printf("  %-12s %lld computed, %lld skipped by the mask (%.0f %%)\n\n", "tiles",
              static_cast<long long>(r.computed_blocks), static_cast<long long>(r.skipped_blocks),
              total_blocks > 0 ? 100 * r.skipped_blocks / total_blocks : 0.0);

  std::printf("  %4s  %10s  %12s  %10s  %8s\n", "rank", "compute s", "comm wait s", "GFLOP",
              "share");
  const double mean = r.kernel_flops / std::max<size_t>(1, r.rank_flops.size());
  for (size_t i = 0; i < r.rank_flops.size(); ++i) {
    std::printf("  %4zu  %10.2f  %12.3f  %10.1f  %8.2f\n", i, r.compute_seconds[i],
                r.comm_wait_seconds[i], r.rank_flops[i] / 1e9,
                mean > 0 ? r.rank_flops[i] / mean : 1.0);
  }
  std::printf("\n  %-12s max/mean rank FLOPs = %.2f\n", "balance", r.imbalance);
  if (r.check) {
    std::printf(
        "  %-12s max rel err %.2e vs the single-device kernel on %lld query + %lld key "
        "rows (%s): PASS (tolerance %.0e)\n",
        "check", r.check->max_rel_err, static_cast<long long>(r.check->q_rows),
        static_cast<long long>(r.check->kv_rows), ErrorList(r).c_str(), tol);
  }
}

}  // namespace

CLI::App* AddDemoCommand(CLI::App& app, DemoArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Run a realistic ring on this machine (GQA, causal, forward + backward), check it "
      "against the single-device kernel, print a summary. No arguments needed.");
  cmd->add_option("--seq", a.seq, "sequence length")->capture_default_str();
  cmd->add_option("--ranks", a.ranks, "ranks (threads), 2 to 4096")->capture_default_str();
  cmd->add_option("--layout", a.layout, "contiguous|zigzag|striped")->capture_default_str();
  cmd->add_option("--mask", a.mask, "mask text, as for attend")->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "f32|bf16")->capture_default_str();
  cmd->add_option("--threads-per-rank", a.threads_per_rank, kThreadsPerRankHelp);
  cmd->add_flag("--json", a.json, "print the result as JSON (the bench fields) instead");
  // Its own footer: the top-level one (inherited otherwise) shows bench and
  // attend commands.
  cmd->footer(
      "\nExamples:\n  ringsplash demo\n  ringsplash demo --seq 4096 --dtype bf16\n\nExit status 1 "
      "if the check fails (one line on stderr, nothing on stdout). See docs/CLI.md.");
  return cmd;
}

int RunDemo(const DemoArgs& a) {
  // One rank runs no ring, and the demo's check (ring against the
  // single-device kernel) would compare the kernel with itself.
  if (a.ranks == 1) {
    Usage(
        "--ranks: the demo needs at least 2 ranks (1 rank runs no ring; `ringsplash bench "
        "--ranks 1` measures the single-device kernel)");
  }
  BenchArgs b;
  b.batch = 1;
  b.seq = {a.seq};
  b.heads = 8;
  b.kv_heads = 2;
  b.head_dim = 64;
  b.mask = a.mask;
  b.layout = a.layout;
  b.ranks = a.ranks;
  b.dtype = a.dtype;
  b.pass = "fwdbwd";
  b.threads_per_rank = a.threads_per_rank;
  b.warmup = 0;
  b.iters = 1;
  b.check = true;
  b.check_rows = 64;
  const BenchConfig config = ResolveConfig(b, a.seq, 0);
  InstallSignalHandlers("ringsplash demo");

  BenchResult r;
  {
    Progress progress("ringsplash demo", !a.json);
    progress.Phase("ring forward + backward, then the check");
    r = RunBenchThreads(config);
  }
  const double tol = config.dtype == DType::kBF16 ? kTolBF16 : kTolF32;
  const bool pass = r.check && std::isfinite(r.check->max_rel_err) && r.check->max_rel_err <= tol;
  if (!pass) {
    // Like every failure (docs/CLI.md): nothing on stdout, one line on
    // stderr, which carries each tensor's error instead of the table.
    std::fprintf(stderr,
                 "ringsplash demo: check failed: max rel err %.3g (%s) vs the single-device kernel "
                 "exceeds the tolerance %.0e\n",
                 r.check ? r.check->max_rel_err : NAN, ErrorList(r).c_str(), tol);
    return kExitFailure;
  }
  if (a.json) {
    nlohmann::json j = ToJson(r);
    j["check"]["tolerance"] = tol;
    j["check"]["pass"] = pass;
    std::cout << j.dump(2) << std::endl;
  } else {
    PrintTable(r, tol);
  }
  return kExitOk;
}

}  // namespace ringsplash::cli

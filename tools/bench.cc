// `ringsplash bench`: flags, resolution of defaults, JSON output.
#include "tools/bench.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>

#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "tools/cli_common.h"
#include "tools/pending_outputs.h"
#include "tools/progress.h"

namespace ringsplash::cli {
namespace {

void CheckPositive(int64_t value, const char* flag) {
  if (value <= 0) Usage(flag, ": expected a positive integer, got ", value);
}

void CheckHeadDim(int64_t value, const char* flag) {
  if (value <= 0 || value > kMaxHeadDim) {
    Usage(flag, ": expected 1 to ", kMaxHeadDim, " (the kernels' limit), got ", value);
  }
}

void CheckBlock(int64_t value, const char* flag) {
  if (value <= 0 || value % 16 != 0) {
    Usage(flag, ": expected a positive multiple of 16, got ", value);
  }
}

// A number, or null when absent.
nlohmann::json OptionalNumber(const std::optional<double>& x) {
  return x ? nlohmann::json(*x) : nlohmann::json();
}

// "seq 8192 (2/3)" for the progress line.
std::string PhaseName(const std::vector<int64_t>& seqs, size_t i) {
  return "seq " + std::to_string(seqs[i]) + " (" + std::to_string(i + 1) + "/" +
         std::to_string(seqs.size()) + ")";
}

}  // namespace

BenchConfig ResolveConfig(const BenchArgs& a, int64_t seq, int world, int mpi_threads) {
  BenchConfig c;
  c.batch = a.batch;
  c.seq = seq;
  c.q_seq = a.q_seq.value_or(seq);
  c.heads = a.heads;
  c.kv_heads = a.kv_heads.value_or(a.heads);
  c.head_dim = a.head_dim;
  c.v_head_dim = a.v_head_dim.value_or(a.head_dim);
  CheckPositive(c.batch, "--batch");
  CheckPositive(c.seq, "--seq");
  CheckPositive(c.q_seq, "--q-seq");
  CheckPositive(c.heads, "--heads");
  CheckPositive(c.kv_heads, "--kv-heads");
  CheckHeadDim(c.head_dim, "--head-dim");
  CheckHeadDim(c.v_head_dim, "--v-head-dim");
  if (c.heads % c.kv_heads != 0) {
    Usage("--kv-heads: ", c.kv_heads, " must divide --heads ", c.heads);
  }
  c.mask = a.mask;
  try {
    Mask::Parse(a.mask);
  } catch (const Error& e) {
    Usage("--mask: ", e.what());
  }
  try {
    c.layout = ParseLayout(a.layout);
  } catch (const Error&) {
    Usage("--layout: expected contiguous, zigzag or striped, got '", a.layout, "'");
  }
  if (a.backend != "threads" && a.backend != "mpi") {
    Usage("--backend: expected threads or mpi, got '", a.backend, "'");
  }
  c.mpi = a.backend == "mpi";
  if (a.dtype == "f32") {
    c.dtype = DType::kF32;
  } else if (a.dtype == "bf16") {
    c.dtype = DType::kBF16;
  } else {
    Usage("--dtype: expected f32 or bf16, got '", a.dtype, "'");
  }
  if (a.pass == "fwd") {
    c.pass = Pass::kFwd;
  } else if (a.pass == "bwd") {
    c.pass = Pass::kBwd;
  } else if (a.pass == "fwdbwd") {
    c.pass = Pass::kFwdBwd;
  } else {
    Usage("--pass: expected fwd, bwd or fwdbwd, got '", a.pass, "'");
  }
  if (a.ranks && (*a.ranks < 1 || *a.ranks > 4096)) {
    Usage("--ranks: expected 1 to 4096, got ", *a.ranks);
  }
  if (c.mpi && a.ranks && *a.ranks != world) {
    Usage("--ranks ", *a.ranks, " does not match the ", world, " MPI processes (mpirun -np ", world,
          ")");
  }
  c.ranks = c.mpi ? world : a.ranks.value_or(1);
  if (a.ulysses < 1 || c.ranks % a.ulysses != 0) {
    Usage("--ulysses: expected a divisor of the ", c.ranks, " ranks, got ", a.ulysses);
  }
  if (c.heads % a.ulysses != 0) {
    Usage("--ulysses: ", a.ulysses, " must divide --heads ", c.heads,
          " (each rank of a group computes H/U heads)");
  }
  if (c.kv_heads % a.ulysses != 0 && a.ulysses % c.kv_heads != 0) {
    Usage("--ulysses: ", a.ulysses, " must be a divisor or a multiple of --kv-heads ", c.kv_heads,
          " (kv heads are split over a group, or replicated when fewer than U)");
  }
  c.ulysses = a.ulysses;
  if (c.ranks > 1) {
    const int64_t div = c.layout == Layout::kZigzag ? 2 * int64_t{c.ranks} : c.ranks;
    for (const auto& [len, flag] : {std::pair{c.seq, "--seq"}, std::pair{c.q_seq, "--q-seq"}}) {
      if (len % div != 0) {
        Usage(flag, ": ", len, " does not divide by ", div,
              c.layout == Layout::kZigzag ? " (2 x ranks for --layout zigzag)" : "", " with ",
              c.ranks, " ranks");
      }
    }
  }
  CheckThreadsPerRank(a.threads_per_rank);
  c.threads_per_rank = a.threads_per_rank != 0
                           ? a.threads_per_rank
                           : (c.mpi ? mpi_threads : DefaultThreadsPerRank(c.ranks));
  if (a.warmup < 0) Usage("--warmup: expected >= 0, got ", a.warmup);
  if (a.iters < 1) Usage("--iters: expected >= 1, got ", a.iters);
  c.warmup = a.warmup;
  c.iters = a.iters;
  c.check = a.check;
  CheckPositive(a.check_rows, "--check-rows");
  c.check_rows = a.check_rows;
  CheckBlock(a.block_q, "--block-q");
  CheckBlock(a.block_kv, "--block-kv");
  c.blocks.q = a.block_q;
  c.blocks.kv = a.block_kv;
  // Seeds above 2^53 would not survive the JSON line (a double) exactly.
  constexpr int64_t kMaxSeed = (int64_t{1} << 53) - 1;
  if (a.seed < 0 || a.seed > kMaxSeed) {
    Usage("--seed: expected 0 to ", kMaxSeed, " (2^53 - 1), got ", a.seed);
  }
  c.seed = static_cast<uint64_t>(a.seed);
  if (!(std::isfinite(a.comm_timeout) && a.comm_timeout > 0)) {
    Usage("--comm-timeout: expected a number of seconds > 0, got ", a.comm_timeout);
  }
  c.comm_timeout = a.comm_timeout;
  CheckEnvironment(c.ranks, c.pass != Pass::kFwd);
  return c;
}

nlohmann::json ToJson(const BenchResult& r) {
  const BenchConfig& c = r.config;
  const bool measured = r.bandwidth_measurements > 0;
  nlohmann::json config = {
      {"batch", c.batch},
      {"seq", c.seq},
      {"q_seq", c.q_seq},
      {"heads", c.heads},
      {"kv_heads", c.kv_heads},
      {"head_dim", c.head_dim},
      {"v_head_dim", c.v_head_dim},
      {"mask", c.mask},
      {"layout", LayoutName(c.layout)},
      {"ranks", c.ranks},
      {"ulysses", c.ulysses},
      {"backend", c.mpi ? "mpi" : "threads"},
      {"dtype", DTypeName(c.dtype)},
      {"pass", PassName(c.pass)},
      {"threads_per_rank", c.threads_per_rank},
      {"warmup", c.warmup},
      {"iters", c.iters},
      {"check", c.check},
      {"check_rows", c.check_rows},
      {"block_q", c.blocks.q},
      {"block_kv", c.blocks.kv},
      {"seed", c.seed},
  };
  nlohmann::json j = {
      {"config", config},
      {"kernel_path", r.kernel_path},
      {"seconds", r.seconds},
      {"forward_seconds", r.forward_seconds},
      {"backward_seconds", r.backward_seconds},
      {"allowed_pairs", r.allowed_pairs},
      {"kv_bytes", r.kv_bytes},
      {"kv_gb_per_s", r.kv_gb_per_s},
      {"flops", r.flops},
      {"gflops", r.gflops},
      {"peak_gflops", r.peak_gflops},
      {"peak_method", r.peak_method},
      {"peak_threads", r.peak_threads},
      {"peak_measurements", r.peak_measurements},
      // null, never a figure above what the machine can do, when the peak
      // measurement was unreliable (peak_unreliable_reason says why).
      {"fraction_of_peak", OptionalNumber(r.fraction_of_peak)},
      {"amx_peak_gflops", r.amx_peak_gflops},
      {"fraction_of_amx_peak", OptionalNumber(r.fraction_of_amx_peak)},
      {"peak_unreliable", !r.peak_unreliable_reason.empty()},
      // Decoding-shaped calls only (docs/CLI.md), else null: the probe did
      // not run. The fraction is null, never above 1, when the bandwidth
      // measurement was unreliable (bandwidth_unreliable_reason says why).
      {"read_gb_per_s", OptionalNumber(r.read_gb_per_s)},
      {"bandwidth_method", measured ? nlohmann::json(r.bandwidth_method) : nlohmann::json()},
      {"bandwidth_threads", measured ? nlohmann::json(r.bandwidth_threads) : nlohmann::json()},
      {"bandwidth_bytes", measured ? nlohmann::json(r.bandwidth_bytes) : nlohmann::json()},
      {"bandwidth_measurements", r.bandwidth_measurements},
      {"fraction_of_bandwidth", OptionalNumber(r.fraction_of_bandwidth)},
      {"bandwidth_unreliable", !r.bandwidth_unreliable_reason.empty()},
      {"kernel_flops", r.kernel_flops},
      {"computed_blocks", r.computed_blocks},
      {"skipped_blocks", r.skipped_blocks},
      {"compute_seconds", r.compute_seconds},
      {"comm_wait_seconds", r.comm_wait_seconds},
      {"all_to_all_seconds", r.all_to_all_seconds},
      {"rank_flops", r.rank_flops},
      {"imbalance", r.imbalance},
  };
  if (!r.peak_unreliable_reason.empty()) j["peak_unreliable_reason"] = r.peak_unreliable_reason;
  if (!r.bandwidth_unreliable_reason.empty()) {
    j["bandwidth_unreliable_reason"] = r.bandwidth_unreliable_reason;
  }
  if (r.check) {
    // JSON has no infinity: a non-finite error (NaN or inf mismatch) is null.
    auto number = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); };
    nlohmann::json errors = nlohmann::json::object();
    for (const auto& [name, err] : r.check->errors) errors[name] = number(err);
    j["max_rel_err"] = number(r.check->max_rel_err);
    j["check"] = {{"q_rows", r.check->q_rows},
                  {"kv_rows", r.check->kv_rows},
                  {"rel_err", errors},
                  {"reference", "single-device AttentionForward/AttentionBackward"}};
  }
  return j;
}

CLI::App* AddBenchCommand(CLI::App& app, BenchArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Measure the ring (or the single-device kernel) on seeded random inputs; one "
      "JSON object per configuration on stdout.");
  cmd->add_option("--batch", a.batch, "batch B")->capture_default_str();
  cmd->add_option("--seq", a.seq, "key/value length Skv; a comma list runs each (1024,2048)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option_function<int64_t>(
         "--q-seq", [&a](const int64_t& n) { a.q_seq = n; }, "query length Sq (default: = --seq)")
      ->type_name("INT");
  cmd->add_option("--heads", a.heads, "query heads H")->capture_default_str();
  cmd->add_option_function<int64_t>(
         "--kv-heads", [&a](const int64_t& n) { a.kv_heads = n; },
         "key/value heads Hkv, dividing H (default: = --heads)")
      ->type_name("INT");
  cmd->add_option("--head-dim", a.head_dim, "head dim D, 1 to 256")->capture_default_str();
  cmd->add_option_function<int64_t>(
         "--v-head-dim", [&a](const int64_t& n) { a.v_head_dim = n; },
         "value head dim Dv, 1 to 256 (default: = --head-dim)")
      ->type_name("INT");
  cmd->add_option("--mask", a.mask, "mask text, as for attend")->capture_default_str();
  cmd->add_option("--layout", a.layout, "contiguous|zigzag|striped")->capture_default_str();
  cmd->add_option_function<int>(
         "--ranks", [&a](const int& n) { a.ranks = n; },
         "ring size, 1 to 4096 (default 1; under mpirun: the process count)")
      ->type_name("INT");
  cmd->add_option("--ulysses", a.ulysses,
                  "2-D context parallelism: ranks per Ulysses group U (divides the ranks and "
                  "--heads); the ring runs over ranks/U groups (docs/CONTEXT_PARALLEL.md)")
      ->capture_default_str();
  cmd->add_option("--backend", a.backend, "threads|mpi")->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "f32|bf16")->capture_default_str();
  cmd->add_option("--pass", a.pass, "fwd|bwd|fwdbwd")->capture_default_str();
  cmd->add_option("--threads-per-rank", a.threads_per_rank, kThreadsPerRankHelp);
  cmd->add_option("--warmup", a.warmup, "untimed iterations")->capture_default_str();
  cmd->add_option("--iters", a.iters, "timed iterations (median reported)")->capture_default_str();
  cmd->add_flag("--check", a.check, "compare sampled rows with the single-device kernel");
  cmd->add_option("--check-rows", a.check_rows, "rows sampled by --check")->capture_default_str();
  cmd->add_option("--block-q", a.block_q, "query tile size (a multiple of 16)")
      ->capture_default_str();
  cmd->add_option("--block-kv", a.block_kv, "key/value tile size (a multiple of 16)")
      ->capture_default_str();
  cmd->add_option("--seed", a.seed, "input seed, 0 to 2^53 - 1")->capture_default_str();
  cmd->add_option("--comm-timeout", a.comm_timeout, "seconds a rank waits for a peer")
      ->capture_default_str();
  cmd->footer(
      "\nExample:\n  ringsplash bench --seq 4096,8192 --mask causal --ranks 4 --pass fwdbwd "
      "--check\n\nFLOPs are useful FLOPs: forward = 2*B*(D+Dv)*allowed pairs (summed over "
      "heads); backward = 2.5 x forward. See docs/CLI.md.");
  return cmd;
}

int RunBench(const BenchArgs& args) {
  if (args.seq.empty()) Usage("--seq: expected at least one length");
  if (args.backend == "mpi") {
    CommOptions copt;
    copt.timeout_s = args.comm_timeout;
    std::unique_ptr<Communicator> comm = MakeMpiCommunicator(copt);
    const bool root = comm->rank() == 0;
    Progress progress("ringsplash bench", root);
    try {
      comm->Barrier();  // every rank past the collective creation (as attend)
      for (size_t i = 0; i < args.seq.size(); ++i) {
        progress.Phase(PhaseName(args.seq, i));
        const BenchResult r = RunBenchOnRank(
            *comm, ResolveConfig(args, args.seq[i], comm->size(), comm->DefaultThreads()));
        progress.Phase("");
        if (root) std::cout << ToJson(r).dump() << std::endl;
      }
    } catch (const std::exception& e) {
      comm->Abort(FailureReason(e));
      if (!root) throw SilentFailure();
      throw;
    }
    return kExitOk;
  }
  // Resolve every configuration first: a bad value fails before any run.
  std::vector<BenchConfig> configs;
  for (int64_t seq : args.seq) configs.push_back(ResolveConfig(args, seq, 0));
  InstallSignalHandlers("ringsplash bench");
  Progress progress("ringsplash bench", true);
  for (size_t i = 0; i < configs.size(); ++i) {
    progress.Phase(PhaseName(args.seq, i));
    const BenchResult r = RunBenchThreads(configs[i]);
    progress.Phase("");
    std::cout << ToJson(r).dump() << std::endl;
  }
  return kExitOk;
}

}  // namespace ringsplash::cli

// One measured configuration of the ring (or the single-device kernel): the
// engine behind `ringsplash bench` and `ringsplash demo`.
//
// Every rank generates only its own shard of the seeded random inputs
// (random_fill.h), runs warmup + timed iterations between barriers, and the
// per-rank accounting is gathered on rank 0. With `check`, sampled rows of
// the ring's results are compared with the single-device kernel on rank 0.
#ifndef RINGSPLASH_TOOLS_BENCH_RUN_H_
#define RINGSPLASH_TOOLS_BENCH_RUN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "tools/flop_count.h"

namespace ringsplash::cli {

// A fully resolved configuration (no "default" placeholders left).
struct BenchConfig {
  int64_t batch = 1;
  int64_t seq = 4096;    // Skv
  int64_t q_seq = 4096;  // Sq
  int64_t heads = 8;
  int64_t kv_heads = 8;
  int64_t head_dim = 128;
  int64_t v_head_dim = 128;
  std::string mask = "full";
  Layout layout = Layout::kZigzag;
  int ranks = 1;
  int ulysses = 1;   // U: ranks per Ulysses group; the ring runs over ranks / U groups
  bool mpi = false;  // backend: false = threads
  DType dtype = DType::kF32;
  Pass pass = Pass::kFwd;
  int threads_per_rank = 1;
  int warmup = 1;
  int iters = 5;
  bool check = false;
  int64_t check_rows = 64;
  BlockSizes blocks;
  uint64_t seed = 0;
  double comm_timeout = 60;
};

// Errors of the sampled check, each max|ring - single| / max|single| over the
// sampled rows of one tensor.
struct CheckResult {
  int64_t q_rows = 0;   // sampled query rows (out, lse, dq)
  int64_t kv_rows = 0;  // sampled key/value rows (dk, dv); 0 for forward only
  std::vector<std::pair<std::string, double>> errors;  // {"out", 1e-7}, ...
  double max_rel_err = 0;
};

struct BenchResult {
  BenchConfig config;
  std::string kernel_path;  // the path of the dtype's products (KernelPathFor)
  double seconds = 0;       // median per iteration (forward + backward as configured)
  double forward_seconds = 0, backward_seconds = 0;  // medians, 0 if not run
  double allowed_pairs = 0;
  // Bytes of K and V (the whole sequence, the dtype's size) and kv_bytes over
  // seconds: the rate of decoding steps, which are bound by reading K and V.
  double kv_bytes = 0, kv_gb_per_s = 0;
  double flops = 0;         // useful FLOPs per iteration (flop_count.h)
  double kernel_flops = 0;  // FLOPs the kernels spent per iteration (incl. masked elements)
  double gflops = 0;
  double peak_gflops = 0;
  std::string peak_method;
  int peak_threads = 0;
  // bf16 on the amx path only (else 0): the AMX tile peak.
  double amx_peak_gflops = 0;
  // gflops over peak_gflops and over amx_peak_gflops (0 without one); both
  // absent when even a second measurement left the peak below the run's rate
  // (peak.h, SettlePeak), with the reason.
  std::optional<double> fraction_of_peak, fraction_of_amx_peak;
  std::string peak_unreliable_reason;  // empty when the fractions are there
  int peak_measurements = 1;           // 2 when the peak was measured again
  // Decoding-shaped calls only (bandwidth.h DecodingShaped), else absent / 0:
  // the read bandwidth of the threads this run used (1e9 bytes per second),
  // how it was measured, and kv_gb_per_s over it; the fraction absent when
  // even a second measurement left the bandwidth below the run's rate
  // (SettleBandwidth), with the reason.
  std::optional<double> read_gb_per_s;
  std::string bandwidth_method;
  int bandwidth_threads = 0;
  int64_t bandwidth_bytes = 0;     // the probe's buffer (all processes' under MPI)
  int bandwidth_measurements = 0;  // 0: not measured (not decoding-shaped), 1, or 2
  std::optional<double> fraction_of_bandwidth;
  std::string bandwidth_unreliable_reason;  // non-empty exactly when measured but no fraction
  int64_t computed_blocks = 0, skipped_blocks = 0;                     // per iteration, all ranks
  std::vector<double> compute_seconds, comm_wait_seconds, rank_flops;  // per rank, per iteration
  // Per rank, per iteration: seconds in the all-to-alls of 2-D context
  // parallelism (both passes; all 0 with ulysses = 1).
  std::vector<double> all_to_all_seconds;
  double imbalance = 1;  // max / mean of rank_flops
  std::optional<CheckResult> check;
};

// Runs `config` on `comm` (collective: every rank calls it). The result is
// complete on rank 0 only.
BenchResult RunBenchOnRank(Communicator& comm, const BenchConfig& config);
// Runs `config` on config.ranks thread ranks of this process.
BenchResult RunBenchThreads(const BenchConfig& config);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_BENCH_RUN_H_

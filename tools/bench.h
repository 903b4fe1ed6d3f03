// `ringsplash bench`: measured configurations, one JSON object per line.
#ifndef RINGSPLASH_TOOLS_BENCH_H_
#define RINGSPLASH_TOOLS_BENCH_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tools/bench_run.h"

namespace CLI {
class App;
}

namespace ringsplash::cli {

// The command line; an absent optional means "derive the default" (a value
// given, 0 included, is checked as given).
struct BenchArgs {
  int64_t batch = 1;
  std::vector<int64_t> seq = {4096};  // one JSON line per value
  std::optional<int64_t> q_seq;       // absent: = seq
  int64_t heads = 8;
  std::optional<int64_t> kv_heads;  // absent: = heads
  int64_t head_dim = 128;
  std::optional<int64_t> v_head_dim;  // absent: = head_dim
  std::string mask = "full";
  std::string layout = "zigzag";
  std::optional<int> ranks;  // absent: 1 (threads) or the MPI world size
  int ulysses = 1;           // U: ranks per Ulysses group (2-D context parallelism)
  std::string backend = "threads";
  std::string dtype = "f32";
  std::string pass = "fwd";
  int threads_per_rank = 0;  // 0: cores / ranks
  int warmup = 1;
  int iters = 5;
  bool check = false;
  int64_t check_rows = 64;
  int64_t block_q = 128;
  int64_t block_kv = 128;
  int64_t seed = 0;  // 0 .. 2^53 - 1 (so that a JSON number holds it exactly)
  double comm_timeout = 60;
};

CLI::App* AddBenchCommand(CLI::App& app, BenchArgs& args);
// Runs every configuration; prints one JSON object per line on stdout
// (rank 0 only under MPI). Returns the exit status.
int RunBench(const BenchArgs& args);

// The JSON object of one result (fields documented in docs/CLI.md).
nlohmann::json ToJson(const BenchResult& result);

// Checks and resolves the common configuration flags (UsageError on any
// problem); `seq` is one value of the list, `world` the MPI size (0: threads).
// `world`: the MPI world size (0 for threads); `mpi_threads`: the MPI
// communicator's DefaultThreads() (the cores this rank may use), the
// default --threads-per-rank under MPI.
BenchConfig ResolveConfig(const BenchArgs& args, int64_t seq, int world, int mpi_threads = 1);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_BENCH_H_

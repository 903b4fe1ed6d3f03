// `ringsplash attend`: attention (forward, optionally backward) on arrays
// saved by NumPy, on one device, on a ring of threads, or under mpirun.
#ifndef RINGSPLASH_TOOLS_ATTEND_H_
#define RINGSPLASH_TOOLS_ATTEND_H_

#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace ringsplash::cli {

// The command line, as given (validated by RunAttend).
struct AttendArgs {
  std::string q, k, v, out, lse;
  std::string mask = "full";
  std::string dense_mask;
  std::optional<double> softcap, scale;
  std::string sinks, q_segments, kv_segments;
  std::string dout, dq, dk, dv, dsinks;
  std::optional<int> ranks;  // absent: 1 for threads, the MPI world size for mpi
  int ulysses = 1;           // U: ranks per Ulysses group (2-D context parallelism)
  std::string layout = "zigzag";
  std::string backend = "threads";
  std::string dtype = "f32";
  int threads_per_rank = 0;  // 0: the cores each rank may use
  double comm_timeout = 60.0;
};

// Adds the `attend` subcommand to `app`, filling `args`.
CLI::App* AddAttendCommand(CLI::App& app, AttendArgs& args);
// Runs it. Throws UsageError (bad command line) or Error/std::exception
// (bad input files, failures); on any throw no output file is left behind.
void RunAttend(const AttendArgs& args);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_ATTEND_H_

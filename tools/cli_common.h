// Pieces shared by the subcommands: the usage-error type (exit status 2),
// small collectives built on Communicator::AllReduceSum, and helpers.
#ifndef RINGSPLASH_TOOLS_CLI_COMMON_H_
#define RINGSPLASH_TOOLS_CLI_COMMON_H_

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/tensor.h"

namespace ringsplash::cli {

// A problem with the command line itself (flags, their values, their
// combination): exit status 2. Everything else that fails is status 1.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message) : std::runtime_error(message) {}
};

// A failure already reported elsewhere (e.g. by MPI rank 0): exit status 1
// without printing anything.
class SilentFailure : public std::runtime_error {
 public:
  SilentFailure() : std::runtime_error("failure reported by another rank") {}
};

template <typename... Args>
[[noreturn]] void Usage(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw UsageError(os.str());
}

// The CLI checks the library's limits (kMaxHeadDim, kMaxThreads in
// ringsplash/attention.h) itself first, so that the error names the flag or
// the file rather than the library's argument.

// --threads-per-rank: 1..kMaxThreads, or 0 for the default (the cores each rank may use);
// a usage error otherwise. kThreadsPerRankHelp: its --help line.
void CheckThreadsPerRank(int threads_per_rank);
inline constexpr const char* kThreadsPerRankHelp =
    "kernel threads per rank, 1 to 1024 (default, or 0: the cores each rank may use)";

// Checks the environment variables the library reads, before any rank
// starts, so that a bad value is one usage error naming the variable rather
// than "rank R failed: ..." from whichever rank read it first:
// RINGSPLASH_KERNEL (a path name this CPU supports) and RINGSPLASH_FAULT
// (well formed, and aimed at a rank and a ring step of this run: `ranks`
// ranks, steps 0..ranks-1, the backward pass only if `backward` runs; with
// one rank no ring runs, so no fault can be injected).
void CheckEnvironment(int ranks, bool backward);

// The micro-kernel path that does `dtype`'s products: what kAuto (or
// RINGSPLASH_KERNEL) resolves to, except that f32 products (f16 inputs are
// widened to f32) have no bf16 or AMX form, so on the avx512_bf16 and amx
// paths they run on AVX-512 FMA.
std::string KernelPathFor(DType dtype);

// Exit statuses.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Every rank contributes `value`; every rank gets all values, indexed by rank.
// Exact for doubles (each is carried as three floats that sum back exactly).
std::vector<double> AllGather(Communicator& comm, double value);
// Every rank contributes its own vector (same length on every rank); returns
// the element-wise sum. Used to assemble on every rank buffers to which each
// rank wrote disjoint entries (all other entries zero), so it is exact.
void SumInto(Communicator& comm, std::vector<float>& data);
// Rank 0's `value` (< 2^48) on every rank.
uint64_t Broadcast(Communicator& comm, uint64_t value);

// Kernel threads per rank when the user gave none: comm.DefaultThreads()
// (include/ringsplash/comm.h: the cores this rank's process may use — its
// affinity mask — shared by the ranks that run on them; under mpirun, the
// processes on this machine whose masks overlap). >= 1.
int DefaultThreadsPerRank(const Communicator& comm);
// The same for `ranks_sharing_cores` ranks that share this process's cores
// (the thread ranks of one RunThreadRanks, before their communicators
// exist): the process's usable cores / ranks_sharing_cores, >= 1 — what
// their communicators' DefaultThreads() will say.
int DefaultThreadsPerRank(int ranks_sharing_cores);
// Ranks sharing this machine: OMPI_COMM_WORLD_LOCAL_SIZE under Open MPI,
// else `fallback`.
int LocalRanks(int fallback);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_CLI_COMMON_H_

// A rank program for mpi_fault_test: it is MEANT to fail, in one of these ways
// (argv[1]):
//   abort R       rank R calls Abort("deliberate failure") mid-ring and throws
//   silent R      rank R stops communicating (sleeps 120 s); timeout_s = 1
//   split-abort R, split-silent R
//                 the same within groups: the ranks split by color = rank % 2
//                 and shift in their group; then every rank joins a barrier
//                 of the whole job (so no rank finishes as if nothing failed)
//   ring R S      the ring forward with fault injection at rank R, step S
//   ring-bwd R S  the same in the backward
//   env           the ring forward+backward; the fault comes from RINGSPLASH_FAULT
// Every rank prints one line to stdout: "[rank r] ok" or
// "[rank r] error_at_ns=<steady clock ns> error: <message>", and exits 1 on
// error. steady_clock is CLOCK_MONOTONIC, shared by the processes of one
// machine, so the test can compute how long failure detection took.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"

namespace {

using ringsplash::Communicator;
using ringsplash::Error;

long long NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Shifts of 4 MB (above every eager limit, so a send needs its receiver).
// This rank fails at the second round if `fails`.
void ShiftRounds(Communicator& comm, int rounds, bool fails, bool abort) {
  std::vector<char> a(4 << 20, 1), b(4 << 20);
  for (int i = 0; i < rounds; ++i) {
    if (fails && i == 1) {
      if (abort) {
        comm.Abort("deliberate failure");
        throw Error("deliberate failure");
      }
      std::this_thread::sleep_for(std::chrono::seconds(120));  // silent: never posts again
    }
    comm.Wait(comm.StartShift(a.data(), b.data(), a.size()));
  }
}

void RunRing(Communicator& comm, const std::optional<ringsplash::FaultSpec>& fault) {
  ringsplash::mpi_testing::Problem p;
  p.spec.sq = p.spec.skv = 96;
  p.spec.h = 4;
  p.spec.hkv = 2;
  p.spec.sinks = true;
  const auto g = ringsplash::mpi_testing::MakeGlobal(p);
  ringsplash::RingOptions options;
  options.layout = ringsplash::Layout::kZigzag;
  options.attention.mask = ringsplash::Mask::Causal();
  options.attention.num_threads = 1;
  options.fault = fault;  // nullopt: RINGSPLASH_FAULT
  auto l = ringsplash::mpi_testing::MakeLocal(p, g, options.layout, comm.rank(), comm.size());
  ringsplash::mpi_testing::RunRingOnRank(comm, p, options, l, /*backward=*/true);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int a = argc > 2 ? std::atoi(argv[2]) : 0;
  const int b = argc > 3 ? std::atoi(argv[3]) : 0;
  ringsplash::CommOptions options;
  options.timeout_s = mode == "silent" || mode == "split-silent" ? 1.0 : 60.0;
  int rank = -1;
  try {
    std::unique_ptr<Communicator> comm = ringsplash::MakeMpiCommunicator(options);
    rank = comm->rank();
    if (mode == "abort" || mode == "silent") {
      ShiftRounds(*comm, 3, rank == a, mode == "abort");
    } else if (mode == "split-abort" || mode == "split-silent") {
      std::unique_ptr<Communicator> group = comm->Split(rank % 2, rank);
      ShiftRounds(*group, 3, rank == a, mode == "split-abort");
      // The other group's ranks finish at once: in the barrier they would
      // time out (1 s) about when the silent rank's partner does in its
      // shift, and whichever reports first ends the job, so the partner's
      // message naming the group would be a race. They wait 3 s first.
      if (mode == "split-silent" && rank % 2 != a % 2) {
        std::this_thread::sleep_for(std::chrono::seconds(3));
      }
      comm->Barrier();
    } else if (mode == "ring" || mode == "ring-bwd") {
      ringsplash::FaultSpec f;
      f.rank = a;
      f.step = b;
      f.backward = mode == "ring-bwd";
      RunRing(*comm, f);
    } else if (mode == "env") {
      RunRing(*comm, std::nullopt);
    } else {
      std::fprintf(stderr,
                   "usage: %s abort|silent|split-abort|split-silent R | ring|ring-bwd R S | env\n",
                   argv[0]);
      return 2;
    }
  } catch (const std::exception& e) {
    std::printf("[rank %d] error_at_ns=%lld error: %s\n", rank, NowNs(), e.what());
    std::fflush(stdout);
    return 1;
  }
  std::printf("[rank %d] ok\n", rank);
  std::fflush(stdout);
  return 0;
}

// Communicator: the small transport interface the ring runs on (SPEC §5).
//
// Backends: `threads` (N ranks as threads of one process) and `mpi` (one rank
// per process under mpirun). A rank that fails calls Abort(); every other rank
// then fails its next Wait/AllReduce/Barrier with an Error naming the failed
// rank, and a peer that stops answering makes them fail after `timeout_s` —
// never a silent hang.
#ifndef RINGSPLASH_COMM_H_
#define RINGSPLASH_COMM_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace ringsplash {

// An emulated interconnect: every ring-shift message between two different
// ranks takes `latency_seconds + bytes / bandwidth_bytes_per_second` to
// arrive, and the link from a rank to the next carries one message at a
// time (bandwidth is shared by messages in flight, latency is not: a message
// starts when the link is free, occupies it for bytes / bandwidth, and
// arrives latency after that). It lets one machine behave like a cluster
// with a slower network, for measuring how much communication a ring hides
// (the overlap tests) and for checking a cost model.
//
// Where it applies:
//   threads: a message starts when both ranks have posted the shift (and the
//     link is free); the shift completes — Wait returns on both ranks — at
//     its arrival time, or when the real copy is done if that is later. The
//     delivery threads do the waiting, so the time passes while the ranks
//     compute, as on a network with its own engine.
//   mpi (for testing): the modelled time starts when the progress thread sees
//     MPI complete the receive, and the receive is reported done only at its
//     arrival time, so it ADDS to the real transfer and — like the data
//     itself — advances only while the process drives progress: with
//     RINGSPLASH_MPI_PROGRESS=wait it is exposed in full (the overlap tests'
//     no-overlap baseline).
// Not delayed: messages a rank sends itself (a ring of one), AllReduceSum
// and Barrier. A delay longer than CommOptions::timeout_s makes Wait time out.
struct LinkModel {
  double latency_seconds = 0;             // per message; >= 0
  double bandwidth_bytes_per_second = 0;  // > 0, or 0 for unlimited
  // Seconds a message of `bytes` occupies the link (bytes / bandwidth; 0
  // when unlimited) and the whole time from its start to its arrival.
  double OccupySeconds(size_t bytes) const;
  double MessageSeconds(size_t bytes) const { return latency_seconds + OccupySeconds(bytes); }
  // True unless both terms are 0 (no delay at all).
  bool active() const { return latency_seconds > 0 || bandwidth_bytes_per_second > 0; }
  // Throws Error naming `what` unless both values are finite, latency >= 0
  // and bandwidth >= 0.
  void Check(const std::string& what) const;
  // "LATENCY_US" or "LATENCY_US,GBPS": microseconds per message and
  // gigabytes (1e9 bytes) per second, e.g. "5,25" (5 us, 25 GB/s) or "50000"
  // (50 ms, unlimited bandwidth). Throws Error on anything else.
  static LinkModel Parse(const std::string& text);
  // From the environment variable RINGSPLASH_LINK (same syntax); nullopt if
  // unset or empty. Throws Error naming the variable if it does not parse.
  static std::optional<LinkModel> FromEnv();
};

struct CommOptions {
  double timeout_s = 60.0;  // how long a Wait may block before it is an Error
  // The emulated link (above). Default: LinkModel::FromEnv() when the
  // communicators are made, so RINGSPLASH_LINK reaches every program; none if
  // unset. LinkModel{} overrides the environment with no delay.
  std::optional<LinkModel> link;
};

class Communicator {
 public:
  using Handle = int64_t;
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;

  // Starts sending `bytes` bytes at `send` to rank+1 and receiving `bytes`
  // bytes from rank-1 into `recv` (the ring shift). Returns at once; both
  // buffers must stay untouched until Wait(handle) returns. Several shifts
  // may be in flight; they complete in the order started.
  virtual Handle StartShift(const void* send, void* recv, size_t bytes) = 0;
  // Blocks until the shift is done. Throws Error if a peer failed or the
  // timeout passed.
  virtual void Wait(Handle handle) = 0;
  // Element-wise sum over all ranks, in place; same result on every rank.
  virtual void AllReduceSum(float* data, size_t count) = 0;
  virtual void Barrier() = 0;
  // Tells every peer this rank has failed (best effort, never throws, never blocks long).
  virtual void Abort(const std::string& reason) noexcept = 0;
};

// Runs fn on `num_ranks` threads, each with its own Communicator of the
// threads backend. Returns when all are done; if any rank threw, the others
// are aborted and an Error is thrown whose message names the first failed
// rank and its reason.
void RunThreadRanks(int num_ranks, const CommOptions& options,
                    const std::function<void(Communicator&)>& fn);

// True when this build has the MPI backend.
bool MpiAvailable();
// The MPI backend over MPI_COMM_WORLD (initialises MPI on first use and
// finalises at exit). Throws Error if MPI is not built in, or cannot be
// initialised: MPI_Init_thread fails or grants less than
// MPI_THREAD_FUNNELED, or the application initialised MPI itself without
// MPI_THREAD_MULTIPLE.
//
// Failures of the MPI backend are final for the life of the process (MPI
// cannot be initialised twice, and a failed peer's messages cannot be
// unsent): after an initialisation failure every later call throws the same
// Error; after Abort() on any rank, a peer failure or a timeout, every later
// StartShift/Wait/AllReduceSum/Barrier of every MPI communicator of this
// process throws, including communicators made afterwards. Recover by
// starting a new job. (The threads backend starts afresh with each
// RunThreadRanks.)
std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& options);

}  // namespace ringsplash

#endif  // RINGSPLASH_COMM_H_

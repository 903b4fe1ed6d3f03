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
#include <string>

namespace ringsplash {

struct CommOptions {
  double timeout_s = 60.0;  // how long a Wait may block before it is an Error
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

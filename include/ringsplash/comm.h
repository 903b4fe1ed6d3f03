// Communicator: the small transport interface the ring runs on (SPEC §5).
//
// Backends: `threads` (N ranks as threads of one process) and `mpi` (one rank
// per process under mpirun). A rank that fails calls Abort(); every other rank
// then fails its next Wait/AllReduce/Barrier/AllToAll/Split with an Error
// naming the failed rank, and a peer that stops answering makes them fail
// after `timeout_s` — never a silent hang.
//
// Groups. Split() makes a communicator for each group of ranks (like
// MPI_Comm_split), and include/ringsplash/comm_mpi.h wraps a communicator the
// application made (MPI_Comm), so a data-parallel x context-parallel grid runs
// several rings side by side in one job. Every communicator has its own
// channels: messages and collectives of one never match another's, so rings
// on different communicators may run at once (on the same rank too, from
// different threads). A communicator itself serves one call at a time (one
// thread). The options (timeout, link model) carry over to a split.
//
// One job, one failure. The communicators of one job — a RunThreadRanks and
// every communicator split from its ranks' communicators; an MPI job and
// every MPI communicator of its processes — fail together: Abort(), a
// timeout or any other failure on any of them makes every blocking call of
// every one of them, on every rank, throw "rank R failed: <reason>", where R
// is the failed rank's rank in the JOB (its RunThreadRanks rank, its
// MPI_COMM_WORLD rank), whatever communicator it failed on; the rank that
// failed throws the plain reason. Messages about a sub-communicator name
// ranks the same way and say which group ("... waiting for rank 3 in shift #2
// of group {1, 3}"). A job cannot recover from a failure: see
// RunThreadRanks and MakeMpiCommunicator.
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
// Each communicator has its own links (a split's messages do not queue behind
// its parent's). Not delayed: messages a rank sends itself (a ring of one),
// AllReduceSum, Barrier, AllToAll and Split. A delay longer than
// CommOptions::timeout_s makes Wait time out.
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
  // A color for Split: this rank joins no group.
  static constexpr int kNoGroup = -1;

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
  // Tells every peer this rank has failed (best effort, never throws, never
  // blocks long). Every communicator of the job fails with it (see above).
  virtual void Abort(const std::string& reason) noexcept = 0;

  // Collective over this communicator (every rank calls it, in the same
  // order as its other collectives): the ranks that pass the same color >= 0
  // form a group, ranked by (key, rank here) — MPI_Comm_split's rule. Returns
  // this rank's communicator of its group; a negative color (kNoGroup)
  // joins none and gets nullptr. The group's shifts, all-reduces, barriers
  // and all-to-alls run among its ranks alone, on channels of its own: rings
  // on different groups, and on the parent, never see each other's messages.
  // A group of one is a valid communicator (its ring shift is a copy to
  // itself). Splits may be split again. threads: each group has delivery
  // threads of its own (one per rank). mpi: MPI_Comm_split's; as with MPI,
  // processes make communicators of overlapping groups in the same order
  // (two threads of a process splitting at once may deadlock).
  // Lifetime: the returned communicator may be destroyed, and used, in any
  // order with its parent and siblings; destroying it before its peers are
  // done with the group is, to them, like its rank returning (threads: a
  // peer waiting for it fails at once; mpi: after the timeout). threads: it
  // may outlive RunThreadRanks without harm, but is useless then (its peers
  // are gone: every call fails at once). mpi: a call after MPI is finalised
  // throws Error; destroying it is always safe.
  // Errors: bad arguments on a rank, or ranks that call different
  // collectives at the same point, throw Error (and fail the job, as above).
  // The base class (for communicators written outside ringsplash) throws
  // Error: not implemented.
  virtual std::unique_ptr<Communicator> Split(int color, int key);

  // Collective: `send` holds size() blocks of `bytes_per_rank` bytes, block r
  // for rank r; on return `recv` holds, at offset r * bytes_per_rank, the
  // block rank r sent this rank (its own block is copied). Every rank passes
  // the same bytes_per_rank; send and recv must not overlap (Error). Blocks
  // until this rank's part is done and the others no longer read its
  // `send`; fails like Wait (a failed peer, the timeout: never a silent
  // hang). Not delayed by the link model. The base class throws Error: not
  // implemented.
  virtual void AllToAll(const void* send, void* recv, size_t bytes_per_rank);

  // The kernel threads a call of this rank uses when
  // AttentionOptions::num_threads is 0: the CPU cores this rank may use. It
  // starts from the cores the process may run on (its affinity mask:
  // taskset, cgroup cpusets and mpirun's binding shrink it; else
  // std::thread::hardware_concurrency()) and shares them fairly among the
  // ranks that run on them — never the machine's cores divided by the size
  // of one communicator. >= 1.
  //   threads: the process's cores / the ranks of its RunThreadRanks (every
  //     rank is a thread of this process: a split's ranks still share the
  //     process with all of them).
  //   mpi: the process's cores / the processes of this job on this machine
  //     (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) of MPI_COMM_WORLD) whose
  //     affinity masks overlap this one's, this one included; found once,
  //     when the backend starts. Unbound processes share the machine evenly;
  //     a process the launcher bound to cores of its own (mpirun's
  //     --bind-to core) uses them all; processes bound to one socket share
  //     that socket. The same for every communicator of the process.
  // The base class returns the process's cores (one rank per process and
  // machine); a wrapper around another Communicator should forward it.
  virtual int DefaultThreads() const;
};

// Runs fn on `num_ranks` threads, each with its own Communicator of the
// threads backend. Returns when all are done; if any rank threw, the others
// are aborted and an Error is thrown whose message names the first failed
// rank and its reason. Each call is its own job (its failure state starts
// afresh); sub-communicators split from its communicators belong to it.
void RunThreadRanks(int num_ranks, const CommOptions& options,
                    const std::function<void(Communicator&)>& fn);

// True when this build has the MPI backend.
bool MpiAvailable();
// The MPI backend over MPI_COMM_WORLD (initialises MPI on first use and
// finalises at exit). Collective over MPI_COMM_WORLD: every process calls
// it, in the same order as its other communicator-making calls, and gets a
// communicator of its own MPI communicator (a duplicate of MPI_COMM_WORLD),
// so its messages match no other communicator's. The first communicator a
// process makes (this or comm_mpi.h's) starts the backend, which is itself
// collective over MPI_COMM_WORLD (the abort channel, the count of processes
// per machine): every process of the job starts it, within timeout_s of
// the others. For a communicator the
// application made, see include/ringsplash/comm_mpi.h. Throws Error if MPI
// is not built in, or cannot be initialised: MPI_Init_thread fails or grants
// less than MPI_THREAD_FUNNELED, or the application initialised MPI itself
// without MPI_THREAD_MULTIPLE. An application that uses MPI itself must
// initialise it (MPI_THREAD_MULTIPLE) before its first ringsplash call, and
// may then finalise it whenever ringsplash's communicators are done with
// (ringsplash lets go of MPI as MPI_Finalize starts).
//
// Failures of the MPI backend are final for the life of the process (MPI
// cannot be initialised twice, and a failed peer's messages cannot be
// unsent): after an initialisation failure every later call throws the same
// Error; after Abort() on any rank, a peer failure or a timeout, every later
// call that communicates, of every MPI communicator of this process,
// throws, including communicators made afterwards. An Abort reaches every
// process of the job that has started the backend, whatever communicator
// it was called on. Recover by starting a new job. (The threads backend
// starts afresh with each RunThreadRanks.)
std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& options);

}  // namespace ringsplash

#endif  // RINGSPLASH_COMM_H_

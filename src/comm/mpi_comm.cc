// The `mpi` communicator backend: one rank per process under mpirun.
//
// Progress. Open MPI's shared-memory and TCP transports only move data inside
// MPI calls, so a transfer posted before a long kernel call would otherwise
// sit still until Wait. A per-process progress thread therefore owns MPI: it
// initialises it (MPI_THREAD_FUNNELED suffices, as no other thread calls
// MPI; an MPI that grants less is refused with an Error), posts the
// Isend/Irecv of each shift and all-to-all and the non-blocking collectives,
// polls MPI_Test on everything in flight every RINGSPLASH_MPI_POLL_US
// microseconds (default 50) and finalises at exit. Compute threads only queue
// commands and block on a condition variable.
// RINGSPLASH_MPI_PROGRESS=wait polls transfers only while some Wait blocks:
// the "no progress thread" baseline the overlap test measures against.
//
// Communicators. Each Communicator has an MPI communicator of its own
// (CommState): MakeMpiCommunicator duplicates MPI_COMM_WORLD or the
// application's communicator (MPI_Comm_idup, polled like a transfer), Split
// gathers every rank's (color, key) with MPI_Iallgather and then calls
// MPI_Comm_split, which no longer waits for anyone (every rank is past the
// gather). Messages of different communicators therefore never match, so
// shift sequence numbers, collectives and the tags (one for shifts, one for
// all-to-alls) are per communicator, and rings on different communicators
// run at once. The progress thread serves all of them.
//
// Link model (CommOptions::link, for testing): when the progress thread sees
// a shift's receive complete, it schedules the message on the communicator's
// incoming LinkClock and reports the receive done only once the modelled
// arrival has passed. The modelled time thus starts only when this process
// drives MPI: with RINGSPLASH_MPI_PROGRESS=wait it starts inside Wait and is
// exposed in full, which is what lets the overlap tests prove they can fail.
//
// Failure is per process and per job. A rank that fails calls Abort(): it
// sends its reason to every process of MPI_COMM_WORLD on the runtime's own
// duplicate of it and a separate tag (non-blocking). Every process keeps a
// receive posted there and polls it, so a peer's Wait/AllReduce/Barrier/...
// on ANY communicator throws "rank R failed: <reason>" (R: the world rank)
// within a poll interval; a peer that goes silent makes waits fail after
// CommOptions::timeout_s. After a failure pending receives into caller
// buffers are cancelled (bounded) before the error propagates, so callers
// may free them. A process that saw a failure does not call MPI_Finalize (it
// could block on dead peers): it exits with the application's code, which
// mpirun turns into a failed job; the rank that originated the failure
// lingers up to min(timeout, 2 s) at exit so its abort messages reach, and
// are reported by, the others before mpirun tears the job down. A finalise
// that does not finish within the timeout ends the process with _Exit(1):
// never a hang. When the application owns MPI, the runtime stops as the
// application's MPI_Finalize starts (an attribute on MPI_COMM_SELF), so that
// no ringsplash call into MPI outlives it.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/comm_mpi.h"
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"
#include "src/comm/cores.h"
#include "src/comm/mpi_ops.h"

namespace ringsplash {

namespace {

using comm_internal::Clock;
using comm_internal::CommState;
using comm_internal::DeadlineAfter;
using comm_internal::FormatSeconds;
using comm_internal::MpiErrorText;
using comm_internal::Op;
using comm_internal::OpKind;
using comm_internal::PeerFailedMessage;
using Handle = Communicator::Handle;

constexpr int kAbortTag = 7302;
constexpr int kAbortMessageMax = 1024;

std::string ThreadLevelName(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
  return std::to_string(level);
}

// The value of environment variable `name`, a finite number > 0; `fallback`
// if unset or empty. Anything else is an Error naming the variable (a typo
// must not silently fall back).
double EnvPositive(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  Check(end != v && *end == '\0' && std::isfinite(x) && x > 0, name,
        ": expected a number > 0 (microseconds), got '", v, "'");
  return x;
}

// RINGSPLASH_MPI_POLL_US (default 50) and RINGSPLASH_MPI_PROGRESS (unset,
// or "wait"), checked.
struct Tuning {
  double poll_us = 50;
  bool wait_only = false;
  static Tuning FromEnvironment() {
    Tuning t;
    t.poll_us = EnvPositive("RINGSPLASH_MPI_POLL_US", 50);
    const char* mode = std::getenv("RINGSPLASH_MPI_PROGRESS");
    const std::string mode_text = mode == nullptr ? "" : mode;
    Check(mode_text.empty() || mode_text == "wait",
          "RINGSPLASH_MPI_PROGRESS: expected 'wait' (or unset: the progress thread), got '",
          mode_text, "'");
    t.wait_only = mode_text == "wait";
    return t;
  }
};

class Runtime {
 public:
  // The process-wide runtime; starts the progress thread (and MPI) on first
  // use. Throws Error if MPI cannot be initialised.
  static Runtime& Get(double timeout_s) {
    static std::mutex init_mu;
    static std::string init_failure;
    std::lock_guard<std::mutex> lock(init_mu);
    Runtime*& instance = Instance();
    if (instance == nullptr) {
      // MPI cannot be initialised twice: a failure is final for the process.
      if (!init_failure.empty()) throw Error(init_failure);
      // The tuning variables first: a bad value is an Error, but not a final
      // one (MPI was not touched), so a corrected environment works.
      const Tuning tuning = Tuning::FromEnvironment();
      // Never deleted: the progress thread (possibly stuck in MPI_Init on
      // failure) uses it until the process ends.
      auto* rt = new Runtime();
      try {
        rt->Start(timeout_s, tuning);
      } catch (const Error& e) {
        init_failure = e.what();
        throw;
      }
      instance = rt;
      std::atexit(&Runtime::AtExit);
    }
    instance->NoteTimeout(timeout_s);
    return *instance;
  }

  int rank() const { return rank_; }
  int default_threads() const { return default_threads_; }

  // Queues `op` for the progress thread. Throws if the job has failed or MPI
  // is finalised.
  void Submit(const std::shared_ptr<Op>& op) {
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) ThrowFailureLocked(lock);
    Check(!finalize_requested_, "comm backend 'mpi': MPI is being finalised; no more calls");
    queue_.push_back(op);
    progress_cv_.notify_one();
  }

  // Blocks until `op` is done; throws Error on a failure of the job, an
  // error of the op or the timeout.
  void Wait(Op& op, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    WaitOp(lock, op, timeout_s);
  }

  // A communicator of its own over `source`'s ranks (MPI_Comm_idup).
  std::shared_ptr<CommState> Duplicate(MPI_Comm source, double timeout_s) {
    auto op = std::make_shared<Op>();
    op->kind = OpKind::kDup;
    op->dup_source = source;
    Submit(op);
    Wait(*op, timeout_s);
    return op->result;
  }

  // The communicator's owner is gone: the progress thread frees it (pending
  // operations on it still complete, as MPI_Comm_free promises).
  void Release(std::shared_ptr<CommState> cs) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_ || finalize_requested_ || cs == nullptr) return;
    try {
      to_free_.push_back(std::move(cs));
    } catch (...) {
      return;  // out of memory: the MPI communicator stays until MPI goes
    }
    progress_cv_.notify_one();
  }

  void Abort(const std::string& reason) noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    AbortLocked(lock, reason);
  }

 private:
  static Runtime*& Instance() {
    static Runtime* rt = nullptr;
    return rt;
  }

  void NoteTimeout(double timeout_s) {
    std::lock_guard<std::mutex> lock(mu_);
    timeout_s_ = std::max(timeout_s_, timeout_s);
  }

  void Start(double timeout_s, const Tuning& tuning) {
    timeout_s_ = timeout_s;
    poll_interval_ = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(tuning.poll_us * 1e-6));
    progress_in_wait_only_ = tuning.wait_only;
    thread_ = std::thread([this] { ThreadMain(); });
    std::unique_lock<std::mutex> lock(mu_);
    const bool ready = cv_.wait_until(lock, DeadlineAfter(timeout_s),
                                      [&] { return init_state_ != InitState::kPending; });
    if (!ready || init_state_ == InitState::kFailed) {
      const std::string why =
          ready ? init_error_
                : "MPI initialisation did not finish within " + FormatSeconds(timeout_s);
      lock.unlock();
      // A thread stuck in MPI_Init cannot be joined; it dies with the process.
      ready ? thread_.join() : thread_.detach();
      Fail("comm backend 'mpi': ", why);
    }
  }

  // ---- compute-thread side ------------------------------------------------

  void WaitOp(std::unique_lock<std::mutex>& lock, Op& op, double timeout_s) {
    const Clock::time_point deadline = DeadlineAfter(timeout_s);
    ++waiters_;
    progress_cv_.notify_one();
    struct Leave {
      int& n;
      ~Leave() { --n; }
    } leave{waiters_};
    for (;;) {
      if (failed_) ThrowFailureLocked(lock);
      if (!op.error.empty()) AbortAndThrowLocked(lock, op.error);
      if (op.done) return;
      if (Clock::now() >= deadline) {
        AbortAndThrowLocked(lock, "rank " + std::to_string(rank_) + ": timed out after " +
                                      FormatSeconds(timeout_s) + " waiting for " +
                                      comm_internal::WaitingFor(op));
      }
      cv_.wait_until(lock, deadline);
    }
  }

  void AbortLocked(std::unique_lock<std::mutex>& lock, const std::string& reason) {
    if (!failed_) {
      failed_ = true;
      originated_failure_ = true;
      failed_rank_ = rank_;
      failure_reason_ = reason;
      abort_message_ = reason.substr(0, kAbortMessageMax - 1);
      send_abort_ = true;
    }
    progress_cv_.notify_one();
    // Bounded: the progress thread cancels pending receives into caller
    // buffers (see Quiesce); after this they are no longer written.
    cv_.wait_for(lock, std::chrono::seconds(2), [&] { return quiesced_ || thread_gone_; });
  }

  [[noreturn]] void AbortAndThrowLocked(std::unique_lock<std::mutex>& lock,
                                        const std::string& reason) {
    AbortLocked(lock, reason);
    throw Error(reason);
  }

  [[noreturn]] void ThrowFailureLocked(std::unique_lock<std::mutex>& lock) {
    progress_cv_.notify_one();
    cv_.wait_for(lock, std::chrono::seconds(2), [&] { return quiesced_ || thread_gone_; });
    if (failed_rank_ == rank_) throw Error(failure_reason_);
    throw Error(PeerFailedMessage(failed_rank_, failure_reason_));
  }

  // ---- progress thread ------------------------------------------------------

  enum class InitState { kPending, kReady, kFailed };

  void ThreadMain() {
    std::string error;
    if (!InitMpi(&error)) {
      std::lock_guard<std::mutex> lock(mu_);
      init_state_ = InitState::kFailed;
      init_error_ = error;
      cv_.notify_all();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      init_state_ = InitState::kReady;
    }
    cv_.notify_all();
    Loop();
    std::lock_guard<std::mutex> lock(mu_);
    thread_gone_ = true;
    cv_.notify_all();
  }

  bool InitMpi(std::string* error) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (initialized) {
      // The application owns MPI; it may call MPI from its own threads too.
      MPI_Query_thread(&provided);
      if (provided != MPI_THREAD_MULTIPLE) {
        *error = "MPI was initialised by the application with " + ThreadLevelName(provided) +
                 ", not MPI_THREAD_MULTIPLE; the mpi backend's progress thread needs it (or let "
                 "ringsplash initialise MPI)";
        return false;
      }
    } else {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      if (rc != MPI_SUCCESS) {
        *error = "MPI_Init_thread failed: " + MpiErrorText(rc);
        return false;
      }
      // The levels are ordered (SINGLE < FUNNELED < SERIALIZED < MULTIPLE).
      // Below FUNNELED this MPI may not be called from the progress thread
      // while the compute threads run: refuse rather than risk corruption.
      if (provided < MPI_THREAD_FUNNELED) {
        *error = "MPI_Init_thread granted thread level " + ThreadLevelName(provided) +
                 ", but the mpi backend needs at least MPI_THREAD_FUNNELED (its progress thread "
                 "calls MPI while other threads run); use an MPI library built with thread "
                 "support";
        MPI_Finalize();  // ours, and nothing else was set up: leave MPI cleanly
        return false;
      }
      owns_mpi_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    if (rc != MPI_SUCCESS) {
      *error = "MPI_Comm_dup failed: " + MpiErrorText(rc);
      return false;
    }
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_group(comm_, &world_group_);
    default_threads_ = comm_internal::SharedCoresPerProcess(comm_);
    abort_in_.assign(kAbortMessageMax, '\0');
    rc = MPI_Irecv(abort_in_.data(), kAbortMessageMax, MPI_CHAR, MPI_ANY_SOURCE, kAbortTag, comm_,
                   &abort_recv_);
    if (rc != MPI_SUCCESS) {
      *error = "MPI_Irecv (abort channel) failed: " + MpiErrorText(rc);
      return false;
    }
    if (!owns_mpi_) {
      // MPI_Finalize frees MPI_COMM_SELF first, calling this attribute's
      // delete function: the runtime stops before MPI goes.
      int keyval = MPI_KEYVAL_INVALID;
      if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Runtime::OnFinalize, &keyval, nullptr) ==
          MPI_SUCCESS) {
        MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr);
      }
    }
    return true;
  }

  void Loop() {
    std::vector<std::shared_ptr<Op>> active;
    std::vector<MPI_Request> abort_sends;
    bool quiesced = false;
    Clock::time_point linger_until{};
    bool lingering = false;
    for (;;) {
      std::deque<std::shared_ptr<Op>> incoming;
      std::vector<std::shared_ptr<CommState>> to_free;
      bool send_abort = false, failed = false, finalize = false, test_transfers = true;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const auto wake = [&] {
          return !queue_.empty() || send_abort_ || finalize_requested_ || (failed_ && !quiesced_) ||
                 !to_free_.empty();
        };
        // Poll fast while transfers are in flight, slowly (abort channel
        // only) when idle; a new command wakes the thread at once.
        const bool busy = !active.empty() || !abort_sends.empty();
        progress_cv_.wait_for(lock, busy ? poll_interval_ : std::chrono::milliseconds(2), wake);
        incoming.swap(queue_);
        to_free.swap(to_free_);
        send_abort = std::exchange(send_abort_, false);
        failed = failed_;
        finalize = finalize_requested_;
        test_transfers = !progress_in_wait_only_ || waiters_ > 0;
      }
      if (!failed) {
        for (const std::shared_ptr<Op>& op : incoming) Post(*op);
        active.insert(active.end(), incoming.begin(), incoming.end());
        for (const std::shared_ptr<CommState>& cs : to_free) MPI_Comm_free(&cs->comm);
      }
      if (send_abort) SendAbort(&abort_sends);
      TestAll(&abort_sends);
      if (!failed && test_transfers) TestOps(&active);
      // Any MPI_Test drives every transfer, so the wait-only baseline must
      // not poll the abort channel outside Wait either.
      if (!failed && test_transfers) failed = PollAbortChannel();
      if (failed && !quiesced) {
        Quiesce(&active);
        quiesced = true;
        std::lock_guard<std::mutex> lock(mu_);
        quiesced_ = true;
        cv_.notify_all();
      }
      if (finalize) {
        if (!failed) {
          // Ringsplash's MPI: the last MPI calls, from this thread. The
          // application's: whoever stops the runtime releases its objects
          // (Shutdown), with MPI still up.
          if (owns_mpi_) FinalizeMpi();
          return;
        }
        // After a failure MPI_Finalize could block on dead peers: skip it.
        // The originating rank lingers briefly so peers hear of the failure
        // before mpirun tears the job down.
        if (!lingering) {
          lingering = true;
          std::lock_guard<std::mutex> lock(mu_);
          const double linger_s = originated_failure_ ? std::min(timeout_s_, 2.0) : 1e-3;
          linger_until = DeadlineAfter(linger_s);
        }
        if (abort_sends.empty() && Clock::now() >= linger_until) return;
      }
    }
  }

  void Post(Op& op) {
    std::string error;
    if (!comm_internal::PostOp(op, &error)) SetError(op, error);
  }

  void TestOps(std::vector<std::shared_ptr<Op>>* active) {
    for (auto it = active->begin(); it != active->end();) {
      Op& op = **it;
      comm_internal::Progress p = comm_internal::TestOp(op, world_group_);
      if (!p.error.empty()) {
        SetError(op, p.error);
        it = active->erase(it);
        continue;
      }
      if (p.recv_done || p.send_done || p.done || p.missing_changed) {
        std::lock_guard<std::mutex> lock(mu_);
        op.recv_done = op.recv_done || p.recv_done;
        op.send_done = op.send_done || p.send_done;
        if (p.missing_changed) op.missing = p.missing;
        if (p.done) {
          op.result = std::move(p.result);
          op.done = true;
          cv_.notify_all();
        }
      }
      it = p.done ? active->erase(it) : it + 1;
    }
  }

  void SetError(Op& op, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    op.error = "rank " + std::to_string(rank_) + ": " + comm_internal::Describe(op) + ": " + what;
    cv_.notify_all();
  }

  void TestAll(std::vector<MPI_Request>* requests) {
    std::string ignored;
    if (comm_internal::TestList(*requests, nullptr, nullptr, nullptr, &ignored) ||
        !ignored.empty()) {
      requests->clear();
    }
  }

  // True once a peer's abort message has arrived (recorded as the failure).
  bool PollAbortChannel() {
    int flag = 0;
    MPI_Status status;
    if (abort_recv_ == MPI_REQUEST_NULL) return false;
    if (MPI_Test(&abort_recv_, &flag, &status) != MPI_SUCCESS || !flag) return false;
    int len = 0;
    MPI_Get_count(&status, MPI_CHAR, &len);
    std::string reason(abort_in_.data(), static_cast<size_t>(std::max(len, 0)));
    reason = reason.substr(0, reason.find('\0'));
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      failed_rank_ = status.MPI_SOURCE;
      failure_reason_ = reason.empty() ? "aborted" : reason;
    }
    cv_.notify_all();
    return true;
  }

  void SendAbort(std::vector<MPI_Request>* sends) {
    std::string message;
    {
      std::lock_guard<std::mutex> lock(mu_);
      message = abort_message_;
    }
    abort_out_.assign(message.begin(), message.end());
    abort_out_.push_back('\0');
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      MPI_Request rq;
      if (MPI_Isend(abort_out_.data(), static_cast<int>(abort_out_.size()), MPI_CHAR, peer,
                    kAbortTag, comm_, &rq) == MPI_SUCCESS) {
        sends->push_back(rq);
      }
    }
  }

  // After a failure: cancel receives into caller buffers and give them up to
  // one second to complete (a cancelled unmatched receive completes at once;
  // one already matched completes when its data is in). Sends and
  // collectives are abandoned; their buffers are owned here or only read.
  void Quiesce(std::vector<std::shared_ptr<Op>>* active) {
    std::vector<MPI_Request> recvs;
    for (const std::shared_ptr<Op>& op : *active) {
      for (MPI_Request& rq : op->recv_requests) {
        if (rq == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&rq);
        recvs.push_back(rq);
      }
      for (MPI_Request& rq : op->send_requests) {
        if (rq != MPI_REQUEST_NULL) MPI_Request_free(&rq);
      }
    }
    const Clock::time_point deadline = DeadlineAfter(1.0);
    std::string ignored;
    while (!comm_internal::TestList(recvs, nullptr, nullptr, nullptr, &ignored) &&
           ignored.empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(poll_interval_);
    }
    // Collectives cannot be cancelled: keep their buffers alive for good.
    for (const std::shared_ptr<Op>& op : *active) {
      if (op->coll_request != MPI_REQUEST_NULL) graveyard_.push_back(op);
    }
    active->clear();
  }

  // The runtime's own MPI objects; with `finalize`, MPI itself (ours).
  void ReleaseMpiObjects() {
    if (abort_recv_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&abort_recv_);
      MPI_Wait(&abort_recv_, MPI_STATUS_IGNORE);
    }
    MPI_Group_free(&world_group_);
    MPI_Comm_free(&comm_);
  }

  void FinalizeMpi() {
    ReleaseMpiObjects();
    MPI_Finalize();
  }

  // Stops the progress thread: at exit, or as the application's
  // MPI_Finalize starts. Returns false if it did not stop within the
  // budget. Idempotent.
  bool Shutdown() {
    std::unique_lock<std::mutex> lock(mu_);
    if (shut_down_) return true;
    finalize_requested_ = true;
    progress_cv_.notify_one();
    const double budget = timeout_s_ + 5.0;
    const bool done =
        cv_.wait_for(lock, std::chrono::duration<double>(budget), [&] { return thread_gone_; });
    if (!done) return false;
    shut_down_ = true;
    const bool release = !owns_mpi_ && !failed_;
    lock.unlock();
    thread_.join();
    if (release) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) ReleaseMpiObjects();
    }
    return true;
  }

  static void AtExit() {
    Runtime* rt = Instance();
    if (rt == nullptr) return;
    if (!rt->Shutdown()) std::_Exit(1);  // finalise hung: end the process rather than hang
  }

  // The delete function of the MPI_COMM_SELF attribute (application-owned
  // MPI): MPI_Finalize has started.
  static int OnFinalize(MPI_Comm, int, void*, void*) {
    Runtime* rt = Instance();
    if (rt != nullptr) rt->Shutdown();
    return MPI_SUCCESS;
  }

  // Set by Start/the progress thread before init_state_ becomes kReady.
  int rank_ = 0;
  int size_ = 1;
  int default_threads_ = 1;
  bool owns_mpi_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;  // MPI_COMM_WORLD's duplicate: the abort channel
  MPI_Group world_group_ = MPI_GROUP_NULL;
  MPI_Request abort_recv_ = MPI_REQUEST_NULL;
  std::vector<char> abort_in_, abort_out_;
  std::vector<std::shared_ptr<Op>> graveyard_;  // progress thread only
  Clock::duration poll_interval_{};
  bool progress_in_wait_only_ = false;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;           // wakes compute threads
  std::condition_variable progress_cv_;  // wakes the progress thread
  InitState init_state_ = InitState::kPending;
  std::string init_error_;
  double timeout_s_ = 60;
  std::deque<std::shared_ptr<Op>> queue_;            // posted by compute threads, not yet in MPI
  std::vector<std::shared_ptr<CommState>> to_free_;  // communicators whose owners are gone
  int waiters_ = 0;
  bool failed_ = false;
  bool originated_failure_ = false;
  int failed_rank_ = -1;
  std::string failure_reason_;
  std::string abort_message_;
  bool send_abort_ = false;
  bool quiesced_ = false;
  bool finalize_requested_ = false;
  bool thread_gone_ = false;
  bool shut_down_ = false;
};

class MpiComm final : public Communicator {
 public:
  MpiComm(Runtime* rt, std::shared_ptr<CommState> cs, const CommOptions& options,
          const LinkModel& link)
      : rt_(rt), cs_(std::move(cs)), options_(options), link_(link) {}
  ~MpiComm() override { rt_->Release(std::move(cs_)); }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return cs_->rank; }
  int size() const override { return cs_->size; }
  const char* backend() const override { return "mpi"; }

  Handle StartShift(const void* send, void* recv, size_t bytes) override {
    // Checked before any shared state changes, so a bad call leaves the
    // communicator usable for the Abort that follows the throw.
    Check(send != nullptr || bytes == 0, "StartShift: send is null but bytes = ", bytes);
    Check(recv != nullptr || bytes == 0, "StartShift: recv is null but bytes = ", bytes);
    auto op = NewOp(OpKind::kShift, next_shift_++);
    op->send = send;
    op->recv = recv;
    op->bytes = bytes;
    op->link = link_;
    rt_->Submit(op);
    const Handle h = next_handle_++;
    ops_[h] = std::move(op);
    return h;
  }

  void Wait(Handle handle) override {
    auto it = ops_.find(handle);
    if (it == ops_.end()) {
      Fail("Wait: rank ", rt_->rank(), " has no pending shift with handle ", handle, cs_->label,
           " (never started or already waited for)");
    }
    const std::shared_ptr<Op> op = it->second;
    rt_->Wait(*op, options_.timeout_s);
    ops_.erase(handle);
  }

  // Sum over ranks in rank order (identical bits everywhere): an Iallgather
  // of everyone's values, then a local sum. count == 0 is a barrier.
  void AllReduceSum(float* data, size_t count) override {
    Check(data != nullptr || count == 0, "AllReduceSum: data is null but count = ", count);
    auto op = NewOp(count == 0 ? OpKind::kBarrier : OpKind::kAllReduce, next_collective_++);
    op->contrib.assign(data, data + count);
    op->gathered.resize(count * static_cast<size_t>(size()));
    rt_->Submit(op);
    rt_->Wait(*op, options_.timeout_s);
    for (size_t i = 0; i < count; ++i) {
      float sum = op->gathered[i];
      for (int r = 1; r < size(); ++r) sum += op->gathered[static_cast<size_t>(r) * count + i];
      data[i] = sum;
    }
  }

  void Barrier() override {
    auto op = NewOp(OpKind::kBarrier, next_collective_++);
    rt_->Submit(op);
    rt_->Wait(*op, options_.timeout_s);
  }

  void Abort(const std::string& reason) noexcept override { rt_->Abort(reason); }

  std::unique_ptr<Communicator> Split(int color, int key) override {
    auto op = NewOp(OpKind::kSplit, next_collective_++);
    op->split_in[0] = color < 0 ? MPI_UNDEFINED : color;
    op->split_in[1] = key;
    op->split_all.resize(2 * static_cast<size_t>(size()));
    rt_->Submit(op);
    rt_->Wait(*op, options_.timeout_s);
    if (op->result == nullptr) return nullptr;
    return std::make_unique<MpiComm>(rt_, op->result, options_, link_);
  }

  // Point-to-point messages on the all-to-all tag, receives first; this
  // rank's own block is copied here.
  void AllToAll(const void* send, void* recv, size_t bytes_per_rank) override {
    comm_internal::CheckAllToAllArguments(send, recv, bytes_per_rank, size());
    const size_t self = bytes_per_rank * static_cast<size_t>(rank());
    if (bytes_per_rank > 0) {
      std::memcpy(static_cast<char*>(recv) + self, static_cast<const char*>(send) + self,
                  bytes_per_rank);
    }
    if (size() == 1) return;
    auto op = NewOp(OpKind::kAllToAll, next_all_to_all_++);
    op->send = send;
    op->recv = recv;
    op->bytes = bytes_per_rank;
    op->missing = comm_internal::OtherRanks(*cs_);
    rt_->Submit(op);
    rt_->Wait(*op, options_.timeout_s);
  }

  int DefaultThreads() const override { return rt_->default_threads(); }

 private:
  std::shared_ptr<Op> NewOp(OpKind kind, int64_t seq) const {
    auto op = std::make_shared<Op>();
    op->kind = kind;
    op->seq = seq;
    op->cs = cs_;
    return op;
  }

  Runtime* rt_;
  std::shared_ptr<CommState> cs_;
  const CommOptions options_;
  const LinkModel link_;
  // One thread at a time uses a communicator: no lock.
  int64_t next_shift_ = 0;
  int64_t next_collective_ = 0;
  int64_t next_all_to_all_ = 0;
  Handle next_handle_ = 0;
  std::map<Handle, std::shared_ptr<Op>> ops_;  // shifts not yet waited for
};

// The checks every MakeMpiCommunicator does before MPI is touched, then the
// runtime (MPI itself on first use) and the duplicate of `source`.
std::unique_ptr<Communicator> MakeOver(MPI_Comm source, const CommOptions& options) {
  Check(options.timeout_s > 0, "CommOptions::timeout_s must be > 0, got ", options.timeout_s);
  // Before MPI is touched: a bad link model is not a final failure.
  const LinkModel link = comm_internal::ResolveLink(options);
  Runtime& rt = Runtime::Get(options.timeout_s);
  std::shared_ptr<CommState> cs = rt.Duplicate(source, options.timeout_s);
  return std::make_unique<MpiComm>(&rt, std::move(cs), options, link);
}

}  // namespace

bool MpiAvailable() { return true; }

std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& options) {
  return MakeOver(MPI_COMM_WORLD, options);
}

namespace comm_detail {

std::unique_ptr<Communicator> MakeMpiCommunicatorFromHandle(const void* handle, size_t handle_bytes,
                                                            const CommOptions& options) {
  Check(handle != nullptr, "MakeMpiCommunicator: no MPI_Comm given");
  Check(handle_bytes == sizeof(MPI_Comm), "MakeMpiCommunicator: the program's MPI_Comm has ",
        handle_bytes, " bytes, but ringsplash was built with an MPI whose MPI_Comm has ",
        sizeof(MPI_Comm), ": build both with the same MPI");
  MPI_Comm comm;
  std::memcpy(&comm, handle, sizeof(comm));
  if (comm == MPI_COMM_NULL) {
    // Still start the backend: its start is collective over MPI_COMM_WORLD,
    // and the processes that have a group wait for this one too.
    Check(options.timeout_s > 0, "CommOptions::timeout_s must be > 0, got ", options.timeout_s);
    Runtime::Get(options.timeout_s);
    Fail(
        "MakeMpiCommunicator: comm is MPI_COMM_NULL (a process MPI_Comm_split left out of "
        "every group has no communicator to make)");
  }
  return MakeOver(comm, options);
}

}  // namespace comm_detail

}  // namespace ringsplash

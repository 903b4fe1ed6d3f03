// The `mpi` communicator backend: one rank per process under mpirun.
//
// Progress. Open MPI's shared-memory and TCP transports only move data inside
// MPI calls, so a transfer posted before a long kernel call would otherwise
// sit still until Wait. A per-process progress thread therefore owns MPI: it
// initialises it (MPI_THREAD_FUNNELED suffices, as no other thread calls
// MPI; an MPI that grants less is refused with an Error), posts the
// Isend/Irecv of each shift, polls MPI_Test on everything in flight every
// RINGSPLASH_MPI_POLL_US microseconds (default 50) and finalises at exit. The
// compute threads only queue commands and block on a condition variable.
// RINGSPLASH_MPI_PROGRESS=wait restricts polling of transfers to while some
// Wait is blocked — the "no progress thread" baseline the overlap test
// measures against.
//
// Link model (CommOptions::link, for testing): when the progress thread sees
// a shift's receive complete, it schedules the message on the incoming
// LinkClock and reports the receive done only once the modelled arrival has
// passed. The modelled time thus starts only when this process drives MPI:
// with RINGSPLASH_MPI_PROGRESS=wait it starts inside Wait and is exposed in
// full, which is what lets the overlap tests prove they can fail.
//
// Failure. A rank that fails calls Abort(): it sends its reason to every peer
// on a separate tag (non-blocking). Every process keeps a receive posted on
// that tag and polls it, so a peer's Wait/AllReduce/Barrier throws
// "rank R failed: <reason>" within a poll interval; a peer that goes silent
// makes waits fail after CommOptions::timeout_s. After a failure pending
// receives into caller buffers are cancelled (bounded) before the error
// propagates, so callers may free them. A process that saw a failure does not
// call MPI_Finalize (it could block on dead peers): it exits with the
// application's code, which mpirun turns into a failed job; the rank that
// originated the failure lingers up to min(timeout, 2 s) at exit so its
// abort messages reach, and are reported by, the others before mpirun tears
// the job down. A finalise that does not finish within the timeout ends the
// process with _Exit(1): never a hang.
#include <mpi.h>

#include <algorithm>
#include <atomic>
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
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"

namespace ringsplash {

namespace {

using comm_internal::Clock;
using comm_internal::DeadlineAfter;
using comm_internal::FormatSeconds;
using comm_internal::LinkClock;
using comm_internal::PeerFailedMessage;
using Handle = Communicator::Handle;

constexpr int kShiftTag = 7301;
constexpr int kAbortTag = 7302;
constexpr int kAbortMessageMax = 1024;
// MPI counts are int: larger shifts go as several messages (same tag, so
// they match in order).
constexpr size_t kMaxMessageBytes = size_t{1} << 30;

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

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

enum class OpKind { kShift, kAllReduce, kBarrier };

// One queued or in-flight operation. Fields above the marker are set by the
// posting thread before the op is queued and never changed; `requests`
// belong to the progress thread; the rest is guarded by Runtime::mu_.
struct Op {
  OpKind kind = OpKind::kShift;
  int64_t seq = 0;  // shift # or collective #
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;
  std::vector<float> contrib;   // all-reduce: this rank's values (owned copy)
  std::vector<float> gathered;  // all-reduce: every rank's values, rank-major
  LinkModel link;               // shift: the emulated link (inactive: none)
  // --- progress thread only
  std::vector<MPI_Request> recv_requests, send_requests;
  std::vector<int> recv_sizes;  // bytes posted per receive request
  MPI_Request coll_request = MPI_REQUEST_NULL;
  bool link_scheduled = false;  // the receive completed; modelled arrival set
  Clock::time_point arrival;    // ... at this time
  // --- guarded by mu_
  bool recv_done = false;
  bool send_done = false;
  bool done = false;
  std::string error;
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
  int size() const { return size_; }

  Handle StartShift(const void* send, void* recv, size_t bytes, const LinkModel& link) {
    auto op = std::make_shared<Op>();
    op->kind = OpKind::kShift;
    op->send = send;
    op->recv = recv;
    op->bytes = bytes;
    op->link = link;
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) ThrowFailureLocked(lock);
    op->seq = next_shift_++;
    const Handle h = next_handle_++;
    ops_[h] = op;
    queue_.push_back(op);
    progress_cv_.notify_one();
    return h;
  }

  void Wait(Handle handle, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = ops_.find(handle);
    if (it == ops_.end()) {
      Fail("Wait: rank ", rank_, " has no pending shift with handle ", handle,
           " (never started or already waited for)");
    }
    std::shared_ptr<Op> op = it->second;
    WaitOp(lock, *op, timeout_s);
    ops_.erase(handle);
  }

  // Sum over ranks in rank order (identical bits everywhere): an Iallgather of
  // everyone's values, then a local sum. count == 0 is a barrier.
  void AllReduce(float* data, size_t count, double timeout_s) {
    auto op = std::make_shared<Op>();
    op->kind = count == 0 ? OpKind::kBarrier : OpKind::kAllReduce;
    op->contrib.assign(data, data + count);
    op->gathered.resize(count * static_cast<size_t>(size_));
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) ThrowFailureLocked(lock);
    op->seq = next_collective_++;
    queue_.push_back(op);
    progress_cv_.notify_one();
    WaitOp(lock, *op, timeout_s);
    for (size_t i = 0; i < count; ++i) {
      float sum = op->gathered[i];
      for (int r = 1; r < size_; ++r) sum += op->gathered[static_cast<size_t>(r) * count + i];
      data[i] = sum;
    }
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
        std::string what;
        if (op.kind == OpKind::kShift) {
          const int peer = op.recv_done ? (rank_ + 1) % size_ : (rank_ + size_ - 1) % size_;
          what = "rank " + std::to_string(peer) + " in shift #" + std::to_string(op.seq);
        } else {
          what = std::string("the other ranks in ") +
                 (op.kind == OpKind::kBarrier ? "barrier #" : "all-reduce #") +
                 std::to_string(op.seq);
        }
        AbortAndThrowLocked(lock, "rank " + std::to_string(rank_) + ": timed out after " +
                                      FormatSeconds(timeout_s) + " waiting for " + what);
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
    abort_in_.assign(kAbortMessageMax, '\0');
    rc = MPI_Irecv(abort_in_.data(), kAbortMessageMax, MPI_CHAR, MPI_ANY_SOURCE, kAbortTag, comm_,
                   &abort_recv_);
    if (rc != MPI_SUCCESS) {
      *error = "MPI_Irecv (abort channel) failed: " + MpiErrorText(rc);
      return false;
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
      bool send_abort = false, failed = false, finalize = false, test_transfers = true;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const auto wake = [&] {
          return !queue_.empty() || send_abort_ || finalize_requested_ || (failed_ && !quiesced_);
        };
        // Poll fast while transfers are in flight, slowly (abort channel
        // only) when idle; a new command wakes the thread at once.
        const bool busy = !active.empty() || !abort_sends.empty();
        progress_cv_.wait_for(lock, busy ? poll_interval_ : std::chrono::milliseconds(2), wake);
        incoming.swap(queue_);
        send_abort = std::exchange(send_abort_, false);
        failed = failed_;
        finalize = finalize_requested_;
        test_transfers = !progress_in_wait_only_ || waiters_ > 0;
      }
      if (!failed) {
        for (const std::shared_ptr<Op>& op : incoming) Post(*op);
        active.insert(active.end(), incoming.begin(), incoming.end());
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
          FinalizeMpi();
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
    int rc = MPI_SUCCESS;
    if (op.kind == OpKind::kShift) {
      const int next = (rank_ + 1) % size_;
      const int prev = (rank_ + size_ - 1) % size_;
      // Receives first; zero-byte shifts still send one (empty) message so
      // the sequence of messages stays matched.
      for (size_t off = 0; off == 0 || off < op.bytes; off += kMaxMessageBytes) {
        const int n = static_cast<int>(std::min(kMaxMessageBytes, op.bytes - off));
        MPI_Request rq;
        rc = MPI_Irecv(static_cast<char*>(op.recv) + off, n, MPI_BYTE, prev, kShiftTag, comm_, &rq);
        if (rc != MPI_SUCCESS) break;
        op.recv_requests.push_back(rq);
        op.recv_sizes.push_back(n);
        if (op.bytes == 0) break;
      }
      for (size_t off = 0; rc == MPI_SUCCESS && (off == 0 || off < op.bytes);
           off += kMaxMessageBytes) {
        const int n = static_cast<int>(std::min(kMaxMessageBytes, op.bytes - off));
        MPI_Request rq;
        rc = MPI_Isend(static_cast<const char*>(op.send) + off, n, MPI_BYTE, next, kShiftTag, comm_,
                       &rq);
        if (rc != MPI_SUCCESS) break;
        op.send_requests.push_back(rq);
        if (op.bytes == 0) break;
      }
    } else if (op.kind == OpKind::kAllReduce) {
      const int n = static_cast<int>(op.contrib.size());
      rc = MPI_Iallgather(op.contrib.data(), n, MPI_FLOAT, op.gathered.data(), n, MPI_FLOAT, comm_,
                          &op.coll_request);
    } else {
      rc = MPI_Ibarrier(comm_, &op.coll_request);
    }
    if (rc != MPI_SUCCESS) SetError(op, "posting failed: " + MpiErrorText(rc));
  }

  // Tests a list of requests; returns true when all are complete. Completed
  // entries become MPI_REQUEST_NULL. With `expected` (receives), a message
  // shorter than posted is an error: the peer sent fewer bytes.
  bool TestList(std::vector<MPI_Request>& requests, const std::vector<int>* expected,
                std::string* error) {
    bool all = true;
    for (size_t i = 0; i < requests.size(); ++i) {
      MPI_Request& rq = requests[i];
      if (rq == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Status status;
      const int rc = MPI_Test(&rq, &flag, &status);
      if (rc != MPI_SUCCESS) {
        *error = MpiErrorText(rc);
        return false;
      }
      if (!flag) {
        all = false;
        continue;
      }
      if (expected != nullptr) {
        int count = 0;
        MPI_Get_count(&status, MPI_BYTE, &count);
        if (count != (*expected)[i]) {
          *error = "received " + std::to_string(count) + " bytes from rank " +
                   std::to_string(status.MPI_SOURCE) + " where " + std::to_string((*expected)[i]) +
                   " were expected (shift sizes differ)";
          return false;
        }
      }
    }
    return all;
  }

  void TestOps(std::vector<std::shared_ptr<Op>>* active) {
    for (auto it = active->begin(); it != active->end();) {
      Op& op = **it;
      std::string error;
      bool recv_done = false, send_done = false, done = false;
      if (op.kind == OpKind::kShift) {
        recv_done = TestList(op.recv_requests, &op.recv_sizes, &error);
        if (recv_done && op.link.active() && size_ > 1) {
          // The data is here; the emulated link delivers it later.
          const Clock::time_point now = Clock::now();
          if (!op.link_scheduled) {
            op.arrival = in_link_.Schedule(op.link, now, op.bytes);
            op.link_scheduled = true;
          }
          recv_done = now >= op.arrival;
        }
        if (error.empty()) send_done = TestList(op.send_requests, nullptr, &error);
        done = recv_done && send_done;
      } else {
        int flag = 0;
        const int rc = MPI_Test(&op.coll_request, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) error = MpiErrorText(rc);
        done = flag != 0;
      }
      if (!error.empty()) {
        SetError(op, error);
        it = active->erase(it);
        continue;
      }
      if (recv_done || send_done || done) {
        std::lock_guard<std::mutex> lock(mu_);
        op.recv_done = op.recv_done || recv_done;
        op.send_done = op.send_done || send_done;
        op.done = done;
        if (done) cv_.notify_all();
      }
      it = done ? active->erase(it) : it + 1;
    }
  }

  void SetError(Op& op, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    op.error =
        "rank " + std::to_string(rank_) + ": " +
        (op.kind == OpKind::kShift
             ? "shift #" + std::to_string(op.seq) + " (" + std::to_string(op.bytes) + " bytes)"
             : std::string(op.kind == OpKind::kBarrier ? "barrier #" : "all-reduce #") +
                   std::to_string(op.seq)) +
        ": " + what;
    cv_.notify_all();
  }

  void TestAll(std::vector<MPI_Request>* requests) {
    std::string ignored;
    if (TestList(*requests, nullptr, &ignored) || !ignored.empty()) requests->clear();
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
    while (!TestList(recvs, nullptr, &ignored) && ignored.empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(poll_interval_);
    }
    // Collectives cannot be cancelled: keep their buffers alive for good.
    for (const std::shared_ptr<Op>& op : *active) {
      if (op->kind != OpKind::kShift) graveyard_.push_back(op);
    }
    active->clear();
  }

  void FinalizeMpi() {
    if (abort_recv_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&abort_recv_);
      MPI_Wait(&abort_recv_, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  static void AtExit() {
    Runtime* rt = Instance();
    if (rt == nullptr) return;
    std::unique_lock<std::mutex> lock(rt->mu_);
    rt->finalize_requested_ = true;
    rt->progress_cv_.notify_one();
    const double budget = rt->timeout_s_ + 5.0;
    const bool done = rt->cv_.wait_for(lock, std::chrono::duration<double>(budget),
                                       [&] { return rt->thread_gone_; });
    lock.unlock();
    if (!done) std::_Exit(1);  // finalise hung: end the process rather than hang
    rt->thread_.join();
  }

  // Set by Start/the progress thread before init_state_ becomes kReady.
  int rank_ = 0;
  int size_ = 1;
  bool owns_mpi_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Request abort_recv_ = MPI_REQUEST_NULL;
  std::vector<char> abort_in_, abort_out_;
  std::vector<std::shared_ptr<Op>> graveyard_;  // progress thread only
  LinkClock in_link_;                           // progress thread only: from rank-1
  Clock::duration poll_interval_{};
  bool progress_in_wait_only_ = false;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable cv_;           // wakes compute threads
  std::condition_variable progress_cv_;  // wakes the progress thread
  InitState init_state_ = InitState::kPending;
  std::string init_error_;
  double timeout_s_ = 60;
  std::deque<std::shared_ptr<Op>> queue_;      // posted by compute threads, not yet in MPI
  std::map<Handle, std::shared_ptr<Op>> ops_;  // shifts not yet waited for
  Handle next_handle_ = 0;
  int64_t next_shift_ = 0;
  int64_t next_collective_ = 0;
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
};

class MpiComm final : public Communicator {
 public:
  MpiComm(Runtime* rt, const CommOptions& options, const LinkModel& link)
      : rt_(rt), options_(options), link_(link) {}
  int rank() const override { return rt_->rank(); }
  int size() const override { return rt_->size(); }
  const char* backend() const override { return "mpi"; }
  Handle StartShift(const void* send, void* recv, size_t bytes) override {
    // Checked before any shared state changes, so a bad call leaves the
    // communicator usable for the Abort that follows the throw.
    Check(send != nullptr || bytes == 0, "StartShift: send is null but bytes = ", bytes);
    Check(recv != nullptr || bytes == 0, "StartShift: recv is null but bytes = ", bytes);
    return rt_->StartShift(send, recv, bytes, link_);
  }
  void Wait(Handle handle) override { rt_->Wait(handle, options_.timeout_s); }
  void AllReduceSum(float* data, size_t count) override {
    Check(data != nullptr || count == 0, "AllReduceSum: data is null but count = ", count);
    rt_->AllReduce(data, count, options_.timeout_s);
  }
  void Barrier() override { rt_->AllReduce(nullptr, 0, options_.timeout_s); }
  void Abort(const std::string& reason) noexcept override { rt_->Abort(reason); }

 private:
  Runtime* rt_;
  CommOptions options_;
  LinkModel link_;
};

}  // namespace

bool MpiAvailable() { return true; }

std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& options) {
  Check(options.timeout_s > 0, "CommOptions::timeout_s must be > 0, got ", options.timeout_s);
  // Before MPI is touched: a bad link model is not a final failure.
  const LinkModel link = comm_internal::ResolveLink(options);
  Runtime& rt = Runtime::Get(options.timeout_s);
  return std::make_unique<MpiComm>(&rt, options, link);
}

}  // namespace ringsplash

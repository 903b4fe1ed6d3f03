// ThreadPool: fixed workers plus the caller as worker 0.
//
// One ParallelFor is one "job": the caller publishes (fn, n) under the mutex,
// bumps a generation counter and wakes the workers; every participant (the
// caller included) then takes task indices from a shared atomic counter until
// it runs past n. The caller waits until every worker has left the job, so a
// job's writes happen-before ParallelFor returns (the mutex orders them), and
// no worker can still be reading a job's `fn` when the next one starts.
//
// Concurrent ParallelFor calls on one pool (e.g. ranks of the threads
// communicator sharing a pool) are serialised by call_mu; a nested call from
// inside a task of the same pool runs inline on the calling worker instead of
// deadlocking.
//
// Waiting is poll-then-block: a worker polls for the next job, and the caller
// for the workers' end of a job, for a while (PollBudget: 100 us unless
// RINGSPLASH_POLL_US says otherwise) before sleeping on a condition
// variable. Every job needs every worker to arrive and leave, so with
// sleeping workers each ParallelFor paid a futex wake-up there and back,
// ~15-25 us on a 2-vCPU VM: on 2 threads a decoding call over 128 keys (one
// job) took 47 us instead of 33 (docs/perf/DESIGN_MEASUREMENTS.md: polling
// thread pool). The poll yields between reads, and pools with more threads
// than the machine has hardware threads do not poll at all: there a polling
// worker would take the core another one needs.
#include "src/kernels/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash::kernels {

namespace {
// The pool whose task the current thread is running (nullptr outside tasks)
// and the worker index it runs as.
thread_local const void* tls_running_pool = nullptr;
thread_local int tls_worker = 0;

// How long a participant polls before it blocks by default: several
// wake-ups' worth, yet short beside any call that takes threads at all.
constexpr int64_t kDefaultPollUs = 100;
constexpr int64_t kMaxPollUs = 100000;

// The poll of a pool of `threads`: RINGSPLASH_POLL_US (a whole number of
// microseconds, 0 to kMaxPollUs; 0 blocks at once, as OMP_WAIT_POLICY=passive
// does for OpenMP) or kDefaultPollUs; none when the pool has more threads than
// the hardware. A malformed value is an Error naming the variable (a typo must
// not silently fall back).
std::chrono::microseconds PollBudget(int threads) {
  int64_t us = kDefaultPollUs;
  const char* env = std::getenv("RINGSPLASH_POLL_US");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(env, &end, 10);
    Check(end != env && *end == '\0' && errno == 0 && v >= 0 && v <= kMaxPollUs,
          "RINGSPLASH_POLL_US: expected whole microseconds from 0 to ", kMaxPollUs, ", got '", env,
          "'");
    us = v;
  }
  const auto hardware = static_cast<int>(std::thread::hardware_concurrency());
  if (hardware > 0 && threads > hardware) us = 0;
  return std::chrono::microseconds(us);
}

// A hint to the core that this is a polling loop (x86 `pause`, Arm `yield`).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls ready() for up to `budget`, yielding the CPU every 16 reads; whether
// it turned true.
template <typename Ready>
bool PollFor(std::chrono::microseconds budget, const Ready& ready) {
  if (budget.count() == 0) return ready();
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (int i = 1;; ++i) {
    if (ready()) return true;
    if (i % 16 == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::yield();
    } else {
      CpuRelax();
    }
  }
}

class RunningPoolScope {
 public:
  RunningPoolScope(const void* pool, int worker)
      : saved_pool_(tls_running_pool), saved_worker_(tls_worker) {
    tls_running_pool = pool;
    tls_worker = worker;
  }
  ~RunningPoolScope() {
    tls_running_pool = saved_pool_;
    tls_worker = saved_worker_;
  }
  RunningPoolScope(const RunningPoolScope&) = delete;
  RunningPoolScope& operator=(const RunningPoolScope&) = delete;

 private:
  const void* saved_pool_;
  int saved_worker_;
};
}  // namespace

struct ThreadPool::Impl {
  using Fn = std::function<void(int64_t, int)>;

  int size = 1;
  std::chrono::microseconds poll{0};  // PollBudget(size requested)
  std::vector<std::thread> threads;

  std::mutex call_mu;  // one job at a time

  std::mutex mu;  // guards everything below except `next`
  std::condition_variable start_cv;
  std::condition_variable done_cv;
  // generation, stop and active change only under mu; they are atomic so
  // that the polls (PollFor) may read them without it.
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> stop{false};
  const Fn* fn = nullptr;
  int64_t n = 0;
  std::atomic<int> active{0};  // workers (not the caller) still inside the job
  std::exception_ptr error;

  std::atomic<int64_t> next{0};  // next task index to hand out

  // Runs tasks of the current job until none are left. After a task throws,
  // the remaining unstarted tasks are abandoned (the counter jumps to n).
  void RunTasks(const Fn& f, int64_t count, int worker) {
    for (;;) {
      const int64_t task = next.fetch_add(1, std::memory_order_relaxed);
      if (task >= count) return;
      try {
        f(task, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        next.store(count, std::memory_order_relaxed);
      }
    }
  }

  void WorkerLoop(int worker, const void* owner) {
    RunningPoolScope scope(owner, worker);
    uint64_t seen = 0;
    auto next_job = [&] {
      return stop.load(std::memory_order_relaxed) ||
             generation.load(std::memory_order_relaxed) != seen;
    };
    for (;;) {
      PollFor(poll, next_job);
      // fn and n are read under mu, which orders them after the caller's writes.
      std::unique_lock<std::mutex> lock(mu);
      start_cv.wait(lock, next_job);
      if (stop.load(std::memory_order_relaxed)) return;
      seen = generation.load(std::memory_order_relaxed);
      const Fn* f = fn;
      const int64_t count = n;
      lock.unlock();
      RunTasks(*f, count, worker);
      lock.lock();
      // Under mu, which orders the job's writes before the caller's return
      // (it takes mu after seeing 0); acq_rel keeps its lock-free read exact.
      if (active.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv.notify_one();
    }
  }
};

ThreadPool::ThreadPool(int num_threads) : impl_(std::make_unique<Impl>()) {
  if (num_threads <= 0) {
    num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
  // Before any thread starts: a throw after would destroy joinable threads.
  impl_->poll = PollBudget(num_threads);
  impl_->threads.reserve(static_cast<size_t>(num_threads - 1));
  for (int w = 1; w < num_threads; ++w) {
    try {
      impl_->threads.emplace_back(
          [impl = impl_.get(), w, owner = this] { impl->WorkerLoop(w, owner); });
    } catch (const std::system_error&) {
      // The OS refused another thread (pids limit, RLIMIT_NPROC, memory):
      // run with the workers we got rather than fail or unwind past workers
      // already waiting on this pool's condition variables. Results do not
      // depend on the thread count.
      break;
    }
  }
  impl_->size = static_cast<int>(impl_->threads.size()) + 1;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop.store(true, std::memory_order_relaxed);
  }
  impl_->start_cv.notify_all();
  for (std::thread& t : impl_->threads) t.join();
}

int ThreadPool::size() const { return impl_->size; }

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t task, int worker)>& fn) {
  if (n <= 0) return;
  // A nested call from one of this pool's own tasks runs inline as that
  // task's worker (the other workers are busy with the outer job).
  if (tls_running_pool == this) {
    const int worker = tls_worker;
    for (int64_t t = 0; t < n; ++t) fn(t, worker);
    return;
  }
  // Serial cases: same exception contract (the first exception abandons the
  // remaining tasks and propagates).
  if (impl_->size == 1 || n == 1) {
    RunningPoolScope scope(this, 0);
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }

  Impl& im = *impl_;
  std::lock_guard<std::mutex> call_lock(im.call_mu);
  {
    std::lock_guard<std::mutex> lock(im.mu);
    im.fn = &fn;
    im.n = n;
    im.error = nullptr;
    im.active.store(im.size - 1, std::memory_order_relaxed);
    im.next.store(0, std::memory_order_relaxed);
    im.generation.fetch_add(1, std::memory_order_relaxed);
  }
  im.start_cv.notify_all();
  {
    RunningPoolScope scope(this, 0);
    im.RunTasks(fn, n, 0);
  }
  std::exception_ptr error;
  auto done = [&] { return im.active.load(std::memory_order_acquire) == 0; };
  PollFor(im.poll, done);
  {
    std::unique_lock<std::mutex> lock(im.mu);
    im.done_cv.wait(lock, done);
    im.fn = nullptr;
    error = std::exchange(im.error, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace ringsplash::kernels

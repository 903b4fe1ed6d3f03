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
#include "src/kernels/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace ringsplash::kernels {

namespace {
// The pool whose task the current thread is running (nullptr outside tasks)
// and the worker index it runs as.
thread_local const void* tls_running_pool = nullptr;
thread_local int tls_worker = 0;

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
  std::vector<std::thread> threads;

  std::mutex call_mu;  // one job at a time

  std::mutex mu;  // guards everything below except `next`
  std::condition_variable start_cv;
  std::condition_variable done_cv;
  uint64_t generation = 0;
  bool stop = false;
  const Fn* fn = nullptr;
  int64_t n = 0;
  int active = 0;  // workers (not counting the caller) still inside the job
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
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      start_cv.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      const Fn* f = fn;
      const int64_t count = n;
      lock.unlock();
      RunTasks(*f, count, worker);
      lock.lock();
      if (--active == 0) done_cv.notify_one();
    }
  }
};

ThreadPool::ThreadPool(int num_threads) : impl_(std::make_unique<Impl>()) {
  if (num_threads <= 0) {
    num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }
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
    impl_->stop = true;
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
    im.active = im.size - 1;
    im.next.store(0, std::memory_order_relaxed);
    ++im.generation;
  }
  im.start_cv.notify_all();
  {
    RunningPoolScope scope(this, 0);
    im.RunTasks(fn, n, 0);
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(im.mu);
    im.done_cv.wait(lock, [&] { return im.active == 0; });
    im.fn = nullptr;
    error = std::exchange(im.error, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace ringsplash::kernels

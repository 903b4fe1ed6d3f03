// A fixed pool of worker threads for the kernels' parallel loops.
//
// Tasks are handed out dynamically, but every kernel writes each task's
// results to memory owned by that task alone, so results never depend on
// which thread ran what (bitwise identical across thread counts). Idle
// workers poll for the next job for ~100 us before they sleep, so the jobs of
// one call (and of calls in quick succession) start without wake-ups;
// RINGSPLASH_POLL_US sets that time (0: sleep at once).
#ifndef RINGSPLASH_KERNELS_THREAD_POOL_H_
#define RINGSPLASH_KERNELS_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <memory>

namespace ringsplash::kernels {

class ThreadPool {
 public:
  // num_threads <= 0: std::thread::hardware_concurrency() (at least 1).
  // The calling thread is worker 0, so a pool of 1 spawns no threads. Throws
  // Error if RINGSPLASH_POLL_US is set to anything but 0 to 100000.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const;
  // Runs fn(task, worker) for every task in [0, n) and returns when all are
  // done; worker is in [0, size()). If tasks throw, rethrows the first
  // exception after the rest finished.
  void ParallelFor(int64_t n, const std::function<void(int64_t task, int worker)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_THREAD_POOL_H_

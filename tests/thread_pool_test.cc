// Tests of kernels::ThreadPool: every task runs exactly once on a valid
// worker, exceptions propagate after the job ends, the pool survives many
// calls, concurrent callers and nested calls, reaches polling and sleeping
// workers alike, and shuts down cleanly.
#include "src/kernels/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash::kernels {
namespace {

TEST(ThreadPoolTest, SizeDefaultsToHardware) {
  ThreadPool one(1);
  EXPECT_EQ(one.size(), 1);
  ThreadPool three(3);
  EXPECT_EQ(three.size(), 3);
  ThreadPool hw(0);
  EXPECT_EQ(hw.size(), static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  ThreadPool neg(-5);
  EXPECT_EQ(neg.size(), hw.size());
}

TEST(ThreadPoolTest, EveryTaskRunsExactlyOnceOnAValidWorker) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      std::atomic<bool> bad_worker{false};
      pool.ParallelFor(n, [&](int64_t task, int worker) {
        runs[task].fetch_add(1, std::memory_order_relaxed);
        if (worker < 0 || worker >= threads) bad_worker = true;
      });
      for (int64_t t = 0; t < n; ++t) ASSERT_EQ(runs[t].load(), 1) << threads << " " << n;
      EXPECT_FALSE(bad_worker.load());
    }
  }
}

// Per-worker scratch is the kernels' pattern: no two tasks may run on the same
// worker index at the same time.
TEST(ThreadPoolTest, WorkerIndexIsExclusive) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> busy(4);
  std::atomic<bool> overlap{false};
  pool.ParallelFor(400, [&](int64_t, int worker) {
    if (busy[worker].fetch_add(1) != 0) overlap = true;
    volatile int spin = 0;
    for (int i = 0; i < 1000; ++i) spin = spin + i;
    busy[worker].fetch_sub(1);
  });
  EXPECT_FALSE(overlap.load());
}

// Results written by tasks are visible to the caller after ParallelFor
// returns (plain, non-atomic writes; TSan checks the ordering).
TEST(ThreadPoolTest, WritesAreVisibleAfterReturn) {
  ThreadPool pool(3);
  for (int rep = 0; rep < 2000; ++rep) {
    std::vector<int64_t> out(37, -1);
    pool.ParallelFor(37, [&](int64_t task, int) { out[task] = task * rep; });
    for (int64_t t = 0; t < 37; ++t) ASSERT_EQ(out[t], t * rep);
  }
}

TEST(ThreadPoolTest, FirstExceptionIsRethrownAfterTheJob) {
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> runs(200);
    EXPECT_THROW(pool.ParallelFor(200,
                                  [&](int64_t task, int) {
                                    runs[task].fetch_add(1);
                                    if (task == 5) throw std::runtime_error("task 5");
                                  }),
                 std::runtime_error);
    for (auto& r : runs) EXPECT_LE(r.load(), 1);  // abandoned, never repeated
    EXPECT_EQ(runs[5].load(), 1);
    // The pool is still usable.
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(100, [&](int64_t task, int) { sum += task; });
    EXPECT_EQ(sum.load(), 4950);
  }
}

TEST(ThreadPoolTest, EveryTaskThrowingStillReturns) {
  ThreadPool pool(4);
  try {
    pool.ParallelFor(50, [](int64_t task, int) { throw static_cast<int>(task); });
    FAIL() << "no exception";
  } catch (int) {
  }
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerialisedCorrectly) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<int> out(23, 0);
        pool.ParallelFor(23, [&](int64_t task, int) { out[task] = c + static_cast<int>(task); });
        for (int t = 0; t < 23; ++t) {
          if (out[t] != c + t) failures++;
        }
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPoolTest, NestedCallRunsInlineWithoutDeadlock) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> runs(8 * 5);
  pool.ParallelFor(8, [&](int64_t outer, int worker) {
    pool.ParallelFor(5, [&](int64_t inner, int inner_worker) {
      EXPECT_EQ(inner_worker, worker);
      runs[outer * 5 + inner].fetch_add(1);
    });
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

// Every worker joins every job, whether it was still polling for the next
// one (jobs back to back) or had gone to sleep on the pool's condition
// variable (idle for longer than its poll, ~100 us). The job's tasks wait
// for one another, so each worker must take one: a worker that missed the
// job would hang it (ctest's timeout then fails the test; so would a lost
// wake-up, since ParallelFor waits for every worker).
// Runs a job of pool.size() tasks that wait for one another, so that every
// worker must take one; the tasks each worker ran.
std::vector<int> TasksPerWorkerOfBarrierJob(ThreadPool& pool) {
  const int n = pool.size();
  std::atomic<int> arrived{0};
  std::vector<std::atomic<int>> tasks_of(static_cast<size_t>(n));
  pool.ParallelFor(n, [&](int64_t, int worker) {
    tasks_of[static_cast<size_t>(worker)].fetch_add(1);
    arrived.fetch_add(1);
    while (arrived.load() < n) std::this_thread::yield();
  });
  std::vector<int> counts;
  for (const auto& t : tasks_of) counts.push_back(t.load());
  return counts;
}

TEST(ThreadPoolTest, PollingAndSleepingWorkersJoinEveryJob) {
  ThreadPool pool(3);
  for (int idle_us : {0, 20, 400, 3000}) {
    for (int rep = 0; rep < 20; ++rep) {
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
      ASSERT_EQ(TasksPerWorkerOfBarrierJob(pool), std::vector<int>(3, 1)) << "idle " << idle_us;
    }
  }
}

// RINGSPLASH_POLL_US: 0 makes idle workers sleep at once (every job then
// wakes them, and every job still finds them all); a malformed value is an
// Error naming the variable, raised before any thread starts.
TEST(ThreadPoolTest, PollTimeFromTheEnvironment) {
  setenv("RINGSPLASH_POLL_US", "0", 1);
  {
    ThreadPool pool(3);
    for (int rep = 0; rep < 50; ++rep) {
      ASSERT_EQ(TasksPerWorkerOfBarrierJob(pool), std::vector<int>(3, 1)) << "job " << rep;
    }
  }
  for (const char* bad : {"abc", "-1", "100001", "5us", "1e3"}) {
    setenv("RINGSPLASH_POLL_US", bad, 1);
    try {
      ThreadPool pool(2);
      ADD_FAILURE() << "RINGSPLASH_POLL_US=" << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("RINGSPLASH_POLL_US"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  unsetenv("RINGSPLASH_POLL_US");
}

TEST(ThreadPoolTest, ManyPoolsCreatedAndDestroyed) {
  for (int i = 0; i < 50; ++i) {
    ThreadPool pool(1 + i % 4);
    if (i % 2 == 0) {
      std::atomic<int> n{0};
      pool.ParallelFor(10, [&](int64_t, int) { n++; });
      EXPECT_EQ(n.load(), 10);
    }
  }
}

}  // namespace
}  // namespace ringsplash::kernels

// Resource exhaustion: when the operating system refuses a new thread
// (pthread_create fails with EAGAIN — a pids cgroup limit, RLIMIT_NPROC,
// memory for the stack), the attention entry points must throw
// ringsplash::Error or run with the threads they got — never hang and never
// let a std::system_error escape.
//
// Found by the attention fuzzer (a merge run on a loaded machine hung in
// ThreadPool's constructor: two workers had started, the third could not be
// created, and unwinding destroyed the pool's condition variable while the
// two workers still waited on it). Reproduced here deterministically: this
// binary defines pthread_create, forwarding to the C library's until armed,
// then failing every creation after the first `g_allowed` ones. Each call
// runs in a forked child with an alarm, so a hang is reported as one.
//
// Not built under sanitizers: they intercept pthread_create themselves.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <exception>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "tests/support/test_util.h"

namespace {

std::atomic<bool> g_armed{false};
std::atomic<int> g_allowed{0};

using CreateFn = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);

}  // namespace

// Interposes the C library's pthread_create for this executable (std::thread
// calls it through the PLT, so the executable's definition wins).
extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*),
                              void* arg) {
  static const CreateFn real = reinterpret_cast<CreateFn>(dlsym(RTLD_NEXT, "pthread_create"));
  if (g_armed.load() && g_allowed.fetch_sub(1) <= 0) return EAGAIN;
  return real(thread, attr, start, arg);
}

namespace ringsplash::testing {
namespace {

// Outcomes reported by the child through its exit status.
constexpr int kReturned = 0;
constexpr int kThrewError = 10;
constexpr int kThrewOther = 11;

// Runs one AttentionForward with `threads` kernel threads in a child process
// where only `allowed` thread creations succeed; returns the child's outcome
// (or 128 + signal; SIGALRM after 5 s means it hung (the call itself takes milliseconds)).
int ForwardInChild(int threads, int allowed) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(5);
    Rng rng(1);
    ProblemSpec spec;
    spec.sq = spec.skv = 256;  // enough tiles for every worker
    const OwnedInputs in = RandomInputs(rng, spec);
    AttentionOptions opt;
    opt.num_threads = threads;
    opt.block_sizes = {16, 16};
    g_allowed = allowed;
    g_armed = true;
    int outcome = kReturned;
    try {
      const ApiResult r = RunAttention(in, opt, nullptr);
      if (HasNaN(r.out)) outcome = 12;
    } catch (const Error& e) {
      std::fprintf(stderr, "Error: %s\n", e.what());
      outcome = kThrewError;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "non-ringsplash exception: %s\n", e.what());
      outcome = kThrewOther;
    }
    std::fflush(stderr);
    _exit(outcome);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(ThreadFailure, FailedThreadCreationIsAnErrorOrFewerThreadsNeverAHang) {
  for (int allowed : {0, 1, 2, 5}) {
    const int outcome = ForwardInChild(8, allowed);
    EXPECT_TRUE(outcome == kReturned || outcome == kThrewError)
        << allowed << " of 7 worker threads could be created: "
        << (outcome == 128 + SIGALRM ? "the call HUNG (killed after 5 s)"
            : outcome == kThrewOther ? "a non-ringsplash exception escaped"
                                     : "outcome " + std::to_string(outcome));
  }
}

// Control: with thread creation unrestricted the same call returns.
TEST(ThreadFailure, ControlWithoutFailures) { EXPECT_EQ(ForwardInChild(8, 1000), kReturned); }

}  // namespace
}  // namespace ringsplash::testing

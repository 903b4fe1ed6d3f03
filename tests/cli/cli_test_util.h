// Helpers for tests that run the `ringsplash` binary: a scratch directory,
// running a command line under a timeout with stdout and stderr captured,
// and f64 <-> .npy conversion for comparing with the reference.
#ifndef RINGSPLASH_TESTS_CLI_CLI_TEST_UTIL_H_
#define RINGSPLASH_TESTS_CLI_CLI_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace ringsplash::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  // Names of every entry (hidden ones included), sorted.
  std::vector<std::string> List() const;

 private:
  std::string path_;
};

struct CommandResult {
  int status = -1;  // exit status; 128 + n if killed by signal n
  std::string out, err;
};

// Runs `argv` (argv[0] is the program), each word shell-quoted, under
// `timeout -k 5 <timeout_s>`, in `cwd` if non-empty. A hang is a status of
// 124 or 137, never a hung test.
CommandResult RunCommand(const std::vector<std::string>& argv, int timeout_s = 120,
                         const std::string& cwd = "");
// The CLI binary under test (RINGSPLASH_CLI) with `args`.
CommandResult RunCli(const std::vector<std::string>& args, int timeout_s = 120);

#ifdef RINGSPLASH_MPIEXEC
// The CLI under `mpirun --oversubscribe -np <ranks>` with `args`, allowed to
// run as root (Open MPI refuses otherwise) and with the `env` assignments
// (NAME=VALUE) set for it.
CommandResult RunCliUnderMpi(int ranks, const std::vector<std::string>& args, int timeout_s,
                             const std::vector<std::string>& env = {});
#endif

#if defined(__linux__)
// While alive, the calling thread (and every thread or process it starts)
// may run on one CPU only: the first of its current mask. The probes of
// `bench` (peak, read bandwidth) run no more threads than that.
class OneCpu {
 public:
  OneCpu();
  ~OneCpu();
  OneCpu(const OneCpu&) = delete;
  OneCpu& operator=(const OneCpu&) = delete;
  bool ok() const { return ok_; }

 private:
  cpu_set_t saved_;
  bool ok_ = false;
};
#endif

// Number of '\n'-terminated lines in `text` (a final unterminated line counts).
int CountLines(const std::string& text);

// Reads an f32 .npy file (via the npy library) as doubles; shape into *shape.
std::vector<double> ReadF32(const std::string& path, std::vector<int64_t>* shape);

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_CLI_CLI_TEST_UTIL_H_

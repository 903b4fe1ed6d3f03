// Fault injection and determinism through the command line (issue #6.3, 6.5):
// `ringsplash attend` with RINGSPLASH_FAULT=RANK:STEP[:fwd|:bwd] set, on the
// threads backend (--ranks 3) and under `mpirun -np 3` (--backend mpi).
// For every injected fault:
//   - the run (every rank, under MPI) exits with status 1 — not 0, not a
//     signal, not the test's own kill timeout;
//   - every rank prints an error line naming the failed rank (under MPI the
//     lines are told apart with mpirun --tag-output);
//   - it finishes well within --comm-timeout (the failed rank tells its peers;
//     nobody waits for the timeout);
//   - no output file is left behind: not the final names, not temporaries.
// The same command without the fault succeeds (so the fault is what fails
// it), and repeated runs give bitwise identical files.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <ostream>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"
#include "tools/npy.h"

namespace ringsplash::testing {
namespace {

constexpr int kRanks = 3;
// Generous: the faults must be detected in well under a second; the timeout
// only matters for a rank that goes silent, which these tests do not do.
constexpr double kCommTimeout = 20;
// Seconds a faulted run may take: the timeout itself (an upper bound, however
// loaded the machine) — the typical time is printed.
constexpr double kMaxSeconds = kCommTimeout;

const std::vector<std::string> kInputs = {"q.npy", "k.npy", "v.npy", "dout.npy"};

// Inputs [1, 96, 2, 16] f32 (96 tokens split as 2 x 3 zigzag chunks of 16).
void WriteInputs(const ScratchDir& dir) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  const std::vector<int64_t> shape = {1, 96, 2, 16};
  for (const std::string& name : kInputs) {
    std::vector<float> data(96 * 2 * 16);
    for (float& x : data) x = dist(rng);
    npy::WriteNpy(dir / name, npy::NpyType::kF32, shape, data.data());
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct Fault {
  int rank, step;
  bool backward;
  std::string Spec() const {
    return std::to_string(rank) + ":" + std::to_string(step) + (backward ? ":bwd" : "");
  }
};

void PrintTo(const Fault& f, std::ostream* os) { *os << "RINGSPLASH_FAULT=" << f.Spec(); }

std::string FaultName(const ::testing::TestParamInfo<Fault>& info) {
  return "rank" + std::to_string(info.param.rank) + "_step" + std::to_string(info.param.step) +
         (info.param.backward ? "_bwd" : "_fwd");
}

// The attend command line (without the program), forward + backward.
std::vector<std::string> AttendArgs(const ScratchDir& dir, bool mpi) {
  std::vector<std::string> a = {"attend",
                                "--q",
                                dir / "q.npy",
                                "--k",
                                dir / "k.npy",
                                "--v",
                                dir / "v.npy",
                                "--dout",
                                dir / "dout.npy",
                                "--out",
                                dir / "out.npy",
                                "--lse",
                                dir / "lse.npy",
                                "--dq",
                                dir / "dq.npy",
                                "--dk",
                                dir / "dk.npy",
                                "--dv",
                                dir / "dv.npy",
                                "--mask",
                                "causal",
                                "--layout",
                                "zigzag",
                                "--threads-per-rank",
                                "1",
                                "--comm-timeout",
                                std::to_string(static_cast<int>(kCommTimeout))};
  if (mpi) {
    a.insert(a.end(), {"--backend", "mpi"});
  } else {
    a.insert(a.end(), {"--ranks", std::to_string(kRanks)});
  }
  return a;
}

struct Timed {
  CommandResult result;
  double seconds = 0;
};

// How to run the CLI under mpirun.
enum class Mpirun {
  kNone,     // threads backend, no mpirun
  kDefault,  // mpirun as users run it: one rank exiting non-zero ends the job
  kPerRank,  // every rank runs to its own end; exit statuses recorded per rank
};

// Runs the CLI with the fault spec (empty: none) in the environment. For
// kPerRank each rank's exit status is written to <status_dir>/status.<rank>.
Timed RunAttend(const ScratchDir& dir, Mpirun how, const std::string& fault,
                const std::string& status_dir = "") {
  std::vector<std::string> argv;
  const bool mpi = how != Mpirun::kNone;
  if (mpi) {
#ifdef RINGSPLASH_MPIEXEC
    // Open MPI refuses to start as root (CI containers) without these.
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    argv = {RINGSPLASH_MPIEXEC, "--oversubscribe", "-np", std::to_string(kRanks), "--tag-output"};
    if (!fault.empty()) argv.insert(argv.end(), {"-x", "RINGSPLASH_FAULT=" + fault});
    if (how == Mpirun::kPerRank) {
      // By default mpirun kills the remaining ranks as soon as one exits with
      // a non-zero status, which races with their own detection of the
      // failure; turned off, each rank has to notice the failed peer by
      // itself (the property under test). mpirun then exits 0, so a wrapper
      // records each rank's own exit status.
      argv.insert(argv.end(), {"--mca", "orte_abort_on_non_zero_status", "0", "sh", "-c",
                               "\"$0\" \"$@\"; s=$?; echo $s > '" + status_dir +
                                   "'/status.$OMPI_COMM_WORLD_RANK; exit $s"});
    }
#else
    (void)status_dir;  // built without MPI: no test runs mpirun
#endif
  } else {
    argv = {"env", fault.empty() ? "-u" : "RINGSPLASH_FAULT=" + fault};
    if (fault.empty()) argv.push_back("RINGSPLASH_FAULT");
  }
  argv.push_back(RINGSPLASH_CLI);
  for (const std::string& a : AttendArgs(dir, mpi)) argv.push_back(a);
  const auto start = std::chrono::steady_clock::now();
  Timed t;
  t.result = RunCommand(argv, static_cast<int>(kMaxSeconds) + 60);
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return t;
}

// Files in the directory other than the inputs.
std::vector<std::string> LeftOver(const ScratchDir& dir) {
  const std::set<std::string> inputs(kInputs.begin(), kInputs.end());
  std::vector<std::string> extra;
  for (const std::string& name : dir.List()) {
    if (!inputs.count(name) && name != "." && name != "..") extra.push_back(name);
  }
  return extra;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Common to every faulted run: it ended by itself, in time, left nothing.
void ExpectEndedCleanly(const ScratchDir& dir, const Timed& t, const Fault& f, const char* how) {
  std::printf("[ fault ] %s %s: failed in %.2f s (comm timeout %.0f s)\n", how, f.Spec().c_str(),
              t.seconds, kCommTimeout);
  EXPECT_LT(t.result.status, 124) << "killed by a signal or by the test's timeout";
  EXPECT_LT(t.seconds, kMaxSeconds);
  EXPECT_EQ(Join(LeftOver(dir)), "") << "output or temporary files left behind";
}

std::string Trace(const Timed& t, const Fault& f, const char* how) {
  return "RINGSPLASH_FAULT=" + f.Spec() + " (" + how + "); stderr:\n" + t.result.err +
         "\nstdout:\n" + t.result.out;
}

class FaultThreadsTest : public ::testing::TestWithParam<Fault> {};

// One process: the ranks are threads, the process exits 1 naming the rank.
TEST_P(FaultThreadsTest, FailsNamingTheFailedRankAndNoOutputIsLeft) {
  const Fault& f = GetParam();
  const ScratchDir dir;
  WriteInputs(dir);
  const Timed t = RunAttend(dir, Mpirun::kNone, f.Spec());
  SCOPED_TRACE(Trace(t, f, "threads"));
  ExpectEndedCleanly(dir, t, f, "threads");
  EXPECT_EQ(t.result.status, 1);
  const std::string failed = "rank " + std::to_string(f.rank);
  EXPECT_NE(t.result.err.find(failed), std::string::npos) << "stderr must name " << failed;
  EXPECT_NE(t.result.err.find("injected fault"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Faults, FaultThreadsTest,
                         ::testing::Values(Fault{0, 0, false}, Fault{1, 1, false},
                                           Fault{2, 2, false}, Fault{0, 2, true}, Fault{1, 0, true},
                                           Fault{2, 1, true}),
                         FaultName);

// Control: without the fault the same command succeeds and writes every
// output; repeated runs are bitwise identical.
TEST(FaultCli, ThreadsWithoutFaultSucceedsDeterministically) {
  const ScratchDir dir;
  WriteInputs(dir);
  const Timed a = RunAttend(dir, Mpirun::kNone, "");
  ASSERT_EQ(a.result.status, 0) << a.result.err;
  std::map<std::string, std::string> first;
  for (const char* f : {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) {
    first[f] = ReadFile(dir / f);
    EXPECT_GT(first[f].size(), 128u) << f;
  }
  for (int repeat = 0; repeat < 2; ++repeat) {
    const ScratchDir again;
    WriteInputs(again);
    ASSERT_EQ(RunAttend(again, Mpirun::kNone, "").result.status, 0);
    for (const auto& [f, bytes] : first) {
      EXPECT_TRUE(ReadFile(again / f) == bytes) << f << " differs between repeated runs";
    }
  }
}

#ifdef RINGSPLASH_MPIEXEC
// The error lines of each rank under mpirun --tag-output
// ("[job,rank]<stderr>:ringsplash attend: ...").
std::map<int, std::string> ErrorLinesByRank(const CommandResult& r) {
  const std::regex line(R"(\[\d+,(\d+)\]<stderr>:ringsplash attend: (.*))");
  std::map<int, std::string> by_rank;
  const std::string text = r.err + r.out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), line); it != std::sregex_iterator();
       ++it) {
    by_rank[std::stoi((*it)[1])] = (*it)[2];
  }
  return by_rank;
}

class FaultMpiTest : public ::testing::TestWithParam<Fault> {};

// Every rank notices the failure by itself: exit status 1 and an error line
// naming the failed rank, from each of the three processes.
TEST_P(FaultMpiTest, EveryRankExitsNonZeroNamingTheFailedRank) {
  const Fault& f = GetParam();
  const ScratchDir dir, statuses;
  WriteInputs(dir);
  const Timed t = RunAttend(dir, Mpirun::kPerRank, f.Spec(), statuses.path());
  SCOPED_TRACE(Trace(t, f, "mpi, per rank"));
  ExpectEndedCleanly(dir, t, f, "mpi per rank");
  const std::string failed = "rank " + std::to_string(f.rank);
  std::map<int, std::string> lines = ErrorLinesByRank(t.result);
  for (int r = 0; r < kRanks; ++r) {
    const std::string status = ReadFile(statuses / ("status." + std::to_string(r)));
    EXPECT_EQ(status, "1\n") << "exit status of rank " << r;
    ASSERT_TRUE(lines.count(r)) << "rank " << r << " printed no error line";
    EXPECT_NE(lines[r].find(failed), std::string::npos)
        << "rank " << r << "'s message does not name " << failed << ": " << lines[r];
  }
}

// As users run it: the job fails (mpirun exits non-zero), the failed rank is
// named, nothing is left behind.
TEST_P(FaultMpiTest, JobFailsUnderDefaultMpirun) {
  const Fault& f = GetParam();
  const ScratchDir dir;
  WriteInputs(dir);
  const Timed t = RunAttend(dir, Mpirun::kDefault, f.Spec());
  SCOPED_TRACE(Trace(t, f, "mpi"));
  ExpectEndedCleanly(dir, t, f, "mpi");
  EXPECT_NE(t.result.status, 0);
  const std::map<int, std::string> lines = ErrorLinesByRank(t.result);
  ASSERT_FALSE(lines.empty()) << "no rank printed an error line";
  for (const auto& [r, line] : lines) {
    EXPECT_NE(line.find("rank " + std::to_string(f.rank)), std::string::npos)
        << "rank " << r << ": " << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, FaultMpiTest,
                         ::testing::Values(Fault{1, 1, false}, Fault{2, 0, false},
                                           Fault{0, 2, true}, Fault{1, 0, true}),
                         FaultName);

// Without the fault the MPI run succeeds; two MPI runs are bitwise identical,
// and identical to the threads backend with the same ring size and layout
// (same kernels, same merge order — the backend only moves bytes).
TEST(FaultCli, MpiWithoutFaultSucceedsDeterministically) {
  std::map<std::string, std::string> runs[3];
  for (int run = 0; run < 3; ++run) {
    const ScratchDir dir;
    WriteInputs(dir);
    const Timed t = RunAttend(dir, run < 2 ? Mpirun::kDefault : Mpirun::kNone, "");
    ASSERT_EQ(t.result.status, 0) << t.result.err << t.result.out;
    for (const char* f : {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"}) {
      runs[run][f] = ReadFile(dir / f);
    }
  }
  for (const auto& [f, bytes] : runs[0]) {
    EXPECT_TRUE(runs[1][f] == bytes) << f << " differs between repeated MPI runs";
    EXPECT_TRUE(runs[2][f] == bytes) << f << " differs between the MPI and threads backends";
  }
}
#endif

}  // namespace
}  // namespace ringsplash::testing

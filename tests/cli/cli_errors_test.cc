// Every kind of bad input to the `ringsplash` command: exit status 1
// (runtime: files, shapes) or 2 (usage: flags, environment variables),
// exactly one line on stderr that names the problem, nothing on stdout, and
// no output file (or temporary) left in the directory. Also an interrupted
// run (the same promises, exit status 128 + signal) and the kernel path the
// command reports.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ringsplash/attention.h"
#include "tests/cli/cli_test_util.h"
#include "tools/npy.h"

extern char** environ;  // for posix_spawn: the child gets the test's environment

namespace ringsplash::testing {
namespace {

// A small valid problem: q [1, 16, 4, 8], k/v [1, 16, 2, 8], plus helpers
// to write variants.
class Files {
 public:
  explicit Files(const ScratchDir& dir) : dir_(dir) {
    F32("q.npy", {1, 16, 4, 8});
    F32("k.npy", {1, 16, 2, 8});
    F32("v.npy", {1, 16, 2, 8});
    F32("dout.npy", {1, 16, 4, 8});
    F32("sinks.npy", {4});
    I32("qs.npy", {1, 16});
    I32("ks.npy", {1, 16});
  }
  // 0.25 everywhere, except `last` in the last element.
  void F32(const std::string& name, std::vector<int64_t> shape, float last = 0.25f) const {
    std::vector<float> data(static_cast<size_t>(Numel(shape)), 0.25f);
    if (!data.empty()) data.back() = last;
    npy::WriteNpy(dir_ / name, npy::NpyType::kF32, shape, data.data());
  }
  void I32(const std::string& name, std::vector<int64_t> shape) const {
    std::vector<int32_t> data(static_cast<size_t>(Numel(shape)), 0);
    npy::WriteNpy(dir_ / name, npy::NpyType::kI32, shape, data.data());
  }
  void I64(const std::string& name, std::vector<int64_t> shape, int64_t value) const {
    std::vector<int64_t> data(static_cast<size_t>(Numel(shape)), value);
    npy::WriteNpy(dir_ / name, npy::NpyType::kI64, shape, data.data());
  }
  void Bool(const std::string& name, std::vector<int64_t> shape) const {
    std::vector<uint8_t> data(static_cast<size_t>(Numel(shape)), 1);
    npy::WriteNpy(dir_ / name, npy::NpyType::kBool, shape, data.data());
  }
  void Raw(const std::string& name, const std::string& bytes) const {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
  }
  void Dir(const std::string& name) const { std::filesystem::create_directory(dir_ / name); }
  // A symbolic link `name` to `target` (a name in the same directory).
  void Link(const std::string& name, const std::string& target) const {
    std::filesystem::create_symlink(target, dir_ / name);
  }

 private:
  static int64_t Numel(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  }
  const ScratchDir& dir_;
};

struct BadCase {
  std::string name;
  std::function<void(const Files&)> setup;  // may be empty
  // Arguments; "@x" is replaced by the path of file x in the scratch dir.
  std::vector<std::string> args;
  int status;
  std::string message;             // must appear in the stderr line
  std::vector<std::string> env{};  // NAME=VALUE settings for the command
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

std::vector<std::string> Attend(std::vector<std::string> extra) {
  std::vector<std::string> a = {"attend", "--q",   "@q.npy",   "--k",   "@k.npy",  "--v",
                                "@v.npy", "--out", "@out.npy", "--lse", "@lse.npy"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::vector<BadCase> Cases() {
  auto q_as = [](std::vector<int64_t> shape) {
    return [shape](const Files& f) { f.F32("q.npy", shape); };
  };
  auto k_as = [](std::vector<int64_t> shape) {
    return [shape](const Files& f) { f.F32("k.npy", shape); };
  };
  return {
      // --- shapes and files: status 1, the file named ---
      {"k_2d", k_as({4, 16}), Attend({}), 1,
       "k.npy: expected 4 dims [B, Skv, Hkv, D], got [4, 16]"},
      {"batch_mismatch", k_as({2, 16, 2, 8}), Attend({}), 1, "k.npy: dim 0 (B) is 2"},
      {"head_dim_mismatch", k_as({1, 16, 2, 4}), Attend({}), 1, "k.npy: dim 3 (D) is 4"},
      {"v_length_mismatch",
       [](const Files& f) {
         f.F32("v.npy", {1, 15, 2, 8});
       },
       Attend({}), 1, "v.npy: dim 1 (Skv) is 15"},
      {"heads_not_multiple", k_as({1, 16, 3, 8}), Attend({}), 1, "must divide the query heads"},
      {"zero_length", q_as({1, 0, 4, 8}), Attend({}), 1, "every dimension must be > 0"},
      {"zigzag_indivisible", nullptr, Attend({"--ranks", "3", "--layout", "zigzag"}), 1,
       "does not divide by 6"},
      {"striped_indivisible", nullptr, Attend({"--ranks", "5", "--layout", "striped"}), 1,
       "does not divide by 5"},
      {"missing_file",
       nullptr,
       {"attend", "--q", "@nope.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@out.npy"},
       1,
       "nope.npy: cannot open"},
      {"not_npy", [](const Files& f) { f.Raw("q.npy", "certainly not an array"); }, Attend({}), 1,
       "q.npy: not a .npy file (bad magic"},
      {"fortran_order",
       [](const Files& f) {
         std::string h = npy::FormatHeader(npy::NpyType::kF32, std::vector<int64_t>{1, 16, 4, 8});
         h.replace(h.find("False"), 5, "True ");
         f.Raw("q.npy", h + std::string(16 * 4 * 8 * 4, '\0'));
       },
       Attend({}), 1, "q.npy: Fortran-order arrays are not supported"},
      {"truncated",
       [](const Files& f) {
         f.Raw("k.npy", npy::FormatHeader(npy::NpyType::kF32, std::vector<int64_t>{1, 16, 2, 8}) +
                            std::string(100, '\0'));
       },
       Attend({}), 1, "k.npy: shape [1, 16, 2, 8] of <f4 needs 1024 data bytes"},
      {"int_q",
       [](const Files& f) {
         f.I32("q.npy", {1, 16, 4, 8});
       },
       Attend({}), 1, "q.npy: q must be float32 or float16"},
      {"dout_shape",
       [](const Files& f) {
         f.F32("dout.npy", {1, 16, 4, 7});
       },
       Attend({"--dout", "@dout.npy", "--dq", "@dq.npy"}), 1, "dout.npy: dim 3 (Dv) is 7"},
      {"sinks_shape", [](const Files& f) { f.F32("sinks.npy", {5}); },
       Attend({"--sinks", "@sinks.npy"}), 1, "sinks.npy: dim 0 (H) is 5"},
      {"sinks_nan", [](const Files& f) { f.F32("sinks.npy", {4}, NAN); },
       Attend({"--sinks", "@sinks.npy", "--ranks", "2"}), 1,
       "sinks.npy: sinks[3] is nan; sink logits must be finite or -inf (no sink)"},
      {"segments_float",
       [](const Files& f) {
         f.F32("qs.npy", {1, 16});
       },
       Attend({"--q-segments", "@qs.npy", "--kv-segments", "@ks.npy"}), 1,
       "qs.npy: q segment ids must be int32"},
      {"segments_shape",
       [](const Files& f) {
         f.I32("ks.npy", {1, 8});
       },
       Attend({"--q-segments", "@qs.npy", "--kv-segments", "@ks.npy"}), 1,
       "ks.npy: dim 1 (Skv) is 8"},
      // Found only while loading, after the temporaries exist: they must go.
      {"segment_id_out_of_int32",
       [](const Files& f) {
         f.I64("ks.npy", {1, 16}, 1LL << 40);
       },
       Attend({"--q-segments", "@qs.npy", "--kv-segments", "@ks.npy"}), 1, "does not fit in int32"},
      {"dense_shape",
       [](const Files& f) {
         f.Bool("m.npy", {16, 15});
       },
       Attend({"--dense-mask", "@m.npy"}), 1, "m.npy: dim 1 (Skv) is 15"},
      {"dense_float",
       [](const Files& f) {
         f.F32("m.npy", {16, 16});
       },
       Attend({"--dense-mask", "@m.npy"}), 1, "m.npy: a dense mask must be bool"},
      {"output_dir_missing",
       nullptr,
       {"attend", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@no/such/out.npy"},
       1,
       "cannot create"},
      {"output_is_dir",
       nullptr,
       {"attend", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@"},
       1,
       "is a directory"},
      // --- flags: status 2, the flag named ---
      {"unknown_mask", nullptr, Attend({"--mask", "causal & banana"}), 2, "--mask"},
      {"softcap_negative", nullptr, Attend({"--softcap", "-1"}), 2, "--softcap"},
      {"softcap_zero", nullptr, Attend({"--softcap", "0"}), 2, "--softcap"},
      {"softcap_nan", nullptr, Attend({"--softcap", "nan"}), 2, "--softcap"},
      {"softcap_text", nullptr, Attend({"--softcap", "big"}), 2, "--softcap"},
      {"scale_zero", nullptr, Attend({"--scale", "0"}), 2, "--scale"},
      {"unknown_flag", nullptr, Attend({"--frobnicate"}), 2, "frobnicate"},
      {"missing_out",
       nullptr,
       {"attend", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy"},
       2,
       "--out"},
      {"q_segments_alone", nullptr, Attend({"--q-segments", "@qs.npy"}), 2,
       "--q-segments needs --kv-segments"},
      {"kv_segments_alone", nullptr, Attend({"--kv-segments", "@ks.npy"}), 2,
       "--kv-segments needs --q-segments"},
      {"dq_without_dout", nullptr, Attend({"--dq", "@dq.npy"}), 2, "--dq needs --dout"},
      {"dout_without_grads", nullptr, Attend({"--dout", "@dout.npy"}), 2,
       "--dout needs at least one of"},
      {"dsinks_without_sinks", nullptr, Attend({"--dout", "@dout.npy", "--dsinks", "@ds.npy"}), 2,
       "--dsinks needs --sinks"},
      {"same_output_twice", nullptr, Attend({"--dout", "@dout.npy", "--dq", "@out.npy"}), 2,
       "name the same file"},
      // Spelt differently, one file: the same usage error, not "File exists"
      // from the second temporary.
      {"same_output_dot_slash",
       nullptr,
       {"attend", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@out.npy", "--lse",
        "@./out.npy"},
       2,
       "--out and --lse name the same file"},
      {"same_output_dot_dot", [](const Files& f) { f.Dir("sub"); },
       Attend({"--dout", "@dout.npy", "--dq", "@sub/../lse.npy"}), 2,
       "--lse and --dq name the same file"},
      // An output naming an input (however spelt) would replace the input.
      {"output_over_input",
       nullptr,
       {"attend", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@./q.npy"},
       2,
       "would overwrite the input --q"},
      // ... or the file an input links to.
      {"output_over_linked_input",
       [](const Files& f) { f.Link("link.npy", "q.npy"); },
       {"attend", "--q", "@link.npy", "--k", "@k.npy", "--v", "@v.npy", "--out", "@q.npy"},
       2,
       "would overwrite the input --q"},
      {"gradient_over_dout", [](const Files& f) { f.Dir("sub"); },
       Attend({"--dout", "@dout.npy", "--dq", "@sub/../dout.npy"}), 2,
       "would overwrite the input --dout"},
      // D, Dv above the kernels' limit: named by file, like other shape errors.
      {"head_dim_above_limit",
       [](const Files& f) {
         f.F32("q.npy", {1, 16, 4, 257});
         f.F32("k.npy", {1, 16, 2, 257});
       },
       Attend({}), 1, "q.npy: head dim D = 257 is above 256"},
      {"v_head_dim_above_limit",
       [](const Files& f) {
         f.F32("v.npy", {1, 16, 2, 300});
       },
       Attend({}), 1, "v.npy: value head dim Dv = 300 is above 256"},
      {"bad_layout", nullptr, Attend({"--layout", "diagonal"}), 2, "--layout"},
      {"bad_backend", nullptr, Attend({"--backend", "pigeon"}), 2, "--backend"},
      {"bad_dtype", nullptr, Attend({"--dtype", "f64"}), 2, "--dtype"},
      {"negative_ranks", nullptr, Attend({"--ranks", "-1"}), 2, "--ranks"},
      {"zero_ranks", nullptr, Attend({"--ranks", "0"}), 2, "--ranks: expected 1 to 4096, got 0"},
      {"ulysses_not_dividing_ranks", nullptr, Attend({"--ranks", "4", "--ulysses", "3"}), 2,
       "--ulysses 3 must divide the 4 ranks"},
      {"zero_ulysses", nullptr, Attend({"--ulysses", "0"}), 2, "--ulysses: expected 1 to 4096"},
      {"ranks_text", nullptr, Attend({"--ranks", "four"}), 2, "--ranks"},
      {"negative_threads", nullptr, Attend({"--threads-per-rank", "-2"}), 2, "--threads-per-rank"},
      {"too_many_threads", nullptr, Attend({"--threads-per-rank", "1025"}), 2,
       "--threads-per-rank: expected 1 to 1024 (or 0 for the cores each rank may use), got 1025"},
      {"zero_timeout", nullptr, Attend({"--comm-timeout", "0"}), 2, "--comm-timeout"},
      {"unknown_subcommand",
       nullptr,
       {"frobnicate"},
       2,
       "unknown subcommand 'frobnicate' (expected demo, attend or bench"},
      {"bench_zero_seq", nullptr, {"bench", "--seq", "0"}, 2, "--seq"},
      {"bench_bad_pass", nullptr, {"bench", "--pass", "sideways"}, 2, "--pass"},
      {"bench_indivisible",
       nullptr,
       {"bench", "--seq", "100", "--ranks", "3"},
       2,
       "does not divide by 6"},
      {"bench_kv_heads", nullptr, {"bench", "--heads", "8", "--kv-heads", "3"}, 2, "--kv-heads"},
      {"bench_block", nullptr, {"bench", "--block-q", "20"}, 2, "--block-q"},
      {"bench_iters", nullptr, {"bench", "--iters", "0"}, 2, "--iters"},
      {"bench_head_dim",
       nullptr,
       {"bench", "--head-dim", "257"},
       2,
       "--head-dim: expected 1 to 256"},
      {"bench_v_head_dim",
       nullptr,
       {"bench", "--head-dim", "16", "--v-head-dim", "300"},
       2,
       "--v-head-dim: expected 1 to 256"},
      // 0 is a value like any other, not "the default" (docs/CLI.md).
      {"bench_zero_ranks",
       nullptr,
       {"bench", "--ranks", "0"},
       2,
       "--ranks: expected 1 to 4096, got 0"},
      {"bench_zero_kv_heads",
       nullptr,
       {"bench", "--kv-heads", "0"},
       2,
       "--kv-heads: expected a positive integer, got 0"},
      {"bench_zero_v_head_dim",
       nullptr,
       {"bench", "--v-head-dim", "0"},
       2,
       "--v-head-dim: expected 1 to 256"},
      {"bench_zero_q_seq",
       nullptr,
       {"bench", "--q-seq", "0"},
       2,
       "--q-seq: expected a positive integer, got 0"},
      {"bench_negative_threads",
       nullptr,
       {"bench", "--threads-per-rank", "-1"},
       2,
       "--threads-per-rank: expected 1 to 1024 (or 0 for the cores each rank may use), got -1"},
      {"demo_threads",
       nullptr,
       {"demo", "--threads-per-rank", "5000"},
       2,
       "--threads-per-rank: expected 1 to 1024"},
      {"bench_negative_seed",
       nullptr,
       {"bench", "--seed", "-1"},
       2,
       "--seed: expected 0 to 9007199254740991 (2^53 - 1), got -1"},
      {"bench_huge_seed", nullptr, {"bench", "--seed", "9007199254740992"}, 2, "--seed"},
      {"demo_ranks", nullptr, {"demo", "--ranks", "0"}, 2, "--ranks"},
      {"demo_one_rank",
       nullptr,
       {"demo", "--ranks", "1"},
       2,
       "--ranks: the demo needs at least 2 ranks"},
      {"demo_bad_seq", nullptr, {"demo", "--seq", "100"}, 2, "does not divide by 8"},
      // Environment variables: checked before any rank starts, so the line
      // names the variable, not "rank R failed", and the status is 2.
      {"kernel_env_unknown",
       nullptr,
       Attend({"--ranks", "2"}),
       2,
       "attend: RINGSPLASH_KERNEL: expected auto|portable|",
       {"RINGSPLASH_KERNEL=bogus"}},
      {"kernel_env_unknown_demo",
       nullptr,
       {"demo", "--seq", "256"},
       2,
       "demo: RINGSPLASH_KERNEL: expected auto|portable|",
       {"RINGSPLASH_KERNEL=bogus"}},
      {"fault_env_malformed",
       nullptr,
       Attend({"--ranks", "2"}),
       2,
       "attend: fault spec (RINGSPLASH_FAULT)",
       {"RINGSPLASH_FAULT=banana"}},
      // A fault the ring would never reach must not pass for an injected one.
      {"fault_env_rank_outside_ring",
       nullptr,
       Attend({"--ranks", "2"}),
       2,
       "RINGSPLASH_FAULT=2:0: rank 2 is not in this ring of 2 ranks",
       {"RINGSPLASH_FAULT=2:0"}},
      {"fault_env_step_past_ring",
       nullptr,
       Attend({"--ranks", "2"}),
       2,
       "RINGSPLASH_FAULT=1:2: step 2 is past the last ring step",
       {"RINGSPLASH_FAULT=1:2"}},
      {"fault_env_backward_not_run",
       nullptr,
       Attend({"--ranks", "2"}),
       2,
       "RINGSPLASH_FAULT=0:0:bwd: the backward pass does not run",
       {"RINGSPLASH_FAULT=0:0:bwd"}},
      {"fault_env_single_device",
       nullptr,
       Attend({}),
       2,
       "RINGSPLASH_FAULT=0:0: no ring runs with 1 rank",
       {"RINGSPLASH_FAULT=0:0"}},
      {"fault_env_rank_outside_bench_ring",
       nullptr,
       {"bench", "--seq", "64", "--ranks", "2"},
       2,
       "bench: RINGSPLASH_FAULT=3:0: rank 3 is not in this ring of 2 ranks",
       {"RINGSPLASH_FAULT=3:0"}},
  };
}

class BadInputTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInputTest, OneLineOnStderrAndNoOutputLeft) {
  const BadCase& c = GetParam();
  ScratchDir dir;
  Files files(dir);
  if (c.setup) c.setup(files);
  std::vector<std::string> args;
  for (const std::string& a : c.args) args.push_back(a[0] == '@' ? dir / a.substr(1) : a);
  const std::vector<std::string> before = dir.List();

  std::vector<std::string> argv = {"env"};
  argv.insert(argv.end(), c.env.begin(), c.env.end());
  argv.push_back(RINGSPLASH_CLI);
  argv.insert(argv.end(), args.begin(), args.end());
  const CommandResult r = RunCommand(argv, 60);
  EXPECT_EQ(r.status, c.status) << r.err;
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
  EXPECT_EQ(r.err.rfind("ringsplash", 0), 0u) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(dir.List(), before) << "an output or temporary file was left behind";
}

INSTANTIATE_TEST_SUITE_P(Cli, BadInputTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

TEST(BadInputMpi, RankZeroReportsAndNothingIsLeft) {
#ifndef RINGSPLASH_MPIEXEC
  GTEST_SKIP() << "built without MPI";
#else
  ScratchDir dir;
  Files files(dir);
  files.F32("k.npy", {4, 16});
  const std::vector<std::string> before = dir.List();
  const CommandResult r =
      RunCliUnderMpi(2,
                     {"attend", "--backend", "mpi", "--q", dir / "q.npy", "--k", dir / "k.npy",
                      "--v", dir / "v.npy", "--out", dir / "out.npy"},
                     120);
  EXPECT_NE(r.status, 0);
  // mpirun adds its own lines; ours appears exactly once (rank 0 only).
  const std::string msg = "k.npy: expected 4 dims [B, Skv, Hkv, D], got [4, 16]";
  const size_t first = r.err.find(msg);
  ASSERT_NE(first, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(msg, first + 1), std::string::npos) << r.err;
  EXPECT_EQ(dir.List(), before);
#endif
}

// Ctrl-C during a run: the temporaries go, an existing output stays, one
// stderr line says so, nothing is on stdout, and the process dies of the
// signal (exit status 128 + 2 = 130 in a shell; docs/CLI.md).
TEST(Interrupted, SigintRemovesTemporariesAndPrintsOneLine) {
  ScratchDir dir, capture;
  Files files(dir);
  // Big enough that the forward runs for about a second on one thread after
  // the temporaries appear; the signal follows them within milliseconds.
  files.F32("q.npy", {1, 8192, 8, 64});
  files.F32("k.npy", {1, 8192, 8, 64});
  files.F32("v.npy", {1, 8192, 8, 64});
  files.Raw("out.npy", "old");
  const std::vector<std::string> before = dir.List();

  std::vector<std::string> args = {
      RINGSPLASH_CLI, "attend", "--q",           dir / "q.npy",        "--k", dir / "k.npy", "--v",
      dir / "v.npy",  "--out",  dir / "out.npy", "--threads-per-rank", "1"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  ASSERT_EQ(posix_spawn_file_actions_init(&actions), 0);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, (capture / "out").c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, (capture / "err").c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_EQ(spawned, 0) << "cannot start " << RINGSPLASH_CLI;

  // Wait for the temporary (".out.npy.<pid>.ringsplash-tmp"), then interrupt.
  int status = 0;
  bool exited = false, seen = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!seen && !exited && std::chrono::steady_clock::now() < deadline) {
    for (const std::string& name : dir.List()) seen = seen || name.rfind(".out.npy.", 0) == 0;
    if (!seen) {
      exited = waitpid(pid, &status, WNOHANG) == pid;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  if (!exited) {
    ::kill(pid, SIGINT);
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
  }
  ASSERT_TRUE(seen) << "no temporary output appeared";

  std::ifstream err_file(capture / "err"), out_file(capture / "out");
  const std::string err((std::istreambuf_iterator<char>(err_file)), {});
  const std::string out((std::istreambuf_iterator<char>(out_file)), {});
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status << err;
  EXPECT_EQ(err, "ringsplash attend: interrupted by SIGINT\n");
  EXPECT_EQ(out, "");
  EXPECT_EQ(dir.List(), before) << "a temporary was left behind";
  std::ifstream old(dir / "out.npy");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(old)), {}), "old");
}

// kernel_path names the path that does the dtype's products. f32 products
// have no bf16 or AMX form: on the avx512_bf16 and amx paths they run on
// AVX-512 FMA, and an f32 run must say avx512, not amx.
TEST(KernelPathReport, NamesThePathOfTheDtypesProducts) {
  std::vector<std::string> forced = {""};  // "": RINGSPLASH_KERNEL as the test has it
  for (KernelPath p : SupportedKernelPaths()) {
    if (p == KernelPath::kAvx512Bf16 || p == KernelPath::kAmx) forced.push_back(KernelPathName(p));
  }
  for (const std::string& path : forced) {
    const std::string resolved =
        path.empty() ? KernelPathName(ResolveKernelPath(KernelPath::kAuto)) : path;
    for (const std::string dtype : {"f32", "bf16"}) {
      std::vector<std::string> argv = {"env"};
      if (!path.empty()) argv.push_back("RINGSPLASH_KERNEL=" + path);
      argv.insert(argv.end(),
                  {RINGSPLASH_CLI, "bench", "--seq", "64", "--heads", "1", "--head-dim", "16",
                   "--warmup", "0", "--iters", "1", "--threads-per-rank", "1", "--dtype", dtype});
      const CommandResult r = RunCommand(argv, 120);
      ASSERT_EQ(r.status, 0) << r.err;
      const nlohmann::json j = nlohmann::json::parse(r.out);
      const bool f32_on_bf16_path =
          dtype == "f32" && (resolved == "avx512_bf16" || resolved == "amx");
      EXPECT_EQ(j["kernel_path"], f32_on_bf16_path ? "avx512" : resolved)
          << "RINGSPLASH_KERNEL=" << path << " --dtype " << dtype;
    }
  }
}

}  // namespace
}  // namespace ringsplash::testing

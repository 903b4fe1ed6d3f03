// Every kind of bad input to the `ringsplash` command: exit status 1
// (runtime: files, shapes) or 2 (usage: flags), exactly one line on stderr
// that names the problem, nothing on stdout, and no output file (or
// temporary) left in the directory.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"
#include "tools/npy.h"

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
  void F32(const std::string& name, std::vector<int64_t> shape) const {
    std::vector<float> data(static_cast<size_t>(Numel(shape)), 0.25f);
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
  std::string message;  // must appear in the stderr line
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
      {"bad_layout", nullptr, Attend({"--layout", "diagonal"}), 2, "--layout"},
      {"bad_backend", nullptr, Attend({"--backend", "pigeon"}), 2, "--backend"},
      {"bad_dtype", nullptr, Attend({"--dtype", "f64"}), 2, "--dtype"},
      {"negative_ranks", nullptr, Attend({"--ranks", "-1"}), 2, "--ranks"},
      {"ranks_text", nullptr, Attend({"--ranks", "four"}), 2, "--ranks"},
      {"negative_threads", nullptr, Attend({"--threads-per-rank", "-2"}), 2, "--threads-per-rank"},
      {"zero_timeout", nullptr, Attend({"--comm-timeout", "0"}), 2, "--comm-timeout"},
      {"unknown_subcommand", nullptr, {"frobnicate"}, 2, "frobnicate"},
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
      {"demo_ranks", nullptr, {"demo", "--ranks", "0"}, 2, "--ranks"},
      {"demo_bad_seq", nullptr, {"demo", "--seq", "100"}, 2, "does not divide by 8"},
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

  const CommandResult r = RunCli(args, 60);
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
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  ScratchDir dir;
  Files files(dir);
  files.F32("k.npy", {4, 16});
  const std::vector<std::string> before = dir.List();
  const CommandResult r =
      RunCommand({RINGSPLASH_MPIEXEC, "--oversubscribe", "-np", "2", RINGSPLASH_CLI, "attend",
                  "--backend", "mpi", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v",
                  dir / "v.npy", "--out", dir / "out.npy"},
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

}  // namespace
}  // namespace ringsplash::testing

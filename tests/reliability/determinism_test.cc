// Determinism (issue #6.5): the same inputs give BITWISE identical outputs
// and gradients
//   - across repeated single-device runs and across kernel thread counts
//     (1, 2, 3, 4), on every kernel path this CPU supports;
//   - across repeated ring runs for a fixed ring size, layout and backend
//     (threads here; MPI through the command line in fault_cli_test.cc), and
//     across the kernel thread count of each rank.
// Comparisons are memcmp of the raw output bytes: no tolerance — any
// scheduling-dependent summation order (atomics, a reduction in completion
// order, a thread-count-dependent tiling) shows up as a differing bit.
//
// Problems are chosen to have several q and kv blocks (so work is really
// split across threads), GQA, sinks, segments, partial and empty tiles, and
// backward passes whose dk/dv sum over many query blocks and heads.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

// Every output of one forward + backward, as raw bytes.
struct Outputs {
  Tensor out, lse, dq, dk, dv, dsinks;
};

// Index of the first differing byte, or -1.
int64_t FirstDifference(const Tensor& a, const Tensor& b) {
  if (a.bytes() != b.bytes()) return 0;
  const auto* pa = static_cast<const unsigned char*>(a.data());
  const auto* pb = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < a.bytes(); ++i) {
    if (pa[i] != pb[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

void ExpectBitwiseEqual(const Outputs& a, const Outputs& b, const std::string& what) {
  const std::pair<const char*, const Tensor Outputs::*> fields[] = {
      {"out", &Outputs::out}, {"lse", &Outputs::lse}, {"dq", &Outputs::dq},
      {"dk", &Outputs::dk},   {"dv", &Outputs::dv},   {"dsinks", &Outputs::dsinks}};
  for (const auto& [name, field] : fields) {
    const Tensor& ta = a.*field;
    const Tensor& tb = b.*field;
    if (ta.data() == nullptr && tb.data() == nullptr) continue;
    EXPECT_EQ(FirstDifference(ta, tb), -1)
        << what << ": " << name << " differs at byte " << FirstDifference(ta, tb);
  }
}

struct Case {
  std::string name;
  ProblemSpec spec;
  Mask mask;
  DType out_dtype = DType::kF32;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  {
    Case c{"f32 causal GQA sinks segments", {}, Mask::Causal(), DType::kF32};
    c.spec.b = 2;
    c.spec.sq = 200;
    c.spec.skv = 264;
    c.spec.h = 4;
    c.spec.hkv = 2;
    c.spec.d = 32;
    c.spec.dv = 24;
    c.spec.sinks = true;
    c.spec.segments = true;
    c.mask = Mask::Causal(64);
    cases.push_back(c);
  }
  {
    Case c{
        "bf16 local window, [B,H,S,D] views, bf16 outputs", {}, Mask::Local(40, 8), DType::kBF16};
    c.spec.sq = 192;
    c.spec.skv = 192;
    c.spec.h = 3;
    c.spec.hkv = 1;
    c.spec.d = 48;
    c.spec.dv = 48;
    c.spec.dtype = DType::kBF16;
    c.spec.bhsd = true;
    cases.push_back(c);
  }
  {
    Case c{"f16 chunked | local, full attention rows",
           {},
           Mask::Parse("chunked:50 | local:3,3"),
           DType::kF32};
    c.spec.sq = 160;
    c.spec.skv = 224;
    c.spec.h = 2;
    c.spec.hkv = 2;
    c.spec.d = 16;
    c.spec.dv = 32;
    c.spec.dtype = DType::kF16;
    c.spec.qk_range = 3.0;
    cases.push_back(c);
  }
  return cases;
}

Outputs RunSingle(const OwnedInputs& in, const AttentionOptions& opt, const Tensor& dout,
                  DType out_dtype) {
  const AttentionInputs ai = in.inputs();
  const int64_t b = ai.q.shape[0], sq = ai.q.shape[1], h = ai.q.shape[2], d = ai.q.shape[3];
  const int64_t skv = ai.k.shape[1], hkv = ai.k.shape[2], dv = ai.v.shape[3];
  Outputs o;
  o.out = Tensor(out_dtype, {b, sq, h, dv});
  o.lse = Tensor(DType::kF32, {b, h, sq});
  o.dq = Tensor(DType::kF32, {b, sq, h, d});
  o.dk = Tensor(DType::kF32, {b, skv, hkv, d});
  o.dv = Tensor(DType::kF32, {b, skv, hkv, dv});
  if (ai.sinks.defined()) o.dsinks = Tensor(DType::kF32, {h});
  AttentionForward(ai, opt, o.out.view(), o.lse.view());
  AttentionBackward(ai, opt, o.out.view(), o.lse.view(), dout.view(), o.dq.view(), o.dk.view(),
                    o.dv.view(), ai.sinks.defined() ? o.dsinks.view() : TensorView());
  return o;
}

TEST(Determinism, SingleDeviceAcrossThreadCountsAndRepeats) {
  for (const Case& c : Cases()) {
    Rng rng(1234);
    const OwnedInputs in = RandomInputs(rng, c.spec);
    const AttentionInputs ai = in.inputs();
    const Tensor dout = RandomTensor(rng, c.out_dtype,
                                     {ai.q.shape[0], ai.q.shape[1], ai.q.shape[2], ai.v.shape[3]});
    for (KernelPath path : SupportedKernelPaths()) {
      AttentionOptions opt;
      opt.mask = c.mask;
      opt.kernel_path = path;
      opt.block_sizes = {32, 64};  // many tiles: every thread count really splits work
      opt.num_threads = 1;
      const Outputs first = RunSingle(in, opt, dout, c.out_dtype);
      for (int threads : {1, 2, 3, 4}) {
        for (int repeat = 0; repeat < 2; ++repeat) {
          opt.num_threads = threads;
          const Outputs again = RunSingle(in, opt, dout, c.out_dtype);
          ExpectBitwiseEqual(first, again,
                             c.name + ", path " + KernelPathName(path) + ", " +
                                 std::to_string(threads) + " threads, repeat " +
                                 std::to_string(repeat));
        }
      }
    }
  }
}

// Several callers at once (e.g. ranks of the threads backend) lease separate
// thread pools: results must not depend on what runs concurrently either.
TEST(Determinism, SingleDeviceUnderConcurrentCallers) {
  const Case c = Cases()[0];
  Rng rng(77);
  const OwnedInputs in = RandomInputs(rng, c.spec);
  const AttentionInputs ai = in.inputs();
  const Tensor dout =
      RandomTensor(rng, DType::kF32, {ai.q.shape[0], ai.q.shape[1], ai.q.shape[2], ai.v.shape[3]});
  AttentionOptions opt;
  opt.mask = c.mask;
  opt.num_threads = 2;
  const Outputs first = RunSingle(in, opt, dout, DType::kF32);
  std::vector<Outputs> results(3);
  RunThreadRanks(3, CommOptions{}, [&](Communicator& comm) {
    results[static_cast<size_t>(comm.rank())] = RunSingle(in, opt, dout, DType::kF32);
  });
  for (size_t r = 0; r < results.size(); ++r) {
    ExpectBitwiseEqual(first, results[r], "concurrent caller " + std::to_string(r));
  }
}

Outputs RunRing(const OwnedInputs& in, const Mask& mask, int ranks, Layout layout,
                int threads_per_rank, const Tensor& dout) {
  const AttentionInputs ai = in.inputs();
  const int64_t b = ai.q.shape[0], sq = ai.q.shape[1], h = ai.q.shape[2], d = ai.q.shape[3];
  const int64_t skv = ai.k.shape[1], hkv = ai.k.shape[2], dv = ai.v.shape[3];
  Outputs o;
  o.out = Tensor(DType::kF32, {b, sq, h, dv});
  o.lse = Tensor(DType::kF32, {b, h, sq});
  o.dq = Tensor(DType::kF32, {b, sq, h, d});
  o.dk = Tensor(DType::kF32, {b, skv, hkv, d});
  o.dv = Tensor(DType::kF32, {b, skv, hkv, dv});
  if (ai.sinks.defined()) o.dsinks = Tensor(DType::kF32, {h});
  RingRun run;
  run.num_ranks = ranks;
  run.options.layout = layout;
  run.options.attention.mask = mask;
  run.options.attention.num_threads = threads_per_rank;
  run.options.attention.block_sizes = {16, 32};
  run.comm.timeout_s = 120;  // generous: TSan slows everything down
  RingAttentionThreads(run, ai, o.out.view(), o.lse.view(), dout.view(), o.dq.view(), o.dk.view(),
                       o.dv.view(), ai.sinks.defined() ? o.dsinks.view() : TensorView());
  return o;
}

TEST(Determinism, RingRepeatedRunsAndThreadsPerRank) {
  ProblemSpec spec;
  spec.b = 1;
  spec.sq = 96;  // divides by 2N for N = 2, 3, 4 (zigzag)
  spec.skv = 96;
  spec.h = 4;
  spec.hkv = 2;
  spec.d = 16;
  spec.dv = 16;
  spec.sinks = true;
  spec.segments = true;
  Rng rng(4321);
  const OwnedInputs in = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kF32, {spec.b, spec.sq, spec.h, spec.dv});
  const Mask mask = Mask::Parse("causal & local:40,");
  for (int ranks : {2, 3, 4}) {
    for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped}) {
      const std::string what = std::to_string(ranks) + " ranks, layout " + LayoutName(layout);
      const Outputs first = RunRing(in, mask, ranks, layout, 1, dout);
      ExpectBitwiseEqual(first, RunRing(in, mask, ranks, layout, 1, dout), what + ", repeat");
      ExpectBitwiseEqual(first, RunRing(in, mask, ranks, layout, 2, dout),
                         what + ", 2 kernel threads per rank");
    }
  }
}

// ---- Concurrent calls (attention.h, ring.h: "Concurrency") ----------------
//
// What the headers promise: single-device calls from several threads at
// once, and ring calls on different communicators at once, each give
// bitwise what it gives alone. Short problems: these also run under TSan.

// Four different problems (shapes, GQA, dtypes, masks, sinks, segments) run
// by four std::threads at once, each twice, against each run alone.
TEST(Concurrency, SingleDeviceCallsOnDifferentData) {
  struct Problem {
    OwnedInputs in;
    AttentionOptions opt;
    Tensor dout;
    DType out_dtype;
    Outputs alone;
  };
  std::vector<Problem> problems;
  Rng rng(99);
  for (int i = 0; i < 4; ++i) {
    ProblemSpec spec(1 + i % 2, 48 + 16 * i, 64, 2 * (1 + i % 2), 1 + i % 2, 16, 16 + 8 * (i % 2));
    spec.dtype = i == 2 ? DType::kBF16 : DType::kF32;
    spec.sinks = i % 2 == 1;
    spec.segments = i == 3;
    Problem p{RandomInputs(rng, spec), {}, {}, spec.dtype, {}};
    p.opt.mask = i == 0 ? Mask::Full() : i == 1 ? Mask::Causal() : Mask::Local(20, 4);
    p.opt.block_sizes = {16, 32};
    p.opt.num_threads = 2;
    p.dout = RandomTensor(rng, DType::kF32, {spec.b, spec.sq, spec.h, spec.dv});
    p.alone = RunSingle(p.in, p.opt, p.dout, p.out_dtype);
    problems.push_back(std::move(p));
  }
  std::vector<std::vector<Outputs>> together(problems.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < problems.size(); ++i) {
    threads.emplace_back([&problems, &together, i] {
      const Problem& p = problems[i];
      for (int repeat = 0; repeat < 2; ++repeat) {
        together[i].push_back(RunSingle(p.in, p.opt, p.dout, p.out_dtype));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < problems.size(); ++i) {
    for (size_t r = 0; r < together[i].size(); ++r) {
      ExpectBitwiseEqual(problems[i].alone, together[i][r],
                         "problem " + std::to_string(i) + ", concurrent run " + std::to_string(r));
    }
  }
}

// Two threads-backend rings (each RingAttentionThreads call makes its own
// communicators) of different sizes and layouts on different problems, at
// once and beside a single-device call, against each run alone.
TEST(Concurrency, RingsOnDifferentCommunicators) {
  ProblemSpec spec(1, 48, 48, 4, 2, 16, 16);
  spec.sinks = true;
  spec.segments = true;
  Rng rng(5);
  const OwnedInputs a = RandomInputs(rng, spec);
  const OwnedInputs b = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kF32, {spec.b, spec.sq, spec.h, spec.dv});
  const Mask mask = Mask::Causal();
  AttentionOptions single;
  single.mask = mask;
  single.num_threads = 2;
  const Outputs a_alone = RunRing(a, mask, 2, Layout::kZigzag, 1, dout);
  const Outputs b_alone = RunRing(b, mask, 3, Layout::kStriped, 2, dout);
  const Outputs s_alone = RunSingle(a, single, dout, DType::kF32);
  Outputs a_together, b_together, s_together;
  std::thread ta([&] { a_together = RunRing(a, mask, 2, Layout::kZigzag, 1, dout); });
  std::thread tb([&] { b_together = RunRing(b, mask, 3, Layout::kStriped, 2, dout); });
  s_together = RunSingle(a, single, dout, DType::kF32);
  ta.join();
  tb.join();
  ExpectBitwiseEqual(a_alone, a_together, "ring of 2, concurrent");
  ExpectBitwiseEqual(b_alone, b_together, "ring of 3, concurrent");
  ExpectBitwiseEqual(s_alone, s_together, "single device beside the rings");
}

}  // namespace
}  // namespace ringsplash::testing

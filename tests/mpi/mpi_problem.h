// A ring problem every MPI rank builds identically from a seed (the global
// inputs), its shard for one rank, and helpers to run the ring on that shard.
// Used by mpi_ring_test.cc and mpi_fault_driver.cc.
#ifndef RINGSPLASH_TESTS_MPI_MPI_PROBLEM_H_
#define RINGSPLASH_TESTS_MPI_MPI_PROBLEM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "tests/support/test_util.h"

namespace ringsplash::mpi_testing {

// The test binary's MPI communicator over MPI_COMM_WORLD, made on first use
// (collective: every rank's first call), with a timeout generous enough for
// oversubscribed and sanitizer runs.
inline Communicator& WorldComm() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions opt;
    opt.timeout_s = 120;
    return MakeMpiCommunicator(opt);
  }();
  return *comm;
}

struct Problem {
  testing::ProblemSpec spec;
  bool segments = false;  // shared documents crossing shard boundaries
  uint64_t seed = 1;
};

// Segment ids [B, S] with document boundaries at 13/48, 29/48, 37/48 of S.
inline Tensor DocumentSegments(int64_t b, int64_t s) {
  Tensor t(DType::kI32, {b, s});
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < s; ++i) {
      const int64_t x = i * 48 / s;
      t.data_as<int32_t>()[bi * s + i] = (x >= 13) + (x >= 29) + (x >= 37);
    }
  }
  return t;
}

// Global inputs and upstream gradient: the same on every rank (same seed,
// same generator).
struct Global {
  testing::OwnedInputs in;
  Tensor dout;
};

inline Global MakeGlobal(const Problem& p) {
  testing::Rng rng(p.seed);
  Global g;
  g.in = testing::RandomInputs(rng, p.spec);
  if (p.segments) {
    g.in.q_seg = DocumentSegments(p.spec.b, p.spec.sq);
    g.in.kv_seg = DocumentSegments(p.spec.b, p.spec.skv);
  }
  g.dout = testing::RandomTensor(rng, DType::kF32, {p.spec.b, p.spec.sq, p.spec.h, p.spec.dv});
  return g;
}

// The rank's shard of a [B, S, ...] tensor along dim 1.
inline Tensor ShardOf(Layout layout, int rank, int n, const Tensor& global) {
  std::vector<int64_t> shape = global.shape();
  shape[1] /= n;
  Tensor local(global.dtype(), shape);
  ShardSequence(layout, rank, n, global.view(), local.view());
  return local;
}

// Shard of an lse-shaped [B, H, S] tensor along dim 2.
inline Tensor ShardOfLse(Layout layout, int rank, int n, const Tensor& global) {
  const std::vector<int64_t>& s = global.shape();
  Tensor local(DType::kF32, {s[0], s[1], s[2] / n});
  ShardSequence(layout, rank, n, global.view().Transposed(1, 2), local.view().Transposed(1, 2));
  return local;
}

// This rank's inputs and outputs of one ring run.
struct Local {
  Tensor q, k, v, q_seg, kv_seg, dout;
  Tensor out, lse, dq, dk, dv, dsinks;
  AttentionInputs inputs;  // views into the tensors above (+ global sinks)
};

inline Local MakeLocal(const Problem& p, const Global& g, Layout layout, int rank, int n) {
  Local l;
  l.q = ShardOf(layout, rank, n, g.in.q);
  l.k = ShardOf(layout, rank, n, g.in.k);
  l.v = ShardOf(layout, rank, n, g.in.v);
  l.dout = ShardOf(layout, rank, n, g.dout);
  l.inputs.q = l.q.view();
  l.inputs.k = l.k.view();
  l.inputs.v = l.v.view();
  if (p.segments) {
    l.q_seg = ShardOf(layout, rank, n, g.in.q_seg);
    l.kv_seg = ShardOf(layout, rank, n, g.in.kv_seg);
    l.inputs.q_segments = l.q_seg.view();
    l.inputs.kv_segments = l.kv_seg.view();
  }
  if (p.spec.sinks) l.inputs.sinks = g.in.sinks.view();
  const auto& s = p.spec;
  l.out = Tensor(DType::kF32, {s.b, s.sq / n, s.h, s.dv});
  l.lse = Tensor(DType::kF32, {s.b, s.h, s.sq / n});
  l.dq = Tensor(DType::kF32, {s.b, s.sq / n, s.h, s.d});
  l.dk = Tensor(DType::kF32, {s.b, s.skv / n, s.hkv, s.d});
  l.dv = Tensor(DType::kF32, {s.b, s.skv / n, s.hkv, s.dv});
  l.dsinks = Tensor(DType::kF32, {s.h});
  return l;
}

inline void RunRingOnRank(Communicator& comm, const Problem& p, const RingOptions& options,
                          Local& l, bool backward, RankStats* stats = nullptr) {
  RingAttentionForward(comm, l.inputs, options, l.out.view(), l.lse.view(), stats);
  if (!backward) return;
  RingAttentionBackward(comm, l.inputs, options, l.out.view(), l.lse.view(), l.dout.view(),
                        l.dq.view(), l.dk.view(), l.dv.view(),
                        p.spec.sinks ? l.dsinks.view() : TensorView{}, stats);
}

}  // namespace ringsplash::mpi_testing

#endif  // RINGSPLASH_TESTS_MPI_MPI_PROBLEM_H_

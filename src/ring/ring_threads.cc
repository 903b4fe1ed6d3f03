// RingAttentionThreads: the whole ring in one process — shard global tensors
// per layout, run every rank as a thread (threads communicator), gather the
// results back into the caller's global tensors.
#include <functional>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/validate.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

namespace {

// A C-order tensor of `global`'s dtype and shape, except `rows` in dim 1.
Tensor LocalLike(const TensorView& global, int64_t rows) {
  std::vector<int64_t> shape(global.shape.begin(), global.shape.begin() + global.ndim);
  shape[1] = rows;
  return Tensor(global.dtype, shape);
}

// The rank's shard of `global` along dim 1 (undefined stays undefined).
Tensor Shard(Layout layout, int rank, int n, const TensorView& global) {
  if (!global.defined()) return Tensor();
  Tensor local = LocalLike(global, global.shape[1] / n);
  ShardSequence(layout, rank, n, global, local.view());
  return local;
}

TensorView ViewOrEmpty(const Tensor& t) { return t.data() ? t.view() : TensorView{}; }

}  // namespace

namespace ring_internal {

kernels::AttentionDims CheckGlobalRun(const AttentionInputs& global,
                                      const AttentionOptions& attention, Layout layout,
                                      int num_ranks, TensorView out, TensorView lse,
                                      TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                                      TensorView dsinks) {
  const kernels::AttentionDims dims = kernels::ValidateInputsAndOptions(global, attention);
  kernels::ValidateForwardOutputs(dims, global, out, lse);
  if (dout.defined()) {
    kernels::ValidateBackwardArgs(dims, global, out, lse, dout, dq, dk, dv, dsinks);
    // One call runs both passes: the forward writes out and lse (some ranks
    // while others still read their dout shard).
    kernels::CheckNoAliasing({{"out", out}, {"lse", lse}}, {{"dout", dout}});
  }
  LayoutPositions(layout, dims.sq, 0, num_ranks, "q sequence length");
  LayoutPositions(layout, dims.skv, 0, num_ranks, "kv sequence length");
  return dims;
}

void RunShardedThreads(
    int num_ranks, const CommOptions& comm_options, Layout layout,
    const kernels::AttentionDims& dims, const AttentionInputs& global, TensorView out,
    TensorView lse, TensorView dout, TensorView dq, TensorView dk, TensorView dv, TensorView dsinks,
    const std::function<void(Communicator& comm, const RankShards& shards)>& passes) {
  const int n = num_ranks;
  const bool backward = dout.defined();
  RunThreadRanks(n, comm_options, [&](Communicator& comm) {
    const int r = comm.rank();
    const Tensor q = Shard(layout, r, n, global.q);
    const Tensor k = Shard(layout, r, n, global.k);
    const Tensor v = Shard(layout, r, n, global.v);
    const Tensor q_seg = Shard(layout, r, n, global.q_segments);
    const Tensor kv_seg = Shard(layout, r, n, global.kv_segments);
    RankShards x;
    x.local.q = q.view();
    x.local.k = k.view();
    x.local.v = v.view();
    x.local.sinks = global.sinks;
    x.local.q_segments = ViewOrEmpty(q_seg);
    x.local.kv_segments = ViewOrEmpty(kv_seg);

    Tensor out_l = LocalLike(out, dims.sq / n);
    Tensor lse_l(DType::kF32, {dims.b, dims.h, dims.sq / n});
    x.out = out_l.view();
    x.lse = lse_l.view();
    Tensor dout_l, dq_l, dk_l, dv_l, dsinks_scratch;
    if (backward) {
      dout_l = Shard(layout, r, n, dout);
      dq_l = LocalLike(dq, dims.sq / n);
      dk_l = LocalLike(dk, dims.skv / n);
      dv_l = LocalLike(dv, dims.skv / n);
      x.dout = dout_l.view();
      x.dq = dq_l.view();
      x.dk = dk_l.view();
      x.dv = dv_l.view();
      x.dsinks = dsinks;
      if (dsinks.defined() && r != 0) {
        dsinks_scratch = Tensor(DType::kF32, {dims.h});
        x.dsinks = dsinks_scratch.view();
      }
    }
    passes(comm, x);
    GatherSequence(layout, r, n, x.out, out, 1);
    GatherSequence(layout, r, n, x.lse, lse, 2);
    if (!backward) return;
    GatherSequence(layout, r, n, x.dq, dq, 1);
    GatherSequence(layout, r, n, x.dk, dk, 1);
    GatherSequence(layout, r, n, x.dv, dv, 1);
  });
}

}  // namespace ring_internal

std::vector<RankStats> RingAttentionThreads(const RingRun& run, const AttentionInputs& global,
                                            TensorView out, TensorView lse, TensorView dout,
                                            TensorView dq, TensorView dk, TensorView dv,
                                            TensorView dsinks) {
  const int n = run.num_ranks;
  Check(n >= 1, "RingRun::num_ranks must be >= 1, got ", n);
  Check(global.q_positions.empty() && global.kv_positions.empty(),
        "ring: q_positions and kv_positions must be empty (the ring derives global positions "
        "from the layout)");
  const Layout layout = run.options.layout;
  const kernels::AttentionDims dims = ring_internal::CheckGlobalRun(
      global, run.options.attention, layout, n, out, lse, dout, dq, dk, dv, dsinks);
  std::vector<RankStats> stats(static_cast<size_t>(n));
  ring_internal::RunShardedThreads(
      n, run.comm, layout, dims, global, out, lse, dout, dq, dk, dv, dsinks,
      [&](Communicator& comm, const ring_internal::RankShards& x) {
        RankStats& st = stats[static_cast<size_t>(comm.rank())];
        RingAttentionForward(comm, x.local, run.options, x.out, x.lse, &st);
        if (!x.dout.defined()) return;
        RingAttentionBackward(comm, x.local, run.options, x.out, x.lse, x.dout, x.dq, x.dk, x.dv,
                              x.dsinks, &st);
      });
  return stats;
}

}  // namespace ringsplash

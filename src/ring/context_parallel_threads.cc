// ContextParallelThreads: the whole 2-D grid in one process — shard global
// tensors per layout over N thread ranks, run the 2-D forward/backward on
// each (one ContextParallelGroups per rank, made once for both passes),
// gather the results into the caller's global tensors.
#include <vector>

#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/validate.h"
#include "src/ring/ulysses_internal.h"

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

TensorView ViewOrEmpty(const Tensor& t) { return t.data() != nullptr ? t.view() : TensorView{}; }

}  // namespace

std::vector<ContextParallelStats> ContextParallelThreads(
    const ContextParallelRun& run, const AttentionInputs& global, TensorView out, TensorView lse,
    TensorView dout, TensorView dq, TensorView dk, TensorView dv, TensorView dsinks) {
  const int n = run.num_ranks;
  const int u = run.options.ulysses;
  const Layout layout = run.options.ring.layout;
  Check(n >= 1, "ContextParallelRun::num_ranks must be >= 1, got ", n);
  Check(global.q_positions.empty() && global.kv_positions.empty(),
        "context parallel: q_positions and kv_positions must be empty (global positions follow "
        "from the layout)");
  // Everything on the global problem first, so argument errors read as such
  // rather than as "rank 0 failed: ...".
  const kernels::AttentionDims dims =
      kernels::ValidateInputsAndOptions(global, run.options.ring.attention);
  kernels::ValidateForwardOutputs(dims, global, out, lse);
  const bool backward = dout.defined();
  if (backward) {
    kernels::ValidateBackwardArgs(dims, global, out, lse, dout, dq, dk, dv, dsinks);
    // One call runs both passes: the forward writes out and lse (some ranks
    // while others still read their dout shard).
    kernels::CheckNoAliasing({{"out", out}, {"lse", lse}}, {{"dout", dout}});
  }
  LayoutPositions(layout, dims.sq, 0, n, "q sequence length");
  LayoutPositions(layout, dims.skv, 0, n, "kv sequence length");
  ContextParallelPlace(layout, 0, n, u);
  ulysses_internal::SplitHeads(dims.h, dims.hkv, u);

  std::vector<ContextParallelStats> stats(static_cast<size_t>(n));
  RunThreadRanks(n, run.comm, [&](Communicator& comm) {
    const int r = comm.rank();
    const Tensor q = Shard(layout, r, n, global.q);
    const Tensor k = Shard(layout, r, n, global.k);
    const Tensor v = Shard(layout, r, n, global.v);
    const Tensor q_seg = Shard(layout, r, n, global.q_segments);
    const Tensor kv_seg = Shard(layout, r, n, global.kv_segments);
    AttentionInputs local;
    local.q = q.view();
    local.k = k.view();
    local.v = v.view();
    local.sinks = global.sinks;
    local.q_segments = ViewOrEmpty(q_seg);
    local.kv_segments = ViewOrEmpty(kv_seg);

    ContextParallelGroups groups(comm, u, layout);
    Tensor out_l = LocalLike(out, dims.sq / n);
    Tensor lse_l(DType::kF32, {dims.b, dims.h, dims.sq / n});
    ContextParallelStats& st = stats[static_cast<size_t>(r)];
    ContextParallelForward(groups, local, run.options, out_l.view(), lse_l.view(), &st);
    GatherSequence(layout, r, n, out_l.view(), out, 1);
    GatherSequence(layout, r, n, lse_l.view(), lse, 2);
    if (!backward) return;

    const Tensor dout_l = Shard(layout, r, n, dout);
    Tensor dq_l = LocalLike(dq, dims.sq / n);
    Tensor dk_l = LocalLike(dk, dims.skv / n);
    Tensor dv_l = LocalLike(dv, dims.skv / n);
    // dsinks is global and identical on every rank: rank 0 writes the
    // caller's, the others a scratch copy.
    Tensor dsinks_scratch;
    TensorView ds = dsinks;
    if (dsinks.defined() && r != 0) {
      dsinks_scratch = Tensor(DType::kF32, {dims.h});
      ds = dsinks_scratch.view();
    }
    ContextParallelBackward(groups, local, run.options, out_l.view(), lse_l.view(), dout_l.view(),
                            dq_l.view(), dk_l.view(), dv_l.view(), ds, &st);
    GatherSequence(layout, r, n, dq_l.view(), dq, 1);
    GatherSequence(layout, r, n, dk_l.view(), dk, 1);
    GatherSequence(layout, r, n, dv_l.view(), dv, 1);
  });
  return stats;
}

}  // namespace ringsplash

// ContextParallelThreads: the whole 2-D grid in one process — shard global
// tensors per layout over N thread ranks, run the 2-D forward/backward on
// each (one ContextParallelGroups per rank, made once for both passes),
// gather the results into the caller's global tensors.
#include <vector>

#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/validate.h"
#include "src/ring/ring_internal.h"
#include "src/ring/ulysses_internal.h"

namespace ringsplash {

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
  const kernels::AttentionDims dims = ring_internal::CheckGlobalRun(
      global, run.options.ring.attention, layout, n, out, lse, dout, dq, dk, dv, dsinks);
  ContextParallelPlace(layout, 0, n, u);
  ulysses_internal::SplitHeads(dims.h, dims.hkv, u);

  std::vector<ContextParallelStats> stats(static_cast<size_t>(n));
  ring_internal::RunShardedThreads(
      n, run.comm, layout, dims, global, out, lse, dout, dq, dk, dv, dsinks,
      [&](Communicator& comm, const ring_internal::RankShards& x) {
        // The groups once per rank, for both passes.
        ContextParallelGroups groups(comm, u, layout);
        ContextParallelStats& st = stats[static_cast<size_t>(comm.rank())];
        ContextParallelForward(groups, x.local, run.options, x.out, x.lse, &st);
        if (!x.dout.defined()) return;
        ContextParallelBackward(groups, x.local, run.options, x.out, x.lse, x.dout, x.dq, x.dk,
                                x.dv, x.dsinks, &st);
      });
  return stats;
}

}  // namespace ringsplash

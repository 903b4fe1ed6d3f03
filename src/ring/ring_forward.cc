// Ring attention forward (SPEC §4) on one rank.
//
// Data flow on rank r of N, step t = 0..N-1 (src = (r - t) mod N):
//   slice[t % 2]  holds src's packed [k | v | kv_seg] (see SliceLayout)
//   StartShift(slice[t % 2] -> rank r+1, slice[(t+1) % 2] <- rank r-1)  (t < N-1)
//   FlashForward (t = 0) or FlashForwardMerge (t > 0) of local q vs that
//       slice, masks on GLOBAL positions of both, into out_acc [B, Sq, H, Dv]
//       and lse_acc [B, H, Sq] (f32): each q block's partial result is merged
//       into its rows as soon as it is done, so no second output-sized buffer
//   Wait(shift)   — the transfer ran while the kernel computed
// then ApplySinks once per row and convert into the caller's out/lse. When
// the caller's out/lse are f32 and contiguous they ARE the accumulators (no
// copy): a rank then holds its inputs, its outputs and two kv slices.
// The slice shifted at step t is the one computed at step t: it is only read
// by the kernel, so sending and computing on it at once is safe, and the
// receive goes into the other buffer, whose own send finished (Wait) at the
// end of step t-1.
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/combine.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/merge.h"
#include "src/kernels/poison.h"
#include "src/kernels/thread_pool.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

namespace {

using ring_internal::RingSetup;
using ring_internal::SecondsSince;
using ring_internal::SliceLayout;
using Clock = std::chrono::steady_clock;

// Buffers that transfers may still touch. They are owned by the caller of
// ForwardSteps so that, when a step throws, they stay alive until
// comm.Abort() has stopped every transfer into or out of them.
struct ForwardScratch {
  Tensor slices[2];
};

void ForwardSteps(Communicator& comm, const RingSetup& s, const AttentionInputs& local,
                  const TensorView& out, const TensorView& lse, ForwardScratch& scratch,
                  RankStats* stats) {
  const kernels::AttentionDims& d = s.dims;
  const int n = s.num_ranks;
  const SliceLayout layout(d, local.k.dtype, local.kv_segments.defined());
  for (Tensor& t : scratch.slices) t = ring_internal::ByteBuffer(layout.bytes);
  layout.Pack(local, scratch.slices[0].data());

  // f32 accumulators: (out, lse) over the slices seen so far; step 0 writes
  // them directly, later steps merge into them. The caller's buffers serve
  // when they already have that form (the common f32 case saves one
  // output-sized allocation per rank). They share no memory with an input
  // (validated: q is read again at every step, after step 0 wrote them).
  auto accumulator = [](const TensorView& given, std::initializer_list<int64_t> shape,
                        Tensor& own) -> float* {
    if (given.dtype == DType::kF32 && given.is_contiguous()) {
      return static_cast<float*>(given.data);
    }
    own = Tensor(DType::kF32, shape);
    return own.data_as<float>();
  };
  Tensor out_own, lse_own;
  float* out_acc = accumulator(out, {d.b, d.sq, d.h, d.dv}, out_own);
  float* lse_acc = accumulator(lse, {d.b, d.h, d.sq}, lse_own);

  // Non-finite inputs (src/kernels/poison.h): local q rows are scanned here,
  // each slice's k/v rows at its owner's Pack. The kernels see cleaned data;
  // rows [B, H, Sq] that depend on a poisoned input are marked slice by
  // slice and become NaN at the end.
  kernels::ThreadPool pool(s.num_threads);
  kernels::ForwardPoison poison(d, local.q, &pool);

  for (int t = 0; t < n; ++t) {
    const int src = ((s.rank - t) % n + n) % n;
    void* cur = scratch.slices[t % 2].data();
    void* next = scratch.slices[(t + 1) % 2].data();
    Communicator::Handle shift = -1;
    if (t < n - 1) shift = comm.StartShift(cur, next, layout.bytes);
    ring_internal::MaybeInjectFault(comm, s, t, /*backward=*/false);

    RingStepStats step;
    step.source_rank = src;
    const Clock::time_point c0 = Clock::now();
    kernels::FlashParams params = s.StepParams(layout, cur, src);
    params.q = poison.q();
    poison.AddKeys(s.Rule(layout, cur, src), layout.PoisonFlags(cur));
    if (t == 0) {
      kernels::FlashForward(params, pool, out_acc, lse_acc, &step.kernel);
    } else {
      kernels::FlashForwardMerge(params, pool, out_acc, lse_acc, &step.kernel);
    }
    step.compute_seconds = SecondsSince(c0);
    if (shift >= 0) {
      const Clock::time_point w0 = Clock::now();
      comm.Wait(shift);
      step.comm_wait_seconds = SecondsSince(w0);
    }
    if (stats != nullptr) stats->forward_steps.push_back(step);
  }
  // Sinks join each row's denominator once, after every slice was merged.
  if (!s.sinks.empty()) {
    kernels::ApplySinks(s.Rows(), out_acc, lse_acc, s.sinks.data());
  }
  poison.Fill(out_acc, lse_acc);
  // Checked: a finite out beyond an f16/bf16 range is an Error naming it.
  if (out_own.data() != nullptr) CopyConvert(out_own.view(), out, "out");
  if (lse_own.data() != nullptr) CopyConvert(lse_own.view(), lse, "lse");
}

}  // namespace

void RingAttentionForward(Communicator& comm, const AttentionInputs& local,
                          const RingOptions& options, TensorView out, TensorView lse,
                          RankStats* stats) {
  ForwardScratch scratch;  // outlives the try: see ForwardScratch
  try {
    const RingSetup s = ring_internal::PrepareRing(comm, local, options, /*backward=*/false);
    kernels::ValidateForwardOutputs(s.dims, local, out, lse);
    if (stats != nullptr) {
      stats->rank = s.rank;
      stats->forward_steps.clear();
    }
    ForwardSteps(comm, s, local, out, lse, scratch, stats);
  } catch (const ring_internal::RanksDisagree&) {
    throw;  // every rank threw it after the same collective: nothing to abort
  } catch (const std::exception& e) {
    // Peers must not wait for a rank that gave up (no-op if a peer failed
    // first or the fault injection already aborted).
    comm.Abort(FailureReason(e));
    throw;
  }
}

}  // namespace ringsplash

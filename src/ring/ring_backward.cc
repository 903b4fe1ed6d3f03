// Ring attention backward (SPEC §4) on one rank.
//
// The same ring as the forward: the packed [k | v | kv_seg] slice of
// src = (r - t) mod N is here at step t and is shifted on (before the kernel
// runs, as in the forward). dq accumulates locally. The f32 dk/dv
// accumulators of a slice must collect one contribution from EVERY rank and
// end up at the slice's owner, so they travel with the slice — but one step
// behind it, so that their transfer also hides behind a step of compute:
//
//   step t on rank r:
//     StartShift(kv slice)                         (t < N-1)
//     FlashBackward into part (dk/dv of src from r's queries; t = 0 writes
//       straight into the accumulator of r's own slice)
//     t > 0: Wait(acc shift t-1) -> acc_in = accumulator of src (it left
//       rank r-1 after r-1's step t-1, which processed src = (r-1)-(t-1));
//       acc_in += part
//     StartShift(acc_in -> r+1, acc_other <- r-1)  (acc shift t)
//     Wait(kv shift)
//   after step N-1: Wait(acc shift N-1). The accumulator received then left
//   rank r-1 after its last step, which processed slice (r-1)-(N-1) = r mod N:
//   rank r's own slice, now summed over all N ranks' queries.
//
// Every rank posts the same sequence of shifts (kv 0, acc 0, kv 1, acc 1, ...),
// so the k-th send of each rank meets the k-th receive of its successor.
// dsinks needs no travelling: each rank sums its own rows from (out, dout,
// lse) once, then one all-reduce.
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/combine.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/poison.h"
#include "src/kernels/thread_pool.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

namespace {

using ring_internal::RingSetup;
using ring_internal::SecondsSince;
using ring_internal::SliceLayout;
using Clock = std::chrono::steady_clock;

// Buffers transfers may still touch; owned by the caller of BackwardSteps so
// that they outlive comm.Abort() when a step throws.
struct BackwardScratch {
  Tensor slices[2];  // packed k/v/kv_seg, as in the forward
  Tensor accs[2];    // f32 [dk (B, Skv, Hkv, D) | dv (B, Skv, Hkv, Dv)]
};

void BackwardSteps(Communicator& comm, const RingSetup& s, const AttentionInputs& local,
                   const TensorView& out, const TensorView& lse, const TensorView& dout,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                   const TensorView& dsinks, BackwardScratch& scratch, RankStats* stats) {
  const kernels::AttentionDims& d = s.dims;
  const int n = s.num_ranks;
  const SliceLayout layout(d, local.k.dtype, local.kv_segments.defined());
  for (Tensor& t : scratch.slices) t = ring_internal::ByteBuffer(layout.bytes);
  layout.Pack(local, scratch.slices[0].data());
  const int64_t dk_elems = d.b * d.skv * d.hkv * d.d;
  const int64_t dv_elems = d.b * d.skv * d.hkv * d.dv;
  const size_t acc_bytes = static_cast<size_t>(dk_elems + dv_elems) * sizeof(float);
  for (Tensor& t : scratch.accs) t = Tensor(DType::kF32, {dk_elems + dv_elems});
  Tensor part(DType::kF32, {dk_elems + dv_elems});

  // Non-finite inputs (src/kernels/poison.h). This rank's poisoned query
  // rows follow from the out and lse the forward wrote (NaN rows) and dout;
  // they mark the dk/dv rows of each slice they allow with NaN in the
  // travelling accumulator, which carries the poison home. k/v rows come
  // cleaned in the slice.
  kernels::ThreadPool pool(s.num_threads);
  const kernels::BackwardPoison poison(d, local.q, out, lse, dout, &pool);

  // delta [B, H, Sq] = rowsum(dout * out) from the caller's out (as the
  // single-device backward does); lse as contiguous f32, both neutralised
  // on poisoned rows (BackwardPoison::Sanitize).
  std::vector<float> delta(static_cast<size_t>(d.b * d.h * d.sq));
  kernels::ComputeDelta(poison.dout(), out, delta.data());
  Tensor lse32(DType::kF32, {d.b, d.h, d.sq});
  CopyConvert(lse, lse32.view());
  poison.Sanitize(lse32.data_as<float>(), delta.data());
  Tensor dq_acc(DType::kF32, {d.b, d.sq, d.h, d.d});

  int acc_in = 0;  // index of the accumulator for the slice processed now
  Communicator::Handle acc_shift = -1;
  for (int t = 0; t < n; ++t) {
    const int src = ((s.rank - t) % n + n) % n;
    void* cur = scratch.slices[t % 2].data();
    Communicator::Handle kv_shift = -1;
    if (t < n - 1)
      kv_shift = comm.StartShift(cur, scratch.slices[(t + 1) % 2].data(), layout.bytes);
    ring_internal::MaybeInjectFault(comm, s, t, /*backward=*/true);

    RingStepStats step;
    step.source_rank = src;
    Clock::time_point c0 = Clock::now();
    // The step's dK/dV are written whole (add_dkv = false: no zeroing)
    // into the accumulator that starts at this rank, or into `part` to be
    // added to the one that arrives; dQ adds up step after step.
    float* target = t == 0 ? scratch.accs[acc_in].data_as<float>() : part.data_as<float>();
    kernels::FlashParams params = s.StepParams(layout, cur, src);
    params.q = poison.q();
    kernels::FlashBackward(params, pool, poison.dout(), lse32.data_as<float>(), delta.data(),
                           dq_acc.data_as<float>(), target, target + dk_elems,
                           kernels::GradientSums{.add_dq = t > 0, .add_dkv = false}, &step.kernel);
    poison.FillKeys(s.Rule(layout, cur, src), target, target + dk_elems);
    step.compute_seconds = SecondsSince(c0);
    if (t > 0) {
      const Clock::time_point w0 = Clock::now();
      comm.Wait(acc_shift);
      step.comm_wait_seconds += SecondsSince(w0);
      c0 = Clock::now();
      float* acc = scratch.accs[acc_in].data_as<float>();
      const float* p = part.data_as<float>();
      for (int64_t i = 0; i < dk_elems + dv_elems; ++i) acc[i] += p[i];
      step.compute_seconds += SecondsSince(c0);
    }
    acc_shift =
        comm.StartShift(scratch.accs[acc_in].data(), scratch.accs[1 - acc_in].data(), acc_bytes);
    acc_in = 1 - acc_in;
    const Clock::time_point w0 = Clock::now();
    if (kv_shift >= 0) comm.Wait(kv_shift);
    if (t == n - 1) comm.Wait(acc_shift);  // brings this rank's own accumulators home
    step.comm_wait_seconds += SecondsSince(w0);
    if (stats != nullptr) stats->backward_steps.push_back(step);
  }
  const float* home = scratch.accs[acc_in].data_as<float>();
  poison.FillQueries(dq_acc.data_as<float>());
  // Checked: a finite gradient beyond an f16/bf16 range is an Error naming
  // it (a peer still in the dsinks all-reduce below is woken by the Abort).
  CopyConvert(dq_acc.view(), dq, "dq");
  CopyConvert(
      TensorView::Contiguous(const_cast<float*>(home), DType::kF32, {d.b, d.skv, d.hkv, d.d}), dk,
      "dk");
  CopyConvert(TensorView::Contiguous(const_cast<float*>(home + dk_elems), DType::kF32,
                                     {d.b, d.skv, d.hkv, d.dv}),
              dv, "dv");

  if (!s.sinks.empty()) {
    // Over this rank's rows only, then summed over ranks: once per row of
    // the global sequence (not once per step).
    std::vector<float> ds(static_cast<size_t>(d.h), 0.0f);
    kernels::AccumulateDSinks(s.Rows(), s.sinks.data(), lse32.data_as<float>(), delta.data(),
                              ds.data());
    // NaN joins the all-reduce sum: dsinks[h] is NaN on every rank.
    poison.FillDSinks(ds.data());
    comm.AllReduceSum(ds.data(), ds.size());
    for (int64_t h = 0; h < d.h; ++h) StoreFromF32(dsinks, h * dsinks.stride[0], ds[h]);
  }
}

}  // namespace

void RingAttentionBackward(Communicator& comm, const AttentionInputs& local,
                           const RingOptions& options, TensorView out, TensorView lse,
                           TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                           TensorView dsinks, RankStats* stats) {
  BackwardScratch scratch;  // outlives the try: see BackwardScratch
  try {
    const RingSetup s = ring_internal::PrepareRing(comm, local, options, /*backward=*/true);
    kernels::ValidateBackwardArgs(s.dims, local, out, lse, dout, dq, dk, dv, dsinks);
    if (stats != nullptr) {
      stats->rank = s.rank;
      stats->backward_steps.clear();
    }
    BackwardSteps(comm, s, local, out, lse, dout, dq, dk, dv, dsinks, scratch, stats);
  } catch (const ring_internal::RanksDisagree&) {
    throw;  // every rank threw it after the same collective: nothing to abort
  } catch (const std::exception& e) {
    comm.Abort(FailureReason(e));
    throw;
  }
}

}  // namespace ringsplash

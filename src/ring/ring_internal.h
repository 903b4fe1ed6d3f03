// Internal pieces shared by the ring forward and backward: argument checks,
// the packed layout of a travelling key/value slice, per-step positions and
// kernel parameters, and the fault-injection hook.
#ifndef RINGSPLASH_RING_RING_INTERNAL_H_
#define RINGSPLASH_RING_RING_INTERNAL_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "src/kernels/combine.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/poison.h"
#include "src/kernels/validate.h"

namespace ringsplash::ring_internal {

// Copies src into dst elementwise: same dtype and shape, any strides, any
// dtype (i32 segment ids are copied bit-exactly, unlike CopyConvert).
void CopyElements(const TensorView& src, const TensorView& dst);

// What one travelling slice holds, packed in ONE contiguous buffer so a ring
// step is a single transfer. K/V keep their Hkv heads (never replicated):
//   k   [B, Skv, Hkv, D]   dtype of the inputs
//   v   [B, Skv, Hkv, Dv]  dtype of the inputs
//   seg [B, Skv]           i32, only with segment ids
//   poison: 1 byte "any row flagged", then [B, Skv, Hkv] bytes
//           kernels::kKeyBad | kValueBad (src/kernels/poison.h)
// Each section starts on a 64-byte boundary. k and v are packed CLEANED
// (non-finite -> 0); which rows were not finite travels in the flags.
struct SliceLayout {
  kernels::AttentionDims dims;  // local sizes (skv = rows of the slice)
  DType dtype = DType::kF32;
  bool has_segments = false;
  size_t k_offset = 0, v_offset = 0, seg_offset = 0, poison_offset = 0, bytes = 0;

  SliceLayout(const kernels::AttentionDims& d, DType dt, bool segments);
  TensorView K(void* base) const;
  TensorView V(void* base) const;
  TensorView Segments(void* base) const;  // undefined without segment ids
  // Whether any key/value row of the slice was not finite; the row flags
  // [B, Skv, Hkv] (kKeyBad | kValueBad), null when none is.
  bool AnyPoison(const void* base) const;
  const char* PoisonFlags(const void* base) const;
  // Copies this rank's own k, v (cleaned), kv segment ids and poison flags
  // into `base`.
  void Pack(const AttentionInputs& local, void* base) const;
};

// A byte buffer of `bytes`, 64-byte aligned, zero-filled.
Tensor ByteBuffer(size_t bytes);

// Everything fixed for one rank's ring call. It holds no pointer into itself
// (StepParams and Rule point the kernel parameters at q_pos and kv_pos when
// called), so a move, as PrepareRing's return may make, leaves nothing
// dangling. Copying is deleted: a setup belongs to one call, and parameters
// handed out by one setup point into it, not into any copy of it.
struct RingSetup {
  RingSetup() = default;
  RingSetup(const RingSetup&) = delete;
  RingSetup& operator=(const RingSetup&) = delete;
  RingSetup(RingSetup&&) = default;
  RingSetup& operator=(RingSetup&&) = default;

  int rank = 0;
  int num_ranks = 1;
  kernels::AttentionDims dims;  // LOCAL sizes
  int64_t sq_global = 0, skv_global = 0;
  std::vector<int64_t> q_pos;                // global positions of the local q rows
  std::vector<std::vector<int64_t>> kv_pos;  // [source rank] global positions of its kv rows
  // q side filled except q_pos (null here; StepParams sets it); k, v,
  // kv_segments and kv_pos per step.
  kernels::FlashParams params;
  std::vector<float> sinks;  // [H] contiguous copy, empty without sinks
  int num_threads = 1;
  std::optional<FaultSpec> fault;
  const RingPlan* plan = nullptr;  // options.plan, checked to fit
  bool backward = false;           // which maps StepParams takes from the plan

  // The key/value slice of `source` lives in `slice` (packed per `layout`).
  // The result points into this setup (q_pos, kv_pos) and the plan: valid
  // while they live and the setup is not moved.
  kernels::FlashParams StepParams(const SliceLayout& layout, void* slice, int source) const;
  kernels::RowShape Rows() const { return {dims.b, dims.sq, dims.h, dims.dv}; }
  // Which (local q row, row of `source`'s slice) pairs are allowed.
  kernels::PairRule Rule(const SliceLayout& layout, void* slice, int source) const;
};

// What the ring needs of a RingPlan's internals.
struct PlanAccess {
  // Throws Error naming the difference unless `plan` was made for this
  // rank's call (rank, ring size, layout, local lengths, heads, block sizes,
  // mask).
  static void CheckFits(const RingPlan& plan, const RingSetup& s, const RingOptions& options);
  // The block map of (this rank's q rows) x (source's k/v rows), built on
  // first use.
  static const mask::BlockMap* Map(const RingPlan& plan, int source, bool by_column);
};

// Thrown, identically on every rank, when the ranks of one ring call passed
// different collective arguments. Every rank detects it from the same
// all-reduced numbers after the last collective of the check, so no
// transfer is in flight and nobody waits: the ring entry points rethrow it
// without Communicator::Abort, and the communicator stays usable.
class RanksDisagree : public Error {
 public:
  using Error::Error;
};

// Collective: compares, across the ranks of `comm`, the arguments every rank
// must share — local Sq, Skv, B, H, Hkv, D, Dv, dtype, layout, mask (text and
// dense bytes), effective `scale`, soft cap, presence of segment ids and of
// sinks, the sinks values, block sizes, forward vs backward — and throws
// RanksDisagree naming the first difference ("ring: rank 1 passed q with 32
// local rows but rank 0 passed 16"). One all-reduce of 64 floats when the
// ranks agree (see agreement.cc); nothing with a single rank.
void CheckRanksAgree(Communicator& comm, const AttentionInputs& local, const RingOptions& options,
                     const kernels::AttentionDims& dims, float scale, bool backward);

// Validates the local inputs and options as the single-device entry points
// do, checks that the ranks agree (CheckRanksAgree; collective), then the
// ring's own rules (no explicit positions, lengths divisible per layout,
// dense masks covering the GLOBAL extent) and fills the setup.
RingSetup PrepareRing(Communicator& comm, const AttentionInputs& local, const RingOptions& options,
                      bool backward);

// Throws Error("injected fault at rank R step S") — after telling the peers
// through comm.Abort — when the fault spec names this rank, step and pass.
void MaybeInjectFault(Communicator& comm, const RingSetup& setup, int step, bool backward);

// The thread-ranks conveniences (RingAttentionThreads, ContextParallelThreads)
// share their plumbing: check the global problem, shard it per layout over
// N thread ranks, run each rank's passes, gather the results.
//
// CheckGlobalRun validates `global` and its outputs with `attention` the way
// the per-rank entry points would, before any rank starts (so argument
// errors read as such, not as "rank 0 failed: ..."), and that the lengths
// divide by the layout over `num_ranks`; returns the global sizes.
kernels::AttentionDims CheckGlobalRun(const AttentionInputs& global,
                                      const AttentionOptions& attention, Layout layout,
                                      int num_ranks, TensorView out, TensorView lse,
                                      TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                                      TensorView dsinks);

// One rank's shards: inputs, and the local outputs the rank's passes write
// (dout and the gradients undefined for a forward-only run; dsinks is the
// caller's on rank 0 and scratch on the others, since every rank computes
// the same global dsinks).
struct RankShards {
  AttentionInputs local;
  TensorView out, lse, dout, dq, dk, dv, dsinks;
};

// Runs `passes` on `num_ranks` thread ranks, each given its shards of the
// checked global problem, then gathers every rank's outputs into the
// caller's global tensors.
void RunShardedThreads(
    int num_ranks, const CommOptions& comm, Layout layout, const kernels::AttentionDims& dims,
    const AttentionInputs& global, TensorView out, TensorView lse, TensorView dout, TensorView dq,
    TensorView dk, TensorView dv, TensorView dsinks,
    const std::function<void(Communicator& comm, const RankShards& shards)>& passes);

// Wall-clock seconds since `start`.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ringsplash::ring_internal

#endif  // RINGSPLASH_RING_RING_INTERNAL_H_

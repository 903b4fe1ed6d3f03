// Ring attention across ranks (SPEC §4): queries stay on their rank, key/value
// slices (with their kv segment ids) travel to rank+1 each step, and each step
// runs the block-sparse kernel with masks on global positions.
#ifndef RINGSPLASH_RING_H_
#define RINGSPLASH_RING_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/tensor.h"

namespace ringsplash {

// How global positions are dealt out to ranks (same layout for q and k/v).
//   contiguous: rank r holds [r*S/N, (r+1)*S/N)
//   zigzag:     rank r holds chunks r and 2N-1-r of 2N equal chunks
//   striped:    rank r holds tokens t with t mod N == r
enum class Layout { kContiguous, kZigzag, kStriped };
const char* LayoutName(Layout layout);
Layout ParseLayout(const std::string& text);

// Global positions (increasing) of rank `rank`'s local rows for a sequence of
// `seq_len` tokens. Throws Error if seq_len does not divide (by N, or 2N for
// zigzag), naming `what` (e.g. "q sequence length").
std::vector<int64_t> LayoutPositions(Layout layout, int64_t seq_len, int rank, int num_ranks,
                                     const char* what = "sequence length");
// Copies rank `rank`'s rows of `global` (dim 1 is the sequence) into `local`.
void ShardSequence(Layout layout, int rank, int num_ranks, const TensorView& global,
                   const TensorView& local);
// Copies `local` rows back into their places of `global` (dim `seq_dim`).
void GatherSequence(Layout layout, int rank, int num_ranks, const TensorView& local,
                    const TensorView& global, int seq_dim = 1);

// Which rank fails, where — for fault-injection tests (RINGSPLASH_FAULT=R:S[:fwd|:bwd]).
// A negative rank or step (FaultSpec{}'s) injects nothing: RingOptions::fault
// = FaultSpec{} overrides RINGSPLASH_FAULT with no fault. A rank or step the
// ring does not have is an Error (a fault that silently never fires would
// mislead whoever tests failure handling).
struct FaultSpec {
  int rank = -1;
  int step = -1;
  bool backward = false;
  // Parses "R:S", "R:S:fwd" (the same) or "R:S:bwd"; throws Error on anything else.
  static FaultSpec Parse(const std::string& text);
  // From the environment variable RINGSPLASH_FAULT, if set.
  static std::optional<FaultSpec> FromEnv();
  // Throws Error, its message starting with `what` (where the spec came
  // from), if the spec names a rank or step that a ring of num_ranks does
  // not have; an inert spec (negative rank or step) always fits.
  void CheckFits(int num_ranks, const std::string& what) const;
};

class RingPlan;

struct RingOptions {
  AttentionOptions attention;  // num_threads: this rank's kernel threads (0: comm.DefaultThreads())
  Layout layout = Layout::kZigzag;
  std::optional<FaultSpec> fault;  // default: FaultSpec::FromEnv()
  // Block metadata built once for many calls (RingPlan, below); null: each
  // call builds the maps of its steps itself. Must outlive the calls.
  const RingPlan* plan = nullptr;
};

namespace ring_internal {
struct PlanAccess;
}

// The block metadata of one rank's ring — for every ring step, which tiles
// of (this rank's q rows) x (the travelling slice's k/v rows) are empty, full
// or partial, by row for the forward and by column for the backward — built
// once and then reused by every call and every step that passes it in
// RingOptions::plan (the counterpart of the seed's make_ring_attention).
// Without a plan each call builds one map per step (and the backward two),
// which for a dense mask means scanning its tiles on every call.
//
// A plan is fixed to this rank and ring size (of the communicator it is made
// with), the layout, the mask (the same Mask object or a copy of it — masks
// share their nodes — or, without Dense leaves, an equal text form), the
// LOCAL lengths of q and k/v, the number of query heads and the block sizes.
// A call whose arguments differ throws Error naming what differs. Segment
// ids are data: each call refines the plan's tiles with its own.
//
// Maps are built on first use (a forward-only user never builds the column
// maps) under a lock: one plan may serve concurrent calls (for example the
// forward of one micro-batch and the backward of another on different
// communicators of the same rank) and is not tied to one thread.
class RingPlan {
 public:
  RingPlan(const Communicator& comm, const RingOptions& options, int64_t local_sq,
           int64_t local_skv, int64_t num_heads);
  // The same without a communicator (e.g. to plan ahead of the job).
  RingPlan(int rank, int num_ranks, const RingOptions& options, int64_t local_sq, int64_t local_skv,
           int64_t num_heads);
  ~RingPlan();
  RingPlan(RingPlan&&) noexcept;
  RingPlan& operator=(RingPlan&&) noexcept;
  RingPlan(const RingPlan&) = delete;
  RingPlan& operator=(const RingPlan&) = delete;

  int rank() const;
  int num_ranks() const;
  // Block maps this plan has built so far: at most one by row and one by
  // column per source rank (2N), however many calls it served.
  int64_t metadata_builds() const;
  // Bytes its maps hold now.
  size_t memory_bytes() const;

 private:
  friend struct ring_internal::PlanAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What one ring step cost on this rank.
struct RingStepStats {
  int source_rank = 0;           // whose k/v slice was processed
  double compute_seconds = 0;    // kernel time
  double comm_wait_seconds = 0;  // time blocked in Wait (exposed communication)
  KernelStats kernel;
};
struct RankStats {
  int rank = 0;
  std::vector<RingStepStats> forward_steps;
  std::vector<RingStepStats> backward_steps;
  double compute_seconds() const;
  double comm_wait_seconds() const;
  double flops() const;
  int64_t computed_blocks() const;
  int64_t skipped_blocks() const;
};

// Per-rank entry points. `local` holds this rank's shards (dim 1 = local rows
// in layout order); q_positions/kv_positions must be empty (the ring derives
// them from the layout). Global lengths are local lengths * N. Collective:
// every rank of `comm` must call it, with the same shapes, dtype, layout,
// mask, scale, soft cap, sinks (values compared bit for bit; -inf is no
// sink, as on a single device), segment presence and block sizes — checked
// up front with one small all-reduce; a mismatch is an Error on every rank
// naming what differs (e.g. "ranks disagree on the mask (rank 0: 'causal',
// rank 1: 'full')"). out, lse and dsinks mean what attention.h says, over
// the global sequence: the ring merges its steps' partial results and adds
// the sinks once per row.
//
// Memory: as in attention.h, no output of a rank may share a byte with its
// inputs or its other outputs (an Error naming both, before anything is
// written). RingAttentionThreads checks its global tensors the same way, and
// also refuses out or lse sharing memory with dout (its forward writes them
// while other ranks may still read their dout shard).
//
// Threads: one call at a time per Communicator (two calls on one
// communicator would mix their transfers; not detected). Calls on different
// communicators may run at once on either backend — different
// RunThreadRanks, different groups of one job (Communicator::Split,
// comm_mpi.h), even two rings of one process — beside each other and beside
// single-device calls, each giving bitwise what it gives alone. Each call
// starts its own kernel threads (num_threads).
//
// Errors: a rank's argument errors are thrown before that rank writes
// anything (ranks that disagree all throw so, before any rank writes). When
// one rank fails — an argument error only it has, an injected fault, an
// f16/bf16 overflow, a timeout — every rank still waiting on it (a transfer,
// the backward's final all-reduce) throws too, naming it ("rank 1 failed:
// ..."); a rank that had already finished returns complete results. A rank
// that throws after its own checks may have written part of any of its
// outputs. RingAttentionThreads checks every argument on the global problem
// before any rank starts; after a later failure its global outputs may be
// partly written.
void RingAttentionForward(Communicator& comm, const AttentionInputs& local,
                          const RingOptions& options, TensorView out, TensorView lse,
                          RankStats* stats = nullptr);
// Backward: dq/dk/dv are this rank's shards; dsinks [H] is the global
// gradient (identical on every rank).
void RingAttentionBackward(Communicator& comm, const AttentionInputs& local,
                           const RingOptions& options, TensorView out, TensorView lse,
                           TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                           TensorView dsinks, RankStats* stats = nullptr);

// Convenience for one process: shards GLOBAL tensors over `num_ranks` thread
// ranks, runs the ring (forward, and backward when dout is defined), gathers
// the results into the global outputs. Returns per-rank stats.
struct RingRun {
  int num_ranks = 1;
  RingOptions options;
  CommOptions comm;
};
std::vector<RankStats> RingAttentionThreads(const RingRun& run, const AttentionInputs& global,
                                            TensorView out, TensorView lse, TensorView dout = {},
                                            TensorView dq = {}, TensorView dk = {},
                                            TensorView dv = {}, TensorView dsinks = {});

}  // namespace ringsplash

#endif  // RINGSPLASH_RING_H_

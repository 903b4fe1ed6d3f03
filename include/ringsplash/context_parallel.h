// 2-D context parallelism (SPEC §5; docs/CONTEXT_PARALLEL.md): Ulysses
// all-to-alls within groups of U ranks around a ring across the N/U groups —
// USP's and TransformerEngine's "a2a+p2p".
//
// The sharding a caller sees is the 1-D ring's: with N ranks and a layout,
// rank r holds exactly the rows ShardSequence(layout, r, N, ...) gives (every
// head), and gets back its rows of out, lse, dq, dk, dv (every head) and the
// global dsinks. Inside a call:
//   1. all-to-all within the rank's Ulysses group of U ranks: each rank sends
//      member m the query heads [m H/U, (m+1) H/U) (and m's kv heads, below)
//      of its rows, and receives its own heads of the U members' rows — the
//      group's 1/(N/U) of the sequence, H/U heads;
//   2. the ring (ring.h) over the N/U groups, between the ranks that hold the
//      same heads (one ring per member index, U rings side by side), N/U steps;
//   3. a second all-to-all returns out and lse to sequence sharding. The
//      backward mirrors it: q, k, v, out, dout and lse go through the first
//      all-to-all, dq, dk and dv come back through the reverse one, and
//      dsinks [H] is assembled over the group (identical on every rank).
// Results equal single-device attention over the whole sequence (to f32
// rounding) for every mask, layout, segment ids, sinks, soft cap and GQA
// ratio the rules below admit.
//
// Groups (which ranks trade heads), chosen so that a group's rows are
// exactly one rank's rows of the same layout over N/U ranks, so the ring
// over groups is the ring of ring.h with its own layout rules:
//   contiguous, zigzag: group g = ranks [g U, (g+1) U) (consecutive ranks:
//     on one machine when ranks are numbered machine by machine), member r % U;
//   striped: group g = ranks g, g + N/U, g + 2 N/U, ... (strided), member r / (N/U).
// (docs/CONTEXT_PARALLEL.md derives both.) ContextParallelPlace says
// where a rank is.
//
// Heads (U = ulysses, H query heads, Hkv kv heads):
//   - U must divide H: each rank of a group computes H/U query heads.
//   - Hkv % U == 0: each rank takes Hkv/U kv heads (those its query heads read).
//   - U % Hkv == 0 (Hkv < U; MQA is Hkv = 1): each rank takes the ONE kv head
//     its query heads read; each kv head is sent to U/Hkv ranks of the group
//     (replicated U/Hkv times on the wire of the all-to-all and in memory
//     after it — like Hkv = U; never to H heads), and its dk/dv, computed by
//     each replica for its own query heads, are summed in f32 on the way back.
//   - anything else (e.g. Hkv = 6, U = 4) is an Error naming H, Hkv and U.
// Masks are evaluated on global positions, as everywhere. A head-dependent
// mask (Mask::PerHead, a Dense [H, Sq, Skv] mask, or any composition with
// one) is restricted on each rank to the heads it computes (a copy of the
// selected dense matrices; a dense leaf shared by all heads inside a
// head-dependent mask is copied whole). A Mask::DenseRows leaf holds each
// rank's own rows (of the N-rank layout, as for the 1-D ring): the group
// gathers them for its ring's rows in one more all-to-all (this member's
// heads, local Sq x Skv bytes per head and member). Sinks go where their
// heads go.
// Segment ids are per position: after the all-to-all a rank holds those of
// the group's rows (every member sends its ids to the whole group).
//
// Memory per rank: its shards and outputs, the same amount again for the
// head-sharded copy the ring runs on, and the ring's two travelling kv slices
// of U/N of the sequence x Hkv/U heads — the 1-D ring's slice size (U/Hkv
// times that when kv heads are replicated, Hkv < U). The all-to-all buffers
// (about the shards' size, send and receive) live only around each
// all-to-all.
//
// Errors: as ring.h. Argument errors every rank sees alike (U not dividing N
// or H, the GQA rule, ranks disagreeing on U or on the ring's collective
// arguments) are thrown on every rank before anything is written or sent,
// and leave the communicators usable; a failure after that (a peer's, an
// injected fault, an f16/bf16 overflow) fails every communicator of the job
// (comm.h).
#ifndef RINGSPLASH_CONTEXT_PARALLEL_H_
#define RINGSPLASH_CONTEXT_PARALLEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"

namespace ringsplash {

struct ContextParallelOptions {
  // Attention options, the layout of the caller's shards over the N ranks,
  // and fault injection. num_threads 0: comm.DefaultThreads() of the
  // communicator the call was given (the cores this rank may use; U = 1:
  // the 1-D ring's own default).
  // fault (or RINGSPLASH_FAULT) names the rank in THAT communicator and a
  // step of the ring of N/U groups (0 .. N/U - 1); the ring's message then
  // names the rank's place in its ring ("injected fault at rank G step S").
  RingOptions ring;
  // U: ranks per Ulysses group; divides N and H. 1 is the 1-D ring
  // (RingAttentionForward/Backward on the communicator itself); N is pure
  // Ulysses (all-to-alls and no ring step).
  int ulysses = 1;
};

// Where rank `rank` of `num_ranks` sits in the 2-D grid for `layout`.
struct ContextParallelCoordinates {
  int group = 0;   // Ulysses group, 0 .. N/U - 1: also the rank in its ring
  int member = 0;  // index within the group, 0 .. U - 1: computes heads
                   // [member H/U, (member+1) H/U); the ring of member m
                   // joins the members m of all groups
};
// Throws Error unless 1 <= ulysses, ulysses divides num_ranks and
// 0 <= rank < num_ranks.
ContextParallelCoordinates ContextParallelPlace(Layout layout, int rank, int num_ranks,
                                                int ulysses);

// The two sub-communicators of the grid: made once, used by any number of
// calls (forward and backward) with this U and layout. Collective over
// `comm`: one all-reduce of 2N floats (do the ranks agree on U and the
// layout?) and two Communicator::Split (MPI: MPI_Comm_split, an all-gather
// of (color, key) and a context-id agreement over all N ranks) — cheap next
// to a ring call, but not free at scale, so a training loop makes its groups
// once. `comm` must outlive this object; its two sub-communicators die with
// it (see comm.h on destroying splits). Throws Error on every rank, before any
// Split and leaving `comm` usable, if U < 1, U does not divide comm.size(),
// or the ranks passed different U or layouts.
class ContextParallelGroups {
 public:
  ContextParallelGroups(Communicator& comm, int ulysses, Layout layout);
  ContextParallelGroups(const ContextParallelGroups&) = delete;
  ContextParallelGroups& operator=(const ContextParallelGroups&) = delete;
  ~ContextParallelGroups();

  Communicator& comm() const { return *comm_; }
  int ulysses() const { return ulysses_; }
  Layout layout() const { return layout_; }
  ContextParallelCoordinates coordinates() const { return coordinates_; }
  // The Ulysses group (rank = member) and the ring (rank = group). With
  // U = 1 there is no group communicator (null) and the ring is comm().
  Communicator* group_comm() const { return group_.get(); }
  Communicator& ring_comm() const { return ring_ ? *ring_ : *comm_; }

 private:
  Communicator* comm_;
  int ulysses_;
  Layout layout_;
  ContextParallelCoordinates coordinates_;
  std::unique_ptr<Communicator> group_;
  std::unique_ptr<Communicator> ring_;
};

// What one call cost on this rank. The forward fills the forward fields
// (and ring.forward_steps), the backward the backward ones.
struct ContextParallelStats {
  int rank = 0;  // in the communicator the call was given
  ContextParallelCoordinates coordinates;
  RankStats ring;  // the ring over the N/U groups (ring.rank is the group)
  // Both all-to-alls of the pass (inputs in, results back): seconds blocked
  // in them and bytes this rank sent to OTHER ranks (its own block is a copy).
  double forward_all_to_all_seconds = 0;
  double backward_all_to_all_seconds = 0;
  int64_t forward_all_to_all_bytes = 0;
  int64_t backward_all_to_all_bytes = 0;
};

// Per-rank entry points; `local`, out, lse, dout, dq, dk, dv and dsinks mean
// exactly what they mean for RingAttentionForward/Backward on `comm` with
// options.ring (ring.h: shards in the layout, no explicit positions,
// collective, the same arguments on every rank, the memory rule), and so do
// the results. options.ulysses and options.ring.layout must be the groups'.
void ContextParallelForward(ContextParallelGroups& groups, const AttentionInputs& local,
                            const ContextParallelOptions& options, TensorView out, TensorView lse,
                            ContextParallelStats* stats = nullptr);
void ContextParallelBackward(ContextParallelGroups& groups, const AttentionInputs& local,
                             const ContextParallelOptions& options, TensorView out, TensorView lse,
                             TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                             TensorView dsinks, ContextParallelStats* stats = nullptr);
// The same, making the groups for this one call (ContextParallelGroups'
// collectives first, every call: prefer the overloads above when calling
// more than once).
void ContextParallelForward(Communicator& comm, const AttentionInputs& local,
                            const ContextParallelOptions& options, TensorView out, TensorView lse,
                            ContextParallelStats* stats = nullptr);
void ContextParallelBackward(Communicator& comm, const AttentionInputs& local,
                             const ContextParallelOptions& options, TensorView out, TensorView lse,
                             TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                             TensorView dsinks, ContextParallelStats* stats = nullptr);

// Convenience for one process, as RingAttentionThreads: shards GLOBAL
// tensors over `num_ranks` thread ranks (options.ring.layout), runs the 2-D
// forward (and backward when dout is defined) with one ContextParallelGroups
// per rank, gathers the results. Every argument is checked on the global
// problem first (the U rules included). Returns per-rank stats.
struct ContextParallelRun {
  int num_ranks = 1;
  ContextParallelOptions options;
  CommOptions comm;
};
std::vector<ContextParallelStats> ContextParallelThreads(const ContextParallelRun& run,
                                                         const AttentionInputs& global,
                                                         TensorView out, TensorView lse,
                                                         TensorView dout = {}, TensorView dq = {},
                                                         TensorView dk = {}, TensorView dv = {},
                                                         TensorView dsinks = {});

}  // namespace ringsplash

#endif  // RINGSPLASH_CONTEXT_PARALLEL_H_

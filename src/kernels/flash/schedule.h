// The one place that chooses how a call is scheduled, from its shapes alone
// (never from the thread count where results could depend on it): which
// schedule the forward runs, into how many parts and items it splits the
// work, and how the backward splits and orders its tasks. Every choice here
// fixes the order of the floating-point operations a result is made of, so a
// call gives bitwise the same results on any number of threads; tests pin
// the choices (tests/flash_schedule_test.cc).
//
// The forward (flash/forward.cc), in the order it asks:
//   1. stacked   UseStackedHeads: GQA/MQA with short query blocks run as one
//                head per kv group whose rows are the group's query heads
//                (decode/stacked_heads.h); the stacked problem is then
//                scheduled by 2-4 like any other.
//   2. decoding  UseDecodeStep: at most micro::kMaxDecodeShare query rows
//                per kv head on a path with a decoding step: each kv tile is
//                one micro::DecodeStepFn on K and V in place (decode/).
//   3. heads together  ForwardHeadsTogether: decoding-shaped calls take up to
//                kMaxHeadsTogether heads per work item, kv tile by kv tile.
//   4. split-K   ForwardKvSplits: with few work items, each q block's walk
//                over the kv tiles is cut into ranges merged in order.
//   otherwise    grouped: runs of q blocks of one (batch, head), kGroup
//                (flash/forward.cc) q blocks sharing each kv tile fetched.
// The backward (flash/backward.cc): BackwardHeadParts splits small calls'
// kv groups into parts; BackwardInOnePass picks one pass or two.
#ifndef RINGSPLASH_KERNELS_FLASH_SCHEDULE_H_
#define RINGSPLASH_KERNELS_FLASH_SCHEDULE_H_

#include <cstdint>

#include "src/kernels/flash/flash.h"

namespace ringsplash::kernels {

struct Geometry;  // tiling/tiles.h

// Whether the forward of p runs as a stacked problem (decode/stacked_heads.h,
// StackedHeads::Applies): more than one query head per kv head, a mask the
// same for every head, Sq at most half a q block, and not a decoding step
// that the decoding kernel takes (UseDecodeStep).
bool UseStackedHeads(const FlashParams& p);

// Whether the forward of p runs in decoding mode: Sq rows per head in one q
// block with at most micro::kMaxDecodeShare rows per kv head (Sq x group:
// one token with up to 8 query heads per kv head, up to 8 tokens of MHA),
// f32 or bf16 inputs whose K and V rows have unit inner stride, and a path
// with a decoding step (micro.h DecodeStepFn: the AVX-512 and AVX2 paths). Work items
// are then groups of heads as above (whole kv groups), each kv tile one
// decode_step on K and V in place: no tile copies, 16 keys per vector (8
// on AVX2) rather than 1 query lane of 16 per row. Such GQA calls are not stacked
// (UseStackedHeads): a kv head's rows are loaded once for all its
// query rows. With more rows per kv head the stacked tile loop is faster
// (docs/PERFORMANCE.md, decoding kernel).
bool UseDecodeStep(const FlashParams& p);

// The most query heads one forward work item takes together, tile by tile
// (fewer where that leaves too few items for the threads; which heads share
// an item changes no result):
// decoding-shaped calls (one q block of at most one vector of rows per head,
// several heads, as after stacking) walk every head's K/V rows of a kv tile
// before the next tile, so the rows of all heads — in [B, S, Hkv, D] one
// contiguous span per token — are read in one sweep. One head at a time
// would read 512 of every 16 KiB (MHA, H = 32, D = 128) across the whole
// cache, at well below the memory bandwidth of one sweep (docs/perf/DESIGN_MEASUREMENTS.md:
// heads together). 1 (one head per item) otherwise. At
// most kMaxHeadsTogether, which bounds the per-thread state (a Q^T tile and
// an accumulator per head); in decoding mode (UseDecodeStep) items are
// rounded up to whole kv groups and may hold more (state sized at run time). A function of the
// shapes only: ForwardKvSplits counts items with it.
inline constexpr int64_t kMaxHeadsTogether = 32;
int64_t ForwardHeadsTogether(const Geometry& g);

// Into how many ranges of kv tiles FlashForward splits each q block's walk,
// each range a work item of its own that finishes into a partial (out, lse),
// merged in range order at the end (split-K, as flash-decoding does on
// GPUs): when a call has fewer than 16 (batch, head, q block) tasks —
// decoding — one per thread would leave cores idle while each walks the
// whole of K and V. At least 16 items where the tiles allow (fewer than 32),
// ranges of at least 8 tiles; decoding-shaped calls (one q block of at most
// micro::kVec rows per head) with fewer than 4 (batch, kv head) x ranges
// items take ranges down to 2 tiles until they have 4. A function of the
// shapes only, so results stay independent of the thread count. Counted in
// work items: with heads taken together (ForwardHeadsTogether), one item per
// (batch, group of heads).
int64_t ForwardKvSplits(const Geometry& g);

// Into how many parts FlashBackward splits each kv head's group of query
// heads: 1 when there are at least 16 (batch, kv head) pairs, else the
// smallest divisor of g.group that makes 16 tasks (or the whole group), as
// long as the parts' dK/dV buffers ((parts - 1) f32 copies of dK and dV) stay
// within max(64 MiB, one f32 copy of q). Depends on the shapes only, never on
// the thread count, since the order of the dK/dV sums follows it
// (flash/backward.cc).
int64_t BackwardHeadParts(const Geometry& g);

// Whether FlashBackward runs its one-pass schedule (tasks per (batch, kv
// head, head part)) for `threads` workers rather than two passes: when the
// tasks share out over the threads with at most 1.25x imbalance (two passes
// cost 1.4x the products). Both give bitwise identical results; only the
// FLOPs spent (KernelStats::flops) differ.
bool BackwardInOnePass(const Geometry& g, int threads);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_FLASH_SCHEDULE_H_

// Analytic tile classification of the structured leaves (SPEC §3), shared by
// ClassifyTile and the BlockMap builder.
//
// A tile is given by the position ranges of its rows [q_lo, q_hi] and
// columns [kv_lo, kv_hi]; the claims below hold for every integer pair in
// those intervals, so they also hold for any subset (e.g. the strided
// positions of a striped layout).
//
// Each leaf's answer is derived from a few boolean "predicate bits". Every
// bit depends on exactly one of q_lo, q_hi, kv_lo, kv_hi and is monotone in
// it. The builder relies on this: along a row of tiles whose column ranges
// are monotone, each bit flips at most once, so the tuple of bits (and hence
// the tile kind) is piecewise constant with few pieces, found by binary
// search instead of visiting every tile.
#ifndef RINGSPLASH_SRC_MASK_LEAF_CLASSIFY_H_
#define RINGSPLASH_SRC_MASK_LEAF_CLASSIFY_H_

#include <cstdint>

#include "src/mask/block_map.h"
#include "src/mask/mask_node.h"

namespace ringsplash::mask_detail {

// Predicate bits of a structured leaf for one tile. With d = kv - q ranging
// over [d_lo, d_hi] = [kv_lo - q_hi, kv_hi - q_lo] (every integer in between
// is reached by some pair of the integer intervals):
//   Causal (allowed d <= off):        bit0 d_hi <= off (full), bit1 d_lo > off (empty)
//   Local  (allowed off-L <= d <= off+R):
//          bit0 d_lo >= off-L, bit1 d_hi <= off+R   (full = bit0 & bit1)
//          bit2 d_hi <  off-L, bit3 d_lo >  off+R   (empty = bit2 | bit3)
//          (an unbounded side makes its full bit 1 and its empty bit 0)
//   Chunked (same chunk c(x) = floor(x / C), and kv <= q):
//          bit0 kv_lo > q_hi, bit1 c(q_lo) > c(kv_hi) (empty = bit0 | bit1:
//          see the proof in LeafKindFromBits)
//          bit2 kv_hi <= q_lo, bit3 c(kv_lo) >= c(q_hi) (full = bit2 & bit3)
//   Full: no bits.
inline uint32_t LeafBits(const Node& leaf, int64_t q_lo, int64_t q_hi, int64_t kv_lo,
                         int64_t kv_hi) {
  const Int128 d_lo = Int128{kv_lo} - q_hi;
  const Int128 d_hi = Int128{kv_hi} - q_lo;
  switch (leaf.kind) {
    case NodeKind::kCausal:
      return (d_hi <= leaf.offset ? 1u : 0u) | (d_lo > leaf.offset ? 2u : 0u);
    case NodeKind::kLocal: {
      const Int128 a = Int128{leaf.offset} - leaf.left;
      const Int128 c = Int128{leaf.offset} + leaf.right;
      uint32_t bits = 0;
      if (!leaf.has_left || d_lo >= a) bits |= 1u;
      if (!leaf.has_right || d_hi <= c) bits |= 2u;
      if (leaf.has_left && d_hi < a) bits |= 4u;
      if (leaf.has_right && d_lo > c) bits |= 8u;
      return bits;
    }
    case NodeKind::kChunked: {
      const int64_t c = leaf.chunk;
      const int64_t c_kv_lo = FloorDiv(kv_lo, c);
      const int64_t c_q_hi = FloorDiv(q_hi, c);
      uint32_t bits = 0;
      if (kv_lo > q_hi) bits |= 1u;
      if (FloorDiv(q_lo, c) > FloorDiv(kv_hi, c)) bits |= 2u;
      if (kv_hi <= q_lo) bits |= 4u;
      if (c_kv_lo >= c_q_hi) bits |= 8u;
      return bits;
    }
    default:
      return 0;
  }
}

// Kind of a structured leaf from its predicate bits.
//
// Chunked, why it is exact: a pair (q, kv) with kv <= q in one chunk k
// exists iff k is in [c(q_lo), c(q_hi)] and in [c(kv_lo), c(kv_hi)] and
// max(kv_lo, kC) <= min(q_hi, kC + C - 1); for any k of that intersection
// the last condition reduces to kv_lo <= q_hi. The intersection is empty iff
// c(q_lo) > c(kv_hi) or c(kv_lo) > c(q_hi); the latter implies kv_lo > q_hi,
// so empty = (kv_lo > q_hi) or (c(q_lo) > c(kv_hi)). Full: kv_hi <= q_lo
// makes every pair causal, and kv_lo <= ... <= q_hi all share one chunk iff
// c(kv_lo) == c(q_hi), i.e. >= since kv_lo <= q_hi.
inline mask::BlockKind LeafKindFromBits(NodeKind kind, uint32_t bits) {
  using mask::BlockKind;
  switch (kind) {
    case NodeKind::kFull:
      return BlockKind::kFull;
    case NodeKind::kCausal:
      return (bits & 1u) ? BlockKind::kFull : (bits & 2u) ? BlockKind::kEmpty : BlockKind::kPartial;
    case NodeKind::kLocal:
      if (bits & 12u) return BlockKind::kEmpty;
      return (bits & 3u) == 3u ? BlockKind::kFull : BlockKind::kPartial;
    case NodeKind::kChunked:
      if (bits & 3u) return BlockKind::kEmpty;
      return (bits & 12u) == 12u ? BlockKind::kFull : BlockKind::kPartial;
    default:
      return BlockKind::kPartial;
  }
}

inline mask::BlockKind CombineAnd(mask::BlockKind a, mask::BlockKind b) {
  return mask::Combine(a, b);
}
inline mask::BlockKind CombineOr(mask::BlockKind a, mask::BlockKind b) {
  using mask::BlockKind;
  if (a == BlockKind::kFull || b == BlockKind::kFull) return BlockKind::kFull;
  if (a == BlockKind::kEmpty && b == BlockKind::kEmpty) return BlockKind::kEmpty;
  return BlockKind::kPartial;
}

}  // namespace ringsplash::mask_detail

#endif  // RINGSPLASH_SRC_MASK_LEAF_CLASSIFY_H_

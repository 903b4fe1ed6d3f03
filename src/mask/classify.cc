// Per-block position ranges and range-based tile classification (SPEC §3).
#include <algorithm>

#include "ringsplash/error.h"
#include "src/mask/block_map.h"
#include "src/mask/leaf_classify.h"
#include "src/mask/mask_node.h"

namespace ringsplash::mask {
namespace {

using mask_detail::Node;
using mask_detail::NodeKind;

template <typename T>
BlockRanges RangesOf(std::span<const T> values, int64_t block) {
  Check(block > 0, "BlockRanges::Of: block size must be > 0, got ", block);
  BlockRanges r;
  r.block = block;
  const auto n = static_cast<int64_t>(values.size());
  const int64_t blocks = (n + block - 1) / block;
  r.lo.resize(static_cast<size_t>(blocks));
  r.hi.resize(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block;
    const int64_t end = std::min(n, begin + block);
    int64_t lo = values[static_cast<size_t>(begin)];
    int64_t hi = lo;
    for (int64_t i = begin + 1; i < end; ++i) {
      const int64_t v = values[static_cast<size_t>(i)];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    r.lo[static_cast<size_t>(b)] = lo;
    r.hi[static_cast<size_t>(b)] = hi;
  }
  return r;
}

// Dense leaf over the rectangle [q_lo, q_hi] x [kv_lo, kv_hi] of positions:
// exact for the rectangle, hence for any subset of it. Positions outside the
// matrix are not allowed, so a rectangle reaching outside is never full.
// Reads the granule summary (mask_node.h); only mixed squares the rectangle
// cuts are looked at element by element.
BlockKind ClassifyDenseRect(const Node& leaf, int64_t head, int64_t q_lo, int64_t q_hi,
                            int64_t kv_lo, int64_t kv_hi) {
  constexpr int64_t g = Node::kGranule;
  // Matrix rows [r0, r1] hold the rectangle's query positions; `inside`
  // when they hold every one of them and the kv range is inside too.
  int64_t r0 = std::max<int64_t>(q_lo, 0);
  int64_t r1 = std::min<int64_t>(q_hi, leaf.sq - 1);
  bool inside = q_lo >= 0 && q_hi < leaf.sq;
  if (!leaf.row_pos.empty()) {  // DenseRows: the held rows within [q_lo, q_hi]
    const auto& rows = leaf.row_pos;
    r0 = std::lower_bound(rows.begin(), rows.end(), q_lo) - rows.begin();
    r1 = (std::upper_bound(rows.begin(), rows.end(), q_hi) - rows.begin()) - 1;
    inside = r1 - r0 == q_hi - q_lo;  // every position of the range is a held row
  }
  inside = inside && kv_lo >= 0 && kv_hi < leaf.skv;
  const int64_t c0 = std::max<int64_t>(kv_lo, 0);
  const int64_t c1 = std::min<int64_t>(kv_hi, leaf.skv - 1);
  if (r0 > r1 || c0 > c1) return BlockKind::kEmpty;
  const uint8_t* m = leaf.DenseMatrix(head);
  const uint8_t* granules = leaf.DenseGranules(head);
  bool any_one = false;
  bool any_zero = !inside;
  for (int64_t gr = r0 / g; gr <= r1 / g && !(any_one && any_zero); ++gr) {
    const int64_t rr0 = std::max(r0, gr * g);
    const int64_t rr1 = std::min(r1, gr * g + g - 1);
    for (int64_t gc = c0 / g; gc <= c1 / g && !(any_one && any_zero); ++gc) {
      const uint8_t kind = granules[gr * leaf.granule_cols + gc];
      if (kind != Node::kGranuleMixed) {
        any_one |= kind == Node::kGranuleFull;
        any_zero |= kind == Node::kGranuleEmpty;
        continue;
      }
      const int64_t cc0 = std::max(c0, gc * g);
      const int64_t cc1 = std::min(c1, gc * g + g - 1);
      for (int64_t r = rr0; r <= rr1; ++r) {
        const uint8_t* row = m + r * leaf.skv;
        for (int64_t c = cc0; c <= cc1; ++c) {
          any_one |= row[c] != 0;
          any_zero |= row[c] == 0;
        }
      }
    }
  }
  if (!any_one) return BlockKind::kEmpty;
  return any_zero ? BlockKind::kPartial : BlockKind::kFull;
}

BlockKind ClassifyNode(const Node& n, int64_t head, int64_t q_lo, int64_t q_hi, int64_t kv_lo,
                       int64_t kv_hi) {
  switch (n.kind) {
    case NodeKind::kFull:
    case NodeKind::kCausal:
    case NodeKind::kLocal:
    case NodeKind::kChunked:
      return mask_detail::LeafKindFromBits(n.kind,
                                           mask_detail::LeafBits(n, q_lo, q_hi, kv_lo, kv_hi));
    case NodeKind::kDense:
      return ClassifyDenseRect(n, head, q_lo, q_hi, kv_lo, kv_hi);
    case NodeKind::kPerHead:
      return ClassifyNode(n.ForHead(head), head, q_lo, q_hi, kv_lo, kv_hi);
    case NodeKind::kAnd: {
      const BlockKind a = ClassifyNode(*n.children[0], head, q_lo, q_hi, kv_lo, kv_hi);
      if (a == BlockKind::kEmpty) return a;
      return mask_detail::CombineAnd(a,
                                     ClassifyNode(*n.children[1], head, q_lo, q_hi, kv_lo, kv_hi));
    }
    case NodeKind::kOr: {
      const BlockKind a = ClassifyNode(*n.children[0], head, q_lo, q_hi, kv_lo, kv_hi);
      if (a == BlockKind::kFull) return a;
      return mask_detail::CombineOr(a,
                                    ClassifyNode(*n.children[1], head, q_lo, q_hi, kv_lo, kv_hi));
    }
  }
  return BlockKind::kPartial;
}

}  // namespace

BlockRanges BlockRanges::Of(std::span<const int64_t> values, int64_t block) {
  return RangesOf(values, block);
}

BlockRanges BlockRanges::Of(std::span<const int32_t> values, int64_t block) {
  return RangesOf(values, block);
}

BlockKind ClassifyTile(const Mask& mask, int64_t head, int64_t q_lo, int64_t q_hi, int64_t kv_lo,
                       int64_t kv_hi) {
  const int64_t heads = mask.num_heads();
  Check(heads == 0 || (head >= 0 && head < heads), "ClassifyTile: head must be in [0, ", heads,
        ") for this head-dependent mask, got ", head);
  return ClassifyNode(mask.node(), head, q_lo, q_hi, kv_lo, kv_hi);
}

BlockKind ClassifySegments(int64_t q_lo, int64_t q_hi, int64_t kv_lo, int64_t kv_hi) {
  if (q_hi < kv_lo || kv_hi < q_lo) return BlockKind::kEmpty;
  if (q_lo == q_hi && kv_lo == kv_hi && q_lo == kv_lo) return BlockKind::kFull;
  return BlockKind::kPartial;
}

}  // namespace ringsplash::mask

// The immutable node tree behind ringsplash::Mask, and the exact integer
// arithmetic every mask evaluator shares (SPEC §3).
//
// A Mask holds a shared_ptr<const Node>; nodes never change after
// construction, so sharing subtrees between masks and threads is safe.
// Leaves: Full, Causal, Local, ChunkedCausal, Dense. Inner nodes: PerHead
// (one child per query head), And, Or (two children each).
//
// Arithmetic: offsets, window sides and positions are arbitrary int64, so
// sums such as q + offset - left are formed in 128-bit integers; results are
// exact for every int64 input (no overflow, no saturation error).
#ifndef RINGSPLASH_SRC_MASK_MASK_NODE_H_
#define RINGSPLASH_SRC_MASK_MASK_NODE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace ringsplash::mask_detail {

using Int128 = __int128;

enum class NodeKind : uint8_t {
  kFull,
  kCausal,
  kLocal,
  kChunked,
  kDense,
  kPerHead,
  kAnd,
  kOr,
};

struct Node {
  NodeKind kind = NodeKind::kFull;

  // kCausal, kLocal: allowed kv - q differences are shifted by `offset`.
  int64_t offset = 0;
  // kLocal: a side without a value is unbounded. Values are >= 0.
  bool has_left = false;
  bool has_right = false;
  int64_t left = 0;
  int64_t right = 0;
  // kChunked: chunk length, > 0.
  int64_t chunk = 0;

  // kDense: row-major [max(dense_heads, 1), sq, skv], bytes normalised to
  // 0 / 1. dense_heads == 0 means one matrix shared by every head.
  std::vector<uint8_t> values;
  int64_t dense_heads = 0;
  int64_t sq = 0;  // matrix rows
  int64_t skv = 0;
  // kDense from Mask::DenseRows: row_pos[r] is the global query position of
  // matrix row r (strictly increasing). Empty (Mask::Dense): row r is
  // position r.
  std::vector<int64_t> row_pos;
  // kDense: what each kGranule x kGranule square of positions holds,
  // row-major [max(dense_heads, 1), ceil(sq / kGranule), ceil(skv / kGranule)]:
  // kGranuleEmpty, kGranuleFull or kGranuleMixed (a square cut by the
  // matrix's edge counts only its inside). Built once with the mask, so
  // classifying a tile reads one byte per square instead of every element
  // (tiles are multiples of 16, so their edges mostly fall on squares'):
  // a mask object serves many calls and ring steps without re-scanning.
  std::vector<uint8_t> granules;
  int64_t granule_rows = 0;
  int64_t granule_cols = 0;

  // kPerHead: children[h] is the mask of query head h. kAnd / kOr: two.
  std::vector<std::shared_ptr<const Node>> children;

  // Properties of the whole subtree, computed once at construction.
  int64_t num_heads = 0;  // 0: head-independent
  bool has_dense = false;
  bool has_dense_rows = false;  // some Dense leaf holds listed rows (DenseRows)
  int64_t dense_sq = 0;         // smallest Dense extent of the subtree (0 if none)
  int64_t dense_skv = 0;

  static constexpr int64_t kGranule = 16;
  static constexpr uint8_t kGranuleEmpty = 0;
  static constexpr uint8_t kGranuleFull = 1;
  static constexpr uint8_t kGranuleMixed = 2;

  // kDense: the granule summary of query head `head`'s matrix.
  const uint8_t* DenseGranules(int64_t head) const {
    return granules.data() + (dense_heads == 0 ? 0 : head * granule_rows * granule_cols);
  }
  // kDense: the [sq, skv] matrix used by query head `head`.
  const uint8_t* DenseMatrix(int64_t head) const {
    return values.data() + (dense_heads == 0 ? 0 : head * sq * skv);
  }
  // kPerHead: the child of query head `head`; other kinds: this node.
  const Node& ForHead(int64_t head) const {
    return kind == NodeKind::kPerHead ? *children[static_cast<size_t>(head)] : *this;
  }
};

// Floor division for b > 0 (chunks are [k*b, (k+1)*b) also for negative
// positions); exact for every int64 a.
inline int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && (a < 0)) --q;
  return q;
}

// Structured leaves allow, for each query position q, one closed interval
// of kv positions [lo, hi] (possibly empty, possibly unbounded):
//   Full:    (-inf, +inf)
//   Causal:  (-inf, q + offset]
//   Local:   [q + offset - left, q + offset + right] (unset side unbounded)
//   Chunked: [floor(q / chunk) * chunk, q]
// Unbounded ends are reported as the int64 extremes (which no comparison
// against an int64 kv can cross). Returns false when no kv is allowed.
inline bool LeafInterval(const Node& leaf, int64_t q, int64_t* lo, int64_t* hi) {
  constexpr Int128 kMin = INT64_MIN;
  constexpr Int128 kMax = INT64_MAX;
  Int128 l = kMin;
  Int128 h = kMax;
  switch (leaf.kind) {
    case NodeKind::kCausal:
      h = Int128{q} + leaf.offset;
      break;
    case NodeKind::kLocal:
      if (leaf.has_left) l = Int128{q} + leaf.offset - leaf.left;
      if (leaf.has_right) h = Int128{q} + leaf.offset + leaf.right;
      break;
    case NodeKind::kChunked:
      l = Int128{FloorDiv(q, leaf.chunk)} * leaf.chunk;
      h = q;
      break;
    default:
      break;
  }
  if (l > h || l > kMax || h < kMin) return false;
  *lo = static_cast<int64_t>(l < kMin ? kMin : l);
  *hi = static_cast<int64_t>(h > kMax ? kMax : h);
  return true;
}

// True for the leaves described by LeafInterval.
inline bool IsStructuredLeaf(NodeKind kind) {
  return kind == NodeKind::kFull || kind == NodeKind::kCausal || kind == NodeKind::kLocal ||
         kind == NodeKind::kChunked;
}

// The matrix row of a Dense leaf holding global query position q, or -1
// when it holds none (outside the extent, or not among DenseRows' rows).
inline int64_t DenseRow(const Node& leaf, int64_t q) {
  if (leaf.row_pos.empty()) return q >= 0 && q < leaf.sq ? q : -1;
  const auto it = std::lower_bound(leaf.row_pos.begin(), leaf.row_pos.end(), q);
  return it != leaf.row_pos.end() && *it == q ? it - leaf.row_pos.begin() : -1;
}

// Element predicate of one Dense leaf at global positions (false where it
// holds no row, or kv is outside its extent).
inline bool DenseAllowed(const Node& leaf, int64_t head, int64_t q, int64_t kv) {
  const int64_t r = DenseRow(leaf, q);
  if (r < 0 || kv < 0 || kv >= leaf.skv) return false;
  return leaf.DenseMatrix(head)[r * leaf.skv + kv] != 0;
}

}  // namespace ringsplash::mask_detail

#endif  // RINGSPLASH_SRC_MASK_MASK_NODE_H_

// FillTileMask: the element mask of one tile, evaluated leaf by leaf.
//
// Runs once per partial tile inside the kernels, so it allocates nothing in
// steady state (thread-local scratch, grown once) and keeps its inner loops
// simple enough for the compiler to vectorise:
//  * a subtree made of structured leaves joined by `&` allows, for each
//    query row, one interval of kv positions (intersection of the leaves'
//    intervals, see LeafInterval); the row is one compare loop, or three
//    memsets when the kv positions are sorted (binary search for the ends);
//  * Dense leaves gather bytes (memcpy when the kv positions are contiguous);
//  * other `&` / `|` nodes evaluate each side and combine byte-wise.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ringsplash/error.h"
#include "src/mask/block_map.h"
#include "src/mask/mask_node.h"

namespace ringsplash::mask {
namespace {

using mask_detail::Node;
using mask_detail::NodeKind;

struct TileCtx {
  const int64_t* q;
  const int64_t* kv;
  int64_t rows;
  int64_t cols;
  int64_t head;
  bool kv_sorted;      // kv[j] <= kv[j + 1]
  bool kv_contiguous;  // kv[j] == kv[0] + j
};

// Scratch for the second operand of a binary node, one buffer per nesting
// depth (a buffer must outlive its children's evaluation).
constexpr int kMaxScratchDepth = 32;
thread_local std::vector<uint8_t> tls_scratch[kMaxScratchDepth];

bool IsIntervalNode(const Node& n, int64_t head) {
  if (mask_detail::IsStructuredLeaf(n.kind)) return true;
  if (n.kind == NodeKind::kPerHead) return IsIntervalNode(n.ForHead(head), head);
  if (n.kind == NodeKind::kAnd) {
    return IsIntervalNode(*n.children[0], head) && IsIntervalNode(*n.children[1], head);
  }
  return false;
}

// Allowed kv interval of query position q under an interval node.
bool NodeInterval(const Node& n, int64_t head, int64_t q, int64_t* lo, int64_t* hi) {
  if (n.kind == NodeKind::kPerHead) return NodeInterval(n.ForHead(head), head, q, lo, hi);
  if (n.kind == NodeKind::kAnd) {
    int64_t lo2 = 0;
    int64_t hi2 = 0;
    if (!NodeInterval(*n.children[0], head, q, lo, hi)) return false;
    if (!NodeInterval(*n.children[1], head, q, &lo2, &hi2)) return false;
    *lo = std::max(*lo, lo2);
    *hi = std::min(*hi, hi2);
    return *lo <= *hi;
  }
  return mask_detail::LeafInterval(n, q, lo, hi);
}

void FillRowInterval(const TileCtx& t, int64_t lo, int64_t hi, uint8_t* o) {
  if (t.kv_sorted) {
    const int64_t* begin = t.kv;
    const int64_t* end = t.kv + t.cols;
    const int64_t a = std::lower_bound(begin, end, lo) - begin;
    const int64_t b = std::upper_bound(begin + a, end, hi) - begin;
    std::memset(o, 0, static_cast<size_t>(a));
    std::memset(o + a, 1, static_cast<size_t>(b - a));
    std::memset(o + b, 0, static_cast<size_t>(t.cols - b));
    return;
  }
  const int64_t* kv = t.kv;
  for (int64_t j = 0; j < t.cols; ++j) {
    o[j] = static_cast<uint8_t>((kv[j] >= lo) & (kv[j] <= hi));
  }
}

void FillDense(const Node& leaf, const TileCtx& t, uint8_t* out, int64_t ld) {
  const uint8_t* m = leaf.DenseMatrix(t.head);
  const auto skv = static_cast<uint64_t>(leaf.skv);
  const bool kv_inside = t.cols > 0 && t.kv[0] >= 0 && t.kv[t.cols - 1] < leaf.skv;
  for (int64_t i = 0; i < t.rows; ++i) {
    uint8_t* o = out + i * ld;
    const int64_t r = DenseRow(leaf, t.q[i]);
    if (r < 0) {
      std::memset(o, 0, static_cast<size_t>(t.cols));
      continue;
    }
    const uint8_t* row = m + r * leaf.skv;
    if (t.kv_contiguous && kv_inside) {
      std::memcpy(o, row + t.kv[0], static_cast<size_t>(t.cols));
      continue;
    }
    for (int64_t j = 0; j < t.cols; ++j) {
      const int64_t kv = t.kv[j];
      o[j] = static_cast<uint64_t>(kv) < skv ? row[kv] : 0;
    }
  }
}

void Eval(const Node& n, const TileCtx& t, uint8_t* out, int64_t ld, int depth) {
  if (IsIntervalNode(n, t.head)) {
    for (int64_t i = 0; i < t.rows; ++i) {
      uint8_t* o = out + i * ld;
      int64_t lo = 0;
      int64_t hi = 0;
      if (NodeInterval(n, t.head, t.q[i], &lo, &hi)) {
        FillRowInterval(t, lo, hi, o);
      } else {
        std::memset(o, 0, static_cast<size_t>(t.cols));
      }
    }
    return;
  }
  switch (n.kind) {
    case NodeKind::kDense:
      FillDense(n, t, out, ld);
      return;
    case NodeKind::kPerHead:
      Eval(n.ForHead(t.head), t, out, ld, depth);
      return;
    case NodeKind::kAnd:
    case NodeKind::kOr: {
      Eval(*n.children[0], t, out, ld, depth);
      const auto size = static_cast<size_t>(t.rows * t.cols);
      std::vector<uint8_t> deep;  // only for trees nested beyond the scratch depth
      uint8_t* buf = nullptr;
      if (depth < kMaxScratchDepth) {
        std::vector<uint8_t>& s = tls_scratch[depth];
        if (s.size() < size) s.resize(size);
        buf = s.data();
      } else {
        deep.resize(size);
        buf = deep.data();
      }
      Eval(*n.children[1], t, buf, t.cols, depth + 1);
      const bool is_and = n.kind == NodeKind::kAnd;
      for (int64_t i = 0; i < t.rows; ++i) {
        uint8_t* o = out + i * ld;
        const uint8_t* b = buf + i * t.cols;
        if (is_and) {
          for (int64_t j = 0; j < t.cols; ++j) o[j] &= b[j];
        } else {
          for (int64_t j = 0; j < t.cols; ++j) o[j] |= b[j];
        }
      }
      return;
    }
    default:
      return;  // structured leaves are interval nodes, handled above
  }
}

}  // namespace

void FillTileMask(const Mask& mask, int64_t head, std::span<const int64_t> q_pos,
                  std::span<const int64_t> kv_pos, uint8_t* out, int64_t ld) {
  const int64_t heads = mask.num_heads();
  Check(heads == 0 || (head >= 0 && head < heads), "FillTileMask: head must be in [0, ", heads,
        ") for this head-dependent mask, got ", head);
  TileCtx t{q_pos.data(),
            kv_pos.data(),
            static_cast<int64_t>(q_pos.size()),
            static_cast<int64_t>(kv_pos.size()),
            head,
            true,
            true};
  if (t.rows == 0 || t.cols == 0) return;
  for (int64_t j = 1; j < t.cols; ++j) {
    t.kv_sorted &= t.kv[j - 1] <= t.kv[j];
    // kv[j-1] + 1 cannot overflow when kv[j-1] < kv[j].
    t.kv_contiguous &= t.kv[j - 1] < t.kv[j] && t.kv[j - 1] + 1 == t.kv[j];
  }
  Eval(mask.node(), t, out, ld, 0);
}

}  // namespace ringsplash::mask

// Mask construction, validation, element predicate and canonical text.
#include "ringsplash/mask.h"

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "ringsplash/error.h"
#include "src/mask/mask_node.h"

namespace ringsplash {

using mask_detail::Int128;
using mask_detail::Node;
using mask_detail::NodeKind;

namespace {

std::shared_ptr<const Node> FullNode() {
  static const std::shared_ptr<const Node> full = std::make_shared<const Node>();
  return full;
}

// Head count of a node combining two subtrees: a head-independent side
// adopts the other's count; two different non-zero counts cannot combine.
int64_t MergeHeads(int64_t a, int64_t b, const char* what) {
  if (a == 0) return b;
  if (b == 0 || a == b) return a;
  Fail("mask ", what, ": cannot combine masks built for ", a, " and ", b,
       " query heads (head-dependent masks must agree on the head count)");
}

void MergeDenseExtent(Node& node, const Node& child) {
  if (!child.has_dense) return;
  node.has_dense_rows = node.has_dense_rows || child.has_dense_rows;
  if (!node.has_dense) {
    node.dense_sq = child.dense_sq;
    node.dense_skv = child.dense_skv;
  } else {
    node.dense_sq = std::min(node.dense_sq, child.dense_sq);
    node.dense_skv = std::min(node.dense_skv, child.dense_skv);
  }
  node.has_dense = true;
}

std::shared_ptr<const Node> Binary(NodeKind kind, std::shared_ptr<const Node> a,
                                   std::shared_ptr<const Node> b) {
  auto node = std::make_shared<Node>();
  node->kind = kind;
  node->num_heads = MergeHeads(a->num_heads, b->num_heads, kind == NodeKind::kAnd ? "&" : "|");
  MergeDenseExtent(*node, *a);
  MergeDenseExtent(*node, *b);
  node->children = {std::move(a), std::move(b)};
  return node;
}

bool NodeAllowed(const Node& n, int64_t head, int64_t q, int64_t kv) {
  switch (n.kind) {
    case NodeKind::kFull:
    case NodeKind::kCausal:
    case NodeKind::kLocal:
    case NodeKind::kChunked: {
      int64_t lo = 0;
      int64_t hi = 0;
      return mask_detail::LeafInterval(n, q, &lo, &hi) && lo <= kv && kv <= hi;
    }
    case NodeKind::kDense:
      return mask_detail::DenseAllowed(n, head, q, kv);
    case NodeKind::kPerHead:
      return NodeAllowed(n.ForHead(head), head, q, kv);
    case NodeKind::kAnd:
      return NodeAllowed(*n.children[0], head, q, kv) && NodeAllowed(*n.children[1], head, q, kv);
    case NodeKind::kOr:
      return NodeAllowed(*n.children[0], head, q, kv) || NodeAllowed(*n.children[1], head, q, kv);
  }
  return false;
}

// `parent_binds_and`: the node is an operand of `&`, so an `|` needs
// parentheses (`&` binds tighter in the text form).
void AppendText(const Node& n, bool parent_binds_and, std::string& out) {
  switch (n.kind) {
    case NodeKind::kFull:
      out += "full";
      return;
    case NodeKind::kCausal:
      out += "causal";
      if (n.offset != 0) {
        out += ':';
        out += std::to_string(n.offset);
      }
      return;
    case NodeKind::kLocal:
      out += "local:";
      if (n.has_left) out += std::to_string(n.left);
      out += ",";
      if (n.has_right) out += std::to_string(n.right);
      if (n.offset != 0) {
        out += ',';
        out += std::to_string(n.offset);
      }
      return;
    case NodeKind::kChunked:
      out += "chunked:";
      out += std::to_string(n.chunk);
      return;
    case NodeKind::kDense:
      // Not text-expressible: a descriptive form Parse rejects.
      out += n.row_pos.empty() ? "dense[" : "dense_rows[";
      if (n.dense_heads != 0) {
        out += std::to_string(n.dense_heads);
        out += 'x';
      }
      out += std::to_string(n.sq);
      out += 'x';
      out += std::to_string(n.skv);
      out += ']';
      return;
    case NodeKind::kPerHead:
      out += "perhead(";
      for (size_t h = 0; h < n.children.size(); ++h) {
        if (h != 0) out += "; ";
        AppendText(*n.children[h], false, out);
      }
      out += ")";
      return;
    case NodeKind::kAnd:
      AppendText(*n.children[0], true, out);
      out += " & ";
      AppendText(*n.children[1], true, out);
      return;
    case NodeKind::kOr: {
      if (parent_binds_and) out += "(";
      AppendText(*n.children[0], false, out);
      out += " | ";
      AppendText(*n.children[1], false, out);
      if (parent_binds_and) out += ")";
      return;
    }
  }
}

}  // namespace

Mask::Mask() : node_(FullNode()) {}
Mask::Mask(std::shared_ptr<const Node> node) : node_(std::move(node)) {}

Mask Mask::Full() { return Mask(); }

Mask Mask::Causal(int64_t offset) {
  auto node = std::make_shared<Node>();
  node->kind = NodeKind::kCausal;
  node->offset = offset;
  return Mask(std::move(node));
}

Mask Mask::Local(std::optional<int64_t> left, std::optional<int64_t> right, int64_t offset) {
  Check(!left || *left >= 0, "Mask::Local: left window side must be >= 0 (or unset), got ",
        left.value_or(0));
  Check(!right || *right >= 0, "Mask::Local: right window side must be >= 0 (or unset), got ",
        right.value_or(0));
  auto node = std::make_shared<Node>();
  node->kind = NodeKind::kLocal;
  node->has_left = left.has_value();
  node->has_right = right.has_value();
  node->left = left.value_or(0);
  node->right = right.value_or(0);
  node->offset = offset;
  return Mask(std::move(node));
}

Mask Mask::ChunkedCausal(int64_t chunk) {
  Check(chunk > 0, "Mask::ChunkedCausal: chunk must be > 0, got ", chunk);
  auto node = std::make_shared<Node>();
  node->kind = NodeKind::kChunked;
  node->chunk = chunk;
  return Mask(std::move(node));
}

namespace {

// Fills node.granules (mask_node.h) from node.values: one pass over the matrix.
void SummariseGranules(Node& node) {
  constexpr int64_t g = Node::kGranule;
  const int64_t rows = (node.sq + g - 1) / g;
  const int64_t cols = (node.skv + g - 1) / g;
  const int64_t matrices = std::max<int64_t>(node.dense_heads, 1);
  node.granule_rows = rows;
  node.granule_cols = cols;
  // Bit 0: some element allowed, bit 1: some element not allowed.
  std::vector<uint8_t> seen(static_cast<size_t>(matrices * rows * cols), 0);
  for (int64_t m = 0; m < matrices; ++m) {
    const uint8_t* matrix = node.values.data() + m * node.sq * node.skv;
    uint8_t* out = seen.data() + m * rows * cols;
    for (int64_t r = 0; r < node.sq; ++r) {
      const uint8_t* row = matrix + r * node.skv;
      uint8_t* granule_row = out + (r / g) * cols;
      for (int64_t c = 0; c < node.skv; ++c) granule_row[c / g] |= row[c] ? 1 : 2;
    }
  }
  for (uint8_t& s : seen) {
    s = s == 1 ? Node::kGranuleFull : s == 2 ? Node::kGranuleEmpty : Node::kGranuleMixed;
  }
  node.granules = std::move(seen);
}

}  // namespace

namespace {

// The node of a Dense leaf of `sq` matrix rows, checked; `fn` names the
// factory in messages.
std::shared_ptr<Node> DenseNode(const char* fn, std::vector<uint8_t> values, int64_t heads,
                                int64_t sq, int64_t skv) {
  Check(heads >= 0, fn, ": heads must be >= 0 (0: shared by all heads), got ", heads);
  // A zero extent covers no position: any attention call using it would fail
  // later with a less direct message, so refuse it here.
  Check(sq > 0 && skv > 0, fn, ": sq and skv must be > 0, got sq=", sq, " skv=", skv);
  const Int128 expected = Int128{std::max<int64_t>(heads, 1)} * sq * skv;
  Check(expected <= INT64_MAX, fn, ": heads * sq * skv overflows int64 (heads=", heads, " sq=", sq,
        " skv=", skv, ")");
  Check(Int128{static_cast<int64_t>(values.size())} == expected, fn, ": values must hold ",
        heads == 0 ? "sq * skv" : "heads * sq * skv", " = ", static_cast<long long>(expected),
        " bytes for heads=", heads, " sq=", sq, " skv=", skv, ", got ", values.size());
  for (uint8_t& v : values) v = v != 0 ? 1 : 0;
  auto node = std::make_shared<Node>();
  node->kind = NodeKind::kDense;
  node->values = std::move(values);
  node->dense_heads = heads;
  node->sq = sq;
  node->skv = skv;
  node->num_heads = heads;
  node->has_dense = true;
  node->dense_sq = sq;
  node->dense_skv = skv;
  SummariseGranules(*node);
  return node;
}

}  // namespace

Mask Mask::Dense(std::vector<uint8_t> values, int64_t heads, int64_t sq, int64_t skv) {
  return Mask(DenseNode("Mask::Dense", std::move(values), heads, sq, skv));
}

Mask Mask::DenseRows(std::vector<uint8_t> values, int64_t heads, std::vector<int64_t> rows,
                     int64_t skv) {
  Check(!rows.empty(), "Mask::DenseRows: rows must list at least one query position");
  for (size_t r = 0; r < rows.size(); ++r) {
    Check(rows[r] >= 0 && (r == 0 || rows[r] > rows[r - 1]),
          "Mask::DenseRows: rows must be non-negative and strictly increasing, got rows[", r,
          "] = ", rows[r], r == 0 ? "" : " after ", r == 0 ? "" : std::to_string(rows[r - 1]));
  }
  // The matrix has rows.size() rows; their positions are rows' values.
  auto node = DenseNode("Mask::DenseRows", std::move(values), heads,
                        static_cast<int64_t>(rows.size()), skv);
  node->dense_sq = rows.back() + 1;
  node->row_pos = std::move(rows);
  node->has_dense_rows = true;
  return Mask(std::move(node));
}

Mask Mask::PerHead(std::vector<Mask> masks) {
  Check(!masks.empty(), "Mask::PerHead: expected one mask per query head, got none");
  const auto heads = static_cast<int64_t>(masks.size());
  auto node = std::make_shared<Node>();
  node->kind = NodeKind::kPerHead;
  node->num_heads = heads;
  for (size_t h = 0; h < masks.size(); ++h) {
    const Node& child = *masks[h].node_;
    Check(child.num_heads == 0 || child.num_heads == heads, "Mask::PerHead: mask ", h,
          " is built for ", child.num_heads, " query heads, but PerHead was given ", heads,
          " masks (a head-dependent child must have the same head count)");
    MergeDenseExtent(*node, child);
    node->children.push_back(masks[h].node_);
  }
  return Mask(std::move(node));
}

Mask operator&(const Mask& a, const Mask& b) {
  return Mask(Binary(NodeKind::kAnd, a.node_, b.node_));
}

Mask operator|(const Mask& a, const Mask& b) {
  return Mask(Binary(NodeKind::kOr, a.node_, b.node_));
}

bool Mask::Allowed(int64_t head, int64_t q_pos, int64_t kv_pos) const {
  const int64_t heads = node_->num_heads;
  Check(heads == 0 || (head >= 0 && head < heads), "Mask::Allowed: head must be in [0, ", heads,
        ") for this head-dependent mask, got ", head);
  return NodeAllowed(*node_, head, q_pos, kv_pos);
}

namespace {

// The first of `q` (sorted or not) that `n`'s Dense leaves do not all hold.
std::optional<int64_t> FirstUncovered(const Node& n, std::span<const int64_t> q) {
  if (!n.has_dense) return std::nullopt;
  if (n.kind == NodeKind::kDense) {
    for (const int64_t pos : q) {
      if (mask_detail::DenseRow(n, pos) < 0) return pos;
    }
    return std::nullopt;
  }
  for (const auto& child : n.children) {
    if (auto missing = FirstUncovered(*child, q)) return missing;
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> Mask::FirstUncoveredQuery(std::span<const int64_t> q_positions) const {
  return FirstUncovered(*node_, q_positions);
}

int64_t Mask::num_heads() const { return node_->num_heads; }
int64_t Mask::dense_sq() const { return node_->dense_sq; }
int64_t Mask::dense_skv() const { return node_->dense_skv; }
bool Mask::has_dense() const { return node_->has_dense; }
bool Mask::has_dense_rows() const { return node_->has_dense_rows; }

std::string Mask::ToString() const {
  std::string out;
  AppendText(*node_, false, out);
  return out;
}

}  // namespace ringsplash

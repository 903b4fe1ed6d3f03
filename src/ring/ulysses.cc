// The geometry and data movement of 2-D context parallelism (see
// ulysses_internal.h): groups, row order, head split, head-restricted masks,
// all-to-all block packing.
//
// Why the ring over groups is ring.h's ring with the same layout. Write
// P = N/U, S the global length, c = S/N a rank's rows.
//   contiguous: rank r holds [r c, (r+1) c). Group g = ranks gU .. gU+U-1
//     holds [gUc, (g+1)Uc) = [g S/P, (g+1) S/P): rank g of contiguous over P.
//   zigzag: rank r holds chunks r and 2N-1-r of 2N chunks of S/2N. Over P
//     ranks, rank g holds chunks g and 2P-1-g of 2P chunks of S/2P = U S/2N,
//     i.e. small chunks [gU, gU+U) and [(2P-1-g)U, (2P-g)U) = [2N-gU-U,
//     2N-gU). Ranks gU+j (j < U) hold small chunks gU+j — all of the first
//     range — and 2N-1-gU-j, all of the second: the same set. (Member j's
//     rows are the j-th sub-chunk of the first big chunk and the
//     (U-1-j)-th of the second, so the rows are reordered, not concatenated.)
//   striped: rank r holds t with t mod N == r. Group g = ranks g + jP
//     (j < U) holds t with t mod N in {g, g+P, ..., g+(U-1)P}, i.e. (as P
//     divides N) t mod P == g: rank g of striped over P. Consecutive ranks
//     instead would hold t mod N in [gU, gU+U), which is no striped set over
//     P ranks — hence the strided groups. Rows interleave: ring row i is
//     member i mod U's row i / U.
// GroupRows does not rely on these derivations: it matches positions and
// fails loudly if a group's rows were not the ring layout's.
#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "ringsplash/error.h"
#include "src/mask/mask_node.h"
#include "src/ring/ulysses_internal.h"

namespace ringsplash {

ContextParallelCoordinates ContextParallelPlace(Layout layout, int rank, int num_ranks,
                                                int ulysses) {
  Check(ulysses >= 1 && num_ranks >= 1 && num_ranks % ulysses == 0,
        "ulysses: expected U >= 1 dividing the number of ranks N = ", num_ranks,
        ", got U = ", ulysses);
  Check(rank >= 0 && rank < num_ranks, "ContextParallelPlace: rank must be in [0, ", num_ranks,
        "), got ", rank);
  const int groups = num_ranks / ulysses;
  if (layout == Layout::kStriped) return {rank % groups, rank / groups};
  return {rank / ulysses, rank % ulysses};
}

ContextParallelGroups::ContextParallelGroups(Communicator& comm, int ulysses, Layout layout)
    : comm_(&comm), ulysses_(ulysses), layout_(layout) {
  // Do the ranks agree on U and the layout (which decide the groups: ranks
  // that disagree would split into groups that never match)? Each rank's
  // values in its own slots, so the sums are exact copies (integers below
  // 2^24, one non-zero addend per slot) and every rank sees every value:
  // all throw the same message, before any Split.
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<float> all(static_cast<size_t>(2 * n), 0.0f);
  all[static_cast<size_t>(r)] = static_cast<float>(std::clamp(ulysses, -1, 1 << 24));
  all[static_cast<size_t>(n + r)] = static_cast<float>(static_cast<int>(layout));
  comm.AllReduceSum(all.data(), all.size());
  for (int i = 1; i < n; ++i) {
    Check(all[static_cast<size_t>(i)] == all[0], "ulysses: the ranks disagree on U (rank 0 passed ",
          all[0], ", rank ", i, " passed ", all[static_cast<size_t>(i)], ")");
    Check(all[static_cast<size_t>(n + i)] == all[static_cast<size_t>(n)],
          "layout: the ranks disagree on the layout (rank 0 passed '",
          LayoutName(static_cast<Layout>(all[static_cast<size_t>(n)])), "', rank ", i, " passed '",
          LayoutName(static_cast<Layout>(all[static_cast<size_t>(n + i)])), "')");
  }
  Check(layout == Layout::kContiguous || layout == Layout::kZigzag || layout == Layout::kStriped,
        "layout: ", static_cast<int>(layout),
        " is not a Layout (expected kContiguous, kZigzag or kStriped)");
  coordinates_ = ContextParallelPlace(layout, r, n, ulysses);
  if (ulysses == 1) return;  // the ring is `comm` itself
  // Splits are collective over `comm`: every rank makes both, in this order.
  group_ = comm.Split(coordinates_.group, coordinates_.member);
  ring_ = comm.Split(coordinates_.member, coordinates_.group);
  Check(group_ && group_->size() == ulysses && group_->rank() == coordinates_.member && ring_ &&
            ring_->size() == n / ulysses && ring_->rank() == coordinates_.group,
        "context parallel (internal): Split gave rank ", r, " a group or ring of the wrong shape");
}

ContextParallelGroups::~ContextParallelGroups() = default;

namespace ulysses_internal {

int RankOf(Layout layout, int group, int member, int num_ranks, int ulysses) {
  const int groups = num_ranks / ulysses;
  return layout == Layout::kStriped ? member * groups + group : group * ulysses + member;
}

std::vector<std::vector<int64_t>> GroupRows(Layout layout, int64_t seq_len, int group,
                                            int num_ranks, int ulysses, const char* what) {
  const int groups = num_ranks / ulysses;
  // (position, member, local row) of every member's rows, sorted by position.
  struct Row {
    int64_t pos;
    int member;
    int64_t local;
  };
  std::vector<Row> rows;
  std::vector<std::vector<int64_t>> result(static_cast<size_t>(ulysses));
  for (int m = 0; m < ulysses; ++m) {
    const std::vector<int64_t> pos = LayoutPositions(
        layout, seq_len, RankOf(layout, group, m, num_ranks, ulysses), num_ranks, what);
    result[static_cast<size_t>(m)].resize(pos.size());
    for (size_t l = 0; l < pos.size(); ++l) {
      rows.push_back({pos[l], m, static_cast<int64_t>(l)});
    }
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.pos < b.pos; });
  const std::vector<int64_t> ring = LayoutPositions(layout, seq_len, group, groups, what);
  Check(ring.size() == rows.size(), "context parallel (internal): group ", group, " holds ",
        rows.size(), " rows but its ring rank holds ", ring.size());
  for (size_t i = 0; i < ring.size(); ++i) {
    Check(ring[i] == rows[i].pos, "context parallel (internal): the rows of group ", group,
          " are not rank ", group, "'s rows of the ", LayoutName(layout), " layout over ", groups,
          " ranks (position ", ring[i], " vs ", rows[i].pos, ")");
    result[static_cast<size_t>(rows[i].member)][static_cast<size_t>(rows[i].local)] =
        static_cast<int64_t>(i);
  }
  return result;
}

HeadSplit SplitHeads(int64_t heads, int64_t kv_heads, int ulysses) {
  HeadSplit s;
  s.ulysses = ulysses;
  s.heads = heads;
  s.kv_heads = kv_heads;
  Check(heads % ulysses == 0, "ulysses: U = ", ulysses, " must divide the query heads H = ", heads,
        " (each rank of a Ulysses group computes H/U heads); choose U among the divisors of H");
  Check(kv_heads % ulysses == 0 || ulysses % kv_heads == 0, "ulysses: U = ", ulysses,
        " does not fit the kv heads Hkv = ", kv_heads, " (H = ", heads,
        "): expected Hkv to be a multiple of U (each rank takes Hkv/U kv heads) or a divisor of "
        "U (each kv head goes to U/Hkv ranks)");
  s.local_heads = heads / ulysses;
  if (kv_heads >= ulysses) {
    s.local_kv = kv_heads / ulysses;
  } else {
    // Each member's H/U query heads lie inside one kv group of H/Hkv heads
    // (H/U divides H/Hkv because Hkv divides U), so it needs one kv head.
    s.local_kv = 1;
    s.kv_replicas = ulysses / kv_heads;
  }
  return s;
}

namespace {

using mask_detail::Node;
using mask_detail::NodeKind;

// The subtree `n` as a Mask, restricted to heads [first, first + count)
// where it depends on the head, with `replacements` in place of their leaves.
Mask Rebuild(const Node& n, int64_t first, int64_t count,
             const std::vector<LeafReplacement>& replacements) {
  switch (n.kind) {
    case NodeKind::kFull:
      return Mask::Full();
    case NodeKind::kCausal:
      return Mask::Causal(n.offset);
    case NodeKind::kLocal:
      return Mask::Local(n.has_left ? std::optional<int64_t>(n.left) : std::nullopt,
                         n.has_right ? std::optional<int64_t>(n.right) : std::nullopt, n.offset);
    case NodeKind::kChunked:
      return Mask::ChunkedCausal(n.chunk);
    case NodeKind::kDense: {
      for (const LeafReplacement& r : replacements) {
        if (r.leaf == &n) return r.mask;
      }
      Check(n.row_pos.empty(),
            "context parallel (internal): a Mask::DenseRows leaf was not gathered for the group");
      if (n.dense_heads == 0) return Mask::Dense(n.values, 0, n.sq, n.skv);
      const auto matrix = static_cast<std::ptrdiff_t>(n.sq * n.skv);
      std::vector<uint8_t> values(n.values.begin() + first * matrix,
                                  n.values.begin() + (first + count) * matrix);
      return Mask::Dense(std::move(values), count, n.sq, n.skv);
    }
    case NodeKind::kPerHead: {
      // Child h is evaluated at head h (NodeAllowed passes the head on), so
      // a head-dependent child is restricted to the same range.
      std::vector<Mask> children;
      for (int64_t h = first; h < first + count; ++h) {
        children.push_back(
            Rebuild(*n.children[static_cast<size_t>(h)], first, count, replacements));
      }
      return Mask::PerHead(std::move(children));
    }
    case NodeKind::kAnd:
      return Rebuild(*n.children[0], first, count, replacements) &
             Rebuild(*n.children[1], first, count, replacements);
    case NodeKind::kOr:
      return Rebuild(*n.children[0], first, count, replacements) |
             Rebuild(*n.children[1], first, count, replacements);
  }
  Fail("context parallel (internal): unknown mask node kind ", static_cast<int>(n.kind));
}

void CollectDenseRows(const Node& n, std::vector<const Node*>& out) {
  if (n.kind == NodeKind::kDense && !n.row_pos.empty() &&
      std::find(out.begin(), out.end(), &n) == out.end()) {
    out.push_back(&n);
  }
  for (const auto& child : n.children) CollectDenseRows(*child, out);
}

}  // namespace

std::vector<const mask_detail::Node*> DenseRowsLeaves(const Mask& mask) {
  std::vector<const Node*> leaves;
  if (mask.has_dense()) CollectDenseRows(mask.node(), leaves);
  return leaves;
}

Mask MaskForHeads(const Mask& mask, int64_t first, int64_t count,
                  const std::vector<LeafReplacement>& replacements) {
  if (mask.num_heads() == 0 && replacements.empty()) return mask;
  Check(first >= 0 && count >= 1 && (mask.num_heads() == 0 || first + count <= mask.num_heads()),
        "context parallel (internal): heads [", first, ", ", first + count, ") outside a mask of ",
        mask.num_heads(), " heads");
  return Rebuild(mask.node(), first, count, replacements);
}

void MoveRows(const TensorView& src, const TensorView& dst, int seq_dim,
              std::span<const int64_t> src_rows, std::span<const int64_t> dst_rows) {
  Check(src.ndim == dst.ndim && src.ndim >= 1 && src.ndim <= kMaxDims && src.dtype == dst.dtype &&
            seq_dim >= 0 && seq_dim < src.ndim,
        "context parallel (internal): MoveRows of ", src, " into ", dst, " along dim ", seq_dim);
  for (int i = 0; i < src.ndim; ++i) {
    Check(i == seq_dim || src.shape[i] == dst.shape[i], "context parallel (internal): MoveRows of ",
          src, " into ", dst, ": dim ", i, " differs");
  }
  const int64_t count = !src_rows.empty()   ? static_cast<int64_t>(src_rows.size())
                        : !dst_rows.empty() ? static_cast<int64_t>(dst_rows.size())
                                            : src.shape[seq_dim];
  Check(dst_rows.empty() || static_cast<int64_t>(dst_rows.size()) == count,
        "context parallel (internal): MoveRows row maps of different lengths");
  // Padded to 4 dims (leading dims of size 1), the sequence dim mapped.
  const int pad = kMaxDims - src.ndim;
  const int sd = pad + seq_dim;
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1}, ss{}, ds{};
  for (int i = 0; i < src.ndim; ++i) {
    shape[pad + i] = src.shape[i];
    ss[pad + i] = src.stride[i];
    ds[pad + i] = dst.stride[i];
  }
  shape[sd] = count;
  auto src_row = [&](int64_t i) { return src_rows.empty() ? i : src_rows[i]; };
  auto dst_row = [&](int64_t i) { return dst_rows.empty() ? i : dst_rows[i]; };
  const auto es = static_cast<int64_t>(DTypeSize(src.dtype));
  const auto* sbase = static_cast<const char*>(src.data);
  auto* dbase = static_cast<char*>(dst.data);
  const bool inner_block = sd != 3 && ss[3] == 1 && ds[3] == 1;
  std::array<int64_t, kMaxDims> idx{};
  for (idx[0] = 0; idx[0] < shape[0]; ++idx[0]) {
    for (idx[1] = 0; idx[1] < shape[1]; ++idx[1]) {
      for (idx[2] = 0; idx[2] < shape[2]; ++idx[2]) {
        int64_t so = 0, dof = 0;
        for (int d = 0; d < 3; ++d) {
          so += (d == sd ? src_row(idx[d]) : idx[d]) * ss[d];
          dof += (d == sd ? dst_row(idx[d]) : idx[d]) * ds[d];
        }
        if (inner_block) {
          std::memcpy(dbase + dof * es, sbase + so * es, static_cast<size_t>(shape[3] * es));
          continue;
        }
        for (int64_t i3 = 0; i3 < shape[3]; ++i3) {
          const int64_t s3 = sd == 3 ? src_row(i3) : i3;
          const int64_t d3 = sd == 3 ? dst_row(i3) : i3;
          std::memcpy(dbase + (dof + d3 * ds[3]) * es, sbase + (so + s3 * ss[3]) * es,
                      static_cast<size_t>(es));
        }
      }
    }
  }
}

int BlockLayout::Add(DType dtype, std::vector<int64_t> shape) {
  int64_t elements = 1;
  for (int64_t s : shape) elements *= s;
  const size_t offset = bytes_;
  bytes_ = (offset + static_cast<size_t>(elements) * DTypeSize(dtype) + 63) / 64 * 64;
  sections_.push_back({dtype, std::move(shape), offset});
  return static_cast<int>(sections_.size()) - 1;
}

TensorView BlockLayout::View(void* base, int block, int index) const {
  const Section& s = sections_[static_cast<size_t>(index)];
  return TensorView::Contiguous(
      static_cast<char*>(base) + static_cast<size_t>(block) * bytes_ + s.offset, s.dtype, s.shape);
}

}  // namespace ulysses_internal

}  // namespace ringsplash

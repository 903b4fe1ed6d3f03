// Sequence layouts (SPEC §4): which global positions each rank holds, and the
// copies between a global tensor and a rank's shard.
#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

namespace {

constexpr Layout kAllLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};

// Copies between `local` (dim seq_dim has positions.size() rows) and the rows
// positions[i] of `global` (same dim). Both views have the same dtype and
// rank; every other dim has the same size. Any strides.
void CopyMappedRows(const TensorView& local, const TensorView& global, int seq_dim,
                    const std::vector<int64_t>& positions, bool to_global) {
  const int nd = local.ndim;
  const int pad = kMaxDims - nd;
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1}, ls{}, gs{};
  for (int i = 0; i < nd; ++i) {
    shape[pad + i] = local.shape[i];
    ls[pad + i] = local.stride[i];
    gs[pad + i] = global.stride[i];
  }
  const int sd = pad + seq_dim;
  const int64_t es = static_cast<int64_t>(DTypeSize(local.dtype));
  auto* lbase = static_cast<char*>(local.data);
  auto* gbase = static_cast<char*>(global.data);
  // The innermost dim is copied with one memcpy when it is contiguous on both
  // sides and not the sequence dim.
  const bool inner_block = sd != 3 && ls[3] == 1 && gs[3] == 1;
  std::array<int64_t, kMaxDims> idx{};
  for (idx[0] = 0; idx[0] < shape[0]; ++idx[0]) {
    for (idx[1] = 0; idx[1] < shape[1]; ++idx[1]) {
      for (idx[2] = 0; idx[2] < shape[2]; ++idx[2]) {
        int64_t lo = 0, go = 0;
        for (int d = 0; d < 3; ++d) {
          lo += idx[d] * ls[d];
          go += (d == sd ? positions[idx[d]] : idx[d]) * gs[d];
        }
        if (inner_block) {
          char* l = lbase + lo * es;
          char* g = gbase + go * es;
          const size_t n = static_cast<size_t>(shape[3] * es);
          to_global ? std::memcpy(g, l, n) : std::memcpy(l, g, n);
          continue;
        }
        for (int64_t i3 = 0; i3 < shape[3]; ++i3) {
          char* l = lbase + (lo + i3 * ls[3]) * es;
          char* g = gbase + (go + (sd == 3 ? positions[i3] : i3) * gs[3]) * es;
          to_global ? std::memcpy(g, l, es) : std::memcpy(l, g, es);
        }
      }
    }
  }
}

// Shared checks of ShardSequence/GatherSequence; returns the positions.
std::vector<int64_t> CheckShardPair(const char* fn, Layout layout, int rank, int num_ranks,
                                    const TensorView& local, const TensorView& global,
                                    int seq_dim) {
  Check(local.defined() && global.defined(), fn, ": local and global views must be defined");
  Check(local.ndim == global.ndim, fn, ": local ", local, " and global ", global,
        " must have the same number of dims");
  Check(seq_dim >= 0 && seq_dim < local.ndim, fn, ": seq_dim must be in [0, ", local.ndim,
        "), got ", seq_dim);
  Check(local.dtype == global.dtype, fn, ": local dtype ", DTypeName(local.dtype),
        " differs from global dtype ", DTypeName(global.dtype));
  for (int i = 0; i < local.ndim; ++i) {
    if (i == seq_dim) continue;
    Check(local.shape[i] == global.shape[i], fn, ": local ", local, " and global ", global,
          " differ in dim ", i);
  }
  std::vector<int64_t> positions =
      LayoutPositions(layout, global.shape[seq_dim], rank, num_ranks, "global sequence length");
  Check(local.shape[seq_dim] == static_cast<int64_t>(positions.size()), fn, ": local ", local,
        " must hold ", positions.size(), " rows in dim ", seq_dim, " (global ", global, " over ",
        num_ranks, " ranks)");
  return positions;
}

}  // namespace

namespace ring_internal {

void CopyElements(const TensorView& src, const TensorView& dst) {
  Check(src.ndim == dst.ndim && src.ndim >= 1 && src.dtype == dst.dtype, "CopyElements: ", src,
        " and ", dst, " must have the same dtype and dims");
  for (int i = 0; i < src.ndim; ++i) {
    Check(src.shape[i] == dst.shape[i], "CopyElements: shapes differ: ", src, " vs ", dst);
  }
  std::vector<int64_t> identity(static_cast<size_t>(src.shape[0]));
  for (int64_t i = 0; i < src.shape[0]; ++i) identity[i] = i;
  CopyMappedRows(dst, src, 0, identity, /*to_global=*/false);
}

}  // namespace ring_internal

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kZigzag:
      return "zigzag";
    case Layout::kStriped:
      return "striped";
  }
  return "?";
}

Layout ParseLayout(const std::string& text) {
  for (Layout l : kAllLayouts) {
    if (text == LayoutName(l)) return l;
  }
  Fail("layout: expected one of contiguous, zigzag, striped; got '", text, "'");
}

std::vector<int64_t> LayoutPositions(Layout layout, int64_t seq_len, int rank, int num_ranks,
                                     const char* what) {
  Check(num_ranks >= 1, "LayoutPositions: number of ranks must be >= 1, got ", num_ranks);
  Check(rank >= 0 && rank < num_ranks, "LayoutPositions: rank must be in [0, ", num_ranks,
        "), got ", rank);
  Check(std::find(std::begin(kAllLayouts), std::end(kAllLayouts), layout) != std::end(kAllLayouts),
        "layout: ", static_cast<int>(layout),
        " is not a Layout (expected kContiguous, kZigzag or kStriped)");
  Check(seq_len >= 0, what, " must be >= 0, got ", seq_len);
  const int64_t n = num_ranks;
  const int64_t parts = layout == Layout::kZigzag ? 2 * n : n;
  if (seq_len % parts != 0) {
    Fail(what, " ", seq_len, " does not split evenly over ", num_ranks, " ranks: the ",
         LayoutName(layout), " layout needs a multiple of ",
         layout == Layout::kZigzag ? "2N = " : "N = ", parts);
  }
  const int64_t local = seq_len / n;
  std::vector<int64_t> pos(static_cast<size_t>(local));
  switch (layout) {
    case Layout::kContiguous:
      for (int64_t i = 0; i < local; ++i) pos[i] = rank * local + i;
      break;
    case Layout::kZigzag: {
      // Chunks r and 2N-1-r of 2N: early and late tokens pair up, so causal
      // work per rank is equal.
      const int64_t chunk = seq_len / parts;
      for (int64_t i = 0; i < chunk; ++i) {
        pos[i] = rank * chunk + i;
        pos[chunk + i] = (parts - 1 - rank) * chunk + i;
      }
      break;
    }
    case Layout::kStriped:
      for (int64_t i = 0; i < local; ++i) pos[i] = rank + i * n;
      break;
  }
  return pos;
}

void ShardSequence(Layout layout, int rank, int num_ranks, const TensorView& global,
                   const TensorView& local) {
  const std::vector<int64_t> positions =
      CheckShardPair("ShardSequence", layout, rank, num_ranks, local, global, 1);
  CopyMappedRows(local, global, 1, positions, /*to_global=*/false);
}

void GatherSequence(Layout layout, int rank, int num_ranks, const TensorView& local,
                    const TensorView& global, int seq_dim) {
  const std::vector<int64_t> positions =
      CheckShardPair("GatherSequence", layout, rank, num_ranks, local, global, seq_dim);
  CopyMappedRows(local, global, seq_dim, positions, /*to_global=*/true);
}

}  // namespace ringsplash

// What the 2-D context-parallel entry points (context_parallel.cc) are built
// from: the grid's geometry (which ranks form a Ulysses group, which rows of
// the group a rank's ring runs on and in what order), the head split and its
// GQA rule, masks restricted to a head range, and the row copies that pack
// and unpack the all-to-all blocks. See include/ringsplash/context_parallel.h
// for the contract and docs/CONTEXT_PARALLEL.md for the derivations.
#ifndef RINGSPLASH_RING_ULYSSES_INTERNAL_H_
#define RINGSPLASH_RING_ULYSSES_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringsplash/context_parallel.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"

namespace ringsplash::ulysses_internal {

// The rank of (group, member) in the N-rank communicator: the inverse of
// ContextParallelPlace. contiguous/zigzag: group * U + member; striped:
// member * (N/U) + group.
int RankOf(Layout layout, int group, int member, int num_ranks, int ulysses);

// For group `group`: where each member's local rows go in the rows the
// group's ring runs on. The ring over the N/U groups runs with the SAME
// layout kind as the N-rank sharding: with the grouping of RankOf, a group's
// rows are exactly one rank's rows of that layout over N/U ranks (derived in
// ulysses.cc). result[m][l] = the index, among the positions
// LayoutPositions(layout, seq_len, group, N/U) (increasing), of the global
// position of member m's local row l (LayoutPositions(layout, seq_len,
// RankOf(group, m), N)[l]). Each result[m] has seq_len / N entries; together
// they are a permutation of 0 .. U seq_len / N - 1. Throws Error if seq_len
// does not split for the N-rank layout (naming `what`), and an internal
// Error if the members' positions were not exactly the group's ring
// positions (a broken grid: never for the three layouts).
std::vector<std::vector<int64_t>> GroupRows(Layout layout, int64_t seq_len, int group,
                                            int num_ranks, int ulysses, const char* what);

// How the heads of one call are dealt out to the U members of a group.
struct HeadSplit {
  int64_t ulysses = 1;
  int64_t heads = 1;        // H
  int64_t kv_heads = 1;     // Hkv
  int64_t local_heads = 1;  // H / U query heads per member
  int64_t local_kv = 1;     // kv heads per member: Hkv / U, or 1 when Hkv < U
  int64_t kv_replicas = 1;  // members holding each kv head: 1, or U / Hkv when Hkv < U
  int64_t FirstHead(int64_t member) const { return member * local_heads; }
  // The kv heads member m's query heads read: [FirstKvHead(m), + local_kv).
  int64_t FirstKvHead(int64_t member) const { return member * kv_heads / ulysses; }
};
// The GQA rule (context_parallel.h); throws Error naming H, Hkv and U.
HeadSplit SplitHeads(int64_t heads, int64_t kv_heads, int ulysses);

// The distinct Mask::DenseRows leaves of `mask` (Dense leaves holding only
// listed query rows: a rank's own), in depth-first order — the same order
// on every rank for masks of the same shape.
std::vector<const mask_detail::Node*> DenseRowsLeaves(const Mask& mask);

// A DenseRows leaf and the Mask that replaces it (already restricted to the
// heads of MaskForHeads' call).
struct LeafReplacement {
  const mask_detail::Node* leaf;
  Mask mask;
};

// `mask` restricted to query heads [first, first + count): head i of the
// result is head first + i of `mask`, and each leaf of `replacements` is
// replaced by its mask. A head-independent mask (num_heads() == 0) without
// replacements is returned as it is (shared, no copy); otherwise the mask is
// rebuilt with Mask's public constructors, PerHead children and Dense
// matrices of the selected heads only (shared dense leaves of the tree are
// copied: Mask offers no way to share a subtree). Every DenseRows leaf must
// be replaced (its rows are one rank's: an internal Error otherwise).
Mask MaskForHeads(const Mask& mask, int64_t first, int64_t count,
                  const std::vector<LeafReplacement>& replacements = {});

// Copies rows between two views of the same dtype and ndim (1..4) whose
// dims other than `seq_dim` have equal sizes, bit for bit (i32 ids too):
//   dst[.., dst_rows[i], ..] = src[.., src_rows[i], ..]   for i < count
// where an empty span means the identity (row i) and count is the length of
// the non-empty span(s) (both empty: src.shape[seq_dim] rows). Any strides;
// the innermost dim is one memcpy when it has unit stride on both sides and
// is not `seq_dim`.
void MoveRows(const TensorView& src, const TensorView& dst, int seq_dim,
              std::span<const int64_t> src_rows, std::span<const int64_t> dst_rows);

// The sections of one all-to-all block (the same for every destination):
// each a C-order tensor of its dtype and shape, starting on a 64-byte
// boundary, so every block — and with the buffer 64-byte aligned, every
// section — is aligned.
class BlockLayout {
 public:
  // Adds a section; returns its index.
  int Add(DType dtype, std::vector<int64_t> shape);
  size_t bytes() const { return bytes_; }
  // Section `index` of block `block` of a buffer of blocks at `base`.
  TensorView View(void* base, int block, int index) const;

 private:
  struct Section {
    DType dtype;
    std::vector<int64_t> shape;
    size_t offset;
  };
  std::vector<Section> sections_;
  size_t bytes_ = 0;
};

}  // namespace ringsplash::ulysses_internal

#endif  // RINGSPLASH_RING_ULYSSES_INTERNAL_H_

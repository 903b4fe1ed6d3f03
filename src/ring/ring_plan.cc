// RingPlan (include/ringsplash/ring.h): the block maps of one rank's ring
// steps, built on first use and kept for every later call.
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/tiling/tiles.h"
#include "src/mask/block_map.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

struct RingPlan::Impl {
  int rank = 0;
  int num_ranks = 1;
  Layout layout = Layout::kZigzag;
  Mask mask;
  int64_t sq = 0, skv = 0, heads = 0;
  BlockSizes blocks;
  int64_t bq = 0, bkv = 0;                   // the kernels' tile geometry for these lengths
  std::vector<int64_t> q_pos;                // global positions of this rank's q rows
  std::vector<std::vector<int64_t>> kv_pos;  // [source] global positions of its k/v rows

  std::mutex mu;
  // [source]: built on first use; never moved once built (the kernels hold
  // pointers to them during a call).
  std::vector<std::unique_ptr<const mask::BlockMap>> rows, cols;
  int64_t builds = 0;

  const mask::BlockMap* Map(int source, bool by_column) {
    std::lock_guard<std::mutex> lock(mu);
    auto& slot = (by_column ? cols : rows)[static_cast<size_t>(source)];
    if (slot == nullptr) {
      const std::vector<int64_t>& kv = kv_pos[static_cast<size_t>(source)];
      slot = std::make_unique<const mask::BlockMap>(
          mask::BlockMap::Build(mask, std::span<const int64_t>(q_pos), std::span<const int64_t>(kv),
                                bq, bkv, heads, by_column));
      ++builds;
    }
    return slot.get();
  }
};

namespace {

// The tile geometry the kernels will use (Geometry::Of) for these lengths:
// only the shapes of the parameters matter to it.
std::pair<int64_t, int64_t> TileSizes(int64_t sq, int64_t skv, int64_t heads,
                                      const BlockSizes& blocks) {
  kernels::FlashParams p;
  p.q = TensorView::Contiguous(nullptr, DType::kF32, {1, sq, heads, 1});
  p.k = TensorView::Contiguous(nullptr, DType::kF32, {1, skv, 1, 1});
  p.v = p.k;
  p.blocks = blocks;
  const kernels::Geometry g = kernels::Geometry::Of(p);
  return {g.bq, g.bkv};
}

}  // namespace

RingPlan::RingPlan(const Communicator& comm, const RingOptions& options, int64_t local_sq,
                   int64_t local_skv, int64_t num_heads)
    : RingPlan(comm.rank(), comm.size(), options, local_sq, local_skv, num_heads) {}

RingPlan::RingPlan(int rank, int num_ranks, const RingOptions& options, int64_t local_sq,
                   int64_t local_skv, int64_t num_heads)
    : impl_(std::make_unique<Impl>()) {
  Check(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "RingPlan: rank must be in [0, ",
        num_ranks, "), got ", rank, " (num_ranks ", num_ranks, ")");
  Check(local_sq >= 1 && local_skv >= 1,
        "RingPlan: local lengths must be >= 1, got local_sq=", local_sq, " local_skv=", local_skv);
  Check(num_heads >= 1, "RingPlan: num_heads must be >= 1, got ", num_heads);
  const Mask& mask = options.attention.mask;
  Check(mask.num_heads() == 0 || mask.num_heads() == num_heads, "RingPlan: the mask is built for ",
        mask.num_heads(), " query heads, but num_heads is ", num_heads);
  const BlockSizes& blocks = options.attention.block_sizes;
  Check(blocks.q > 0 && blocks.kv > 0 && blocks.q % 16 == 0 && blocks.kv % 16 == 0,
        "RingPlan: block sizes must be positive multiples of 16, got ", blocks.q, " x ", blocks.kv);
  Impl& m = *impl_;
  m.rank = rank;
  m.num_ranks = num_ranks;
  m.layout = options.layout;
  m.mask = mask;
  m.sq = local_sq;
  m.skv = local_skv;
  m.heads = num_heads;
  m.blocks = blocks;
  std::tie(m.bq, m.bkv) = TileSizes(local_sq, local_skv, num_heads, blocks);
  m.q_pos = LayoutPositions(m.layout, local_sq * num_ranks, rank, num_ranks,
                            "RingPlan: global q sequence length (local_sq x ranks)");
  m.kv_pos.resize(static_cast<size_t>(num_ranks));
  for (int src = 0; src < num_ranks; ++src) {
    m.kv_pos[static_cast<size_t>(src)] =
        LayoutPositions(m.layout, local_skv * num_ranks, src, num_ranks,
                        "RingPlan: global kv sequence length (local_skv x ranks)");
  }
  m.rows.resize(static_cast<size_t>(num_ranks));
  m.cols.resize(static_cast<size_t>(num_ranks));
}

RingPlan::~RingPlan() = default;
RingPlan::RingPlan(RingPlan&&) noexcept = default;
RingPlan& RingPlan::operator=(RingPlan&&) noexcept = default;

int RingPlan::rank() const { return impl_->rank; }
int RingPlan::num_ranks() const { return impl_->num_ranks; }

int64_t RingPlan::metadata_builds() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->builds;
}

size_t RingPlan::memory_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  size_t bytes = 0;
  for (const auto* maps : {&impl_->rows, &impl_->cols}) {
    for (const auto& m : *maps) bytes += m != nullptr ? m->memory_bytes() : 0;
  }
  return bytes;
}

namespace ring_internal {

void PlanAccess::CheckFits(const RingPlan& plan, const RingSetup& s, const RingOptions& options) {
  const RingPlan::Impl& m = *plan.impl_;
  const char* what = "ring: options.plan was made for ";
  Check(m.num_ranks == s.num_ranks && m.rank == s.rank, what, "rank ", m.rank, " of ", m.num_ranks,
        ", but this call is rank ", s.rank, " of ", s.num_ranks);
  Check(m.layout == options.layout, what, "layout '", LayoutName(m.layout),
        "', but options.layout is '", LayoutName(options.layout), "'");
  Check(m.sq == s.dims.sq && m.skv == s.dims.skv, what, "local lengths q ", m.sq, ", kv ", m.skv,
        ", but q has ", s.dims.sq, " local rows and k/v ", s.dims.skv);
  Check(m.heads == s.dims.h, what, m.heads, " query heads, but q has ", s.dims.h);
  const BlockSizes& b = options.attention.block_sizes;
  Check(m.blocks.q == b.q && m.blocks.kv == b.kv, what, "block sizes ", m.blocks.q, " x ",
        m.blocks.kv, ", but options.attention.block_sizes is ", b.q, " x ", b.kv);
  const Mask& mask = options.attention.mask;
  // The same nodes (a copy of the plan's Mask), or, without dense bytes that
  // text cannot show, the same text.
  const bool same = &m.mask.node() == &mask.node() || (!m.mask.has_dense() && !mask.has_dense() &&
                                                       m.mask.ToString() == mask.ToString());
  Check(same, what, "the mask '", m.mask.ToString(), "', but options.attention.mask is '",
        mask.ToString(), "'",
        m.mask.has_dense() || mask.has_dense()
            ? " (a mask with dense values must be the plan's own Mask or a copy of it)"
            : "");
}

const mask::BlockMap* PlanAccess::Map(const RingPlan& plan, int source, bool by_column) {
  return plan.impl_->Map(source, by_column);
}

}  // namespace ring_internal

}  // namespace ringsplash

// Geometry, tile plan and statistics shared by the flash loops.
#include "src/kernels/flash_common.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "src/kernels/micro.h"

namespace ringsplash::kernels {

Geometry Geometry::Of(const FlashParams& p) {
  Geometry g;
  g.b = p.q.shape[0];
  g.sq = p.q.shape[1];
  g.h = p.q.shape[2];
  g.d = p.q.shape[3];
  g.skv = p.k.shape[1];
  g.hkv = p.k.shape[2];
  g.dv = p.v.shape[3];
  g.group = g.hkv > 0 ? std::max<int64_t>(1, g.h / g.hkv) : 1;
  g.bq = std::max<int64_t>(1, p.blocks.q);
  g.bkv = micro::RoundUp(std::max<int64_t>(1, p.blocks.kv), micro::kVec);
  g.nqb = (g.sq + g.bq - 1) / g.bq;
  g.nkvb = (g.skv + g.bkv - 1) / g.bkv;
  g.dp = micro::RoundUp(g.d, micro::kVec);
  g.dvp = micro::RoundUp(g.dv, micro::kVec);
  g.ld_kv = micro::PaddedLd(g.bkv);
  g.ld_d = micro::PaddedLd(g.d);
  g.ld_dv = micro::PaddedLd(g.dv);
  return g;
}

int64_t Geometry::QRows(int64_t qb) const { return std::min(bq, sq - qb * bq); }
int64_t Geometry::KvRows(int64_t kvb) const { return std::min(bkv, skv - kvb * bkv); }

namespace {

const Mask& MaskOf(const FlashParams& p) {
  static const Mask kFull = Mask::Full();
  return p.mask != nullptr ? *p.mask : kFull;
}

std::vector<int64_t> Positions(const int64_t* pos, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = pos != nullptr ? pos[i] : i;
  return v;
}

std::vector<int32_t> CopySegments(const TensorView& t) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<int32_t> v(static_cast<size_t>(rows * cols));
  const int32_t* src = static_cast<const int32_t*>(t.data);
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < cols; ++i) v[b * cols + i] = src[b * t.stride[0] + i * t.stride[1]];
  }
  return v;
}

mask::BlockMap BuildMap(const FlashParams& p, const Geometry& g, bool by_column) {
  const std::vector<int64_t> q_pos = Positions(p.q_pos, g.sq);
  const std::vector<int64_t> kv_pos = Positions(p.kv_pos, g.skv);
  return mask::BlockMap::Build(MaskOf(p), std::span<const int64_t>(q_pos),
                               std::span<const int64_t>(kv_pos), g.bq, g.bkv, g.h, by_column);
}

}  // namespace

TilePlan::TilePlan(const FlashParams& p, const Geometry& g, bool by_column)
    : g_(g), map_(BuildMap(p, g, by_column)) {
  has_segments_ = p.q_segments.defined() && p.kv_segments.defined();
  if (!has_segments_) return;
  q_seg_ = CopySegments(p.q_segments);
  kv_seg_ = CopySegments(p.kv_segments);
  for (int64_t b = 0; b < g.b; ++b) {
    q_ranges_.push_back(mask::BlockRanges::Of(
        std::span<const int32_t>(q_seg_.data() + b * g.sq, static_cast<size_t>(g.sq)), g.bq));
    kv_ranges_.push_back(mask::BlockRanges::Of(
        std::span<const int32_t>(kv_seg_.data() + b * g.skv, static_cast<size_t>(g.skv)), g.bkv));
  }
}

mask::BlockKind TilePlan::Refine(mask::BlockKind map_kind, int64_t b, int64_t qb,
                                 int64_t kvb) const {
  if (!has_segments_ || map_kind == mask::BlockKind::kEmpty) return map_kind;
  const mask::BlockRanges& qr = q_ranges_[b];
  const mask::BlockRanges& kr = kv_ranges_[b];
  return mask::Combine(map_kind,
                       mask::ClassifySegments(qr.lo[qb], qr.hi[qb], kr.lo[kvb], kr.hi[kvb]));
}

void TilePlan::FillMask(mask::BlockKind map_kind, int64_t head, int64_t b, int64_t qb, int64_t kvb,
                        uint8_t* out, int64_t ld) const {
  const int64_t m = g_.QRows(qb), n = g_.KvRows(kvb);
  if (map_kind == mask::BlockKind::kPartial) {
    map_.FillPartial(head, qb, kvb, out, ld);
  } else {
    for (int64_t i = 0; i < m; ++i) std::memset(out + i * ld, 1, static_cast<size_t>(n));
  }
  if (!has_segments_) return;
  const int32_t* qs = q_seg_.data() + b * g_.sq + qb * g_.bq;
  const int32_t* ks = kv_seg_.data() + b * g_.skv + kvb * g_.bkv;
  for (int64_t i = 0; i < m; ++i) {
    uint8_t* row = out + i * ld;
    for (int64_t j = 0; j < n; ++j) row[j] = (row[j] != 0 && qs[i] == ks[j]) ? 1 : 0;
  }
}

void AddStats(const std::vector<WorkerStats>& per_worker, KernelStats* stats) {
  if (stats == nullptr) return;
  KernelStats s;
  int64_t flops = 0;
  for (const WorkerStats& w : per_worker) {
    s.computed_blocks += w.computed;
    s.full_blocks += w.full;
    s.partial_blocks += w.partial;
    s.skipped_blocks += w.skipped;
    flops += w.flops;
  }
  s.flops = static_cast<double>(flops);
  stats->Add(s);
}

}  // namespace ringsplash::kernels

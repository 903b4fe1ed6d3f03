// Geometry, tile plan and statistics shared by the flash loops.
#include "src/kernels/tiling/tiles.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

#include "src/kernels/micro/micro.h"
#include "src/kernels/poison.h"

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
  // Blocks no larger than the rows they tile (rounded up to whole vectors):
  // the tiling is the same (one block), but scratch sized by the block
  // would otherwise grow with a large block size, not with the problem.
  const int64_t q_rows = micro::RoundUp(std::max<int64_t>(1, g.sq), micro::kVec);
  const int64_t kv_rows = micro::RoundUp(std::max<int64_t>(1, g.skv), micro::kVec);
  g.bq = std::min(std::max<int64_t>(1, p.blocks.q), q_rows);
  g.bkv = std::min(micro::RoundUp(std::max<int64_t>(1, p.blocks.kv), micro::kVec), kv_rows);
  g.nqb = (g.sq + g.bq - 1) / g.bq;
  g.nkvb = (g.skv + g.bkv - 1) / g.bkv;
  g.dp = micro::RoundUp(g.d, micro::kVec);
  g.dvp = micro::RoundUp(g.dv, micro::kVec);
  g.ld_kv = micro::PaddedLd(g.bkv);
  g.ld_d = micro::PaddedLd(g.d);
  g.ld_dv = micro::PaddedLd(g.dv);
  g.ld_q = micro::PaddedLd(g.bq);
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

// Whether a map given with the parameters was built for this geometry.
bool MapFits(const mask::BlockMap& m, const Geometry& g, bool by_column) {
  return m.by_column() == by_column && m.sq() == g.sq && m.skv() == g.skv && m.bq() == g.bq &&
         m.bkv() == g.bkv;
}

}  // namespace

TilePlan::TilePlan(const FlashParams& p, const Geometry& g, bool by_column)
    : g_(g), id_(NewCallId()) {
  const mask::BlockMap* given = by_column ? p.column_map : p.row_map;
  if (given != nullptr && MapFits(*given, g, by_column)) {
    map_ = given;
  } else {
    own_map_.emplace(BuildMap(p, g, by_column));
    map_ = &*own_map_;
  }
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
    map_->FillPartial(head, qb, kvb, out, ld);
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

void TileMask::Reserve(const Geometry& g) {
  g_ = &g;
  ldm_ = g.ld_q / micro::kVec;
  Grow(bytes_, g.bq * g.ld_kv);
  for (Entry& e : entries_) {
    Grow(e.bits, g.bkv * ldm_);
    Grow(e.key_lo, g.bq);
    Grow(e.key_hi, g.bq);
    Grow(e.query_lo, g.bkv);
    Grow(e.query_hi, g.bkv);
  }
}

void TileMask::Fill(const TilePlan& plan, const micro::MicroKernels& mk, mask::BlockKind map_kind,
                    int64_t head, int64_t b, int64_t qb, int64_t kvb) {
  const Geometry& g = *g_;
  // Segments make a tile's mask depend on the batch's documents: no key.
  mask::TileShapeKey key;
  const bool keyed = !plan.has_segments() && plan.map().ShiftKey(head, qb, kvb, &key);
  bool hit = false;
  cur_ = FindOrEvict(
      std::span<Entry>(entries_), &clock_,
      [&](const Entry& e) { return keyed && e.plan == plan.id() && e.key == key; }, &hit);
  if (hit) {
    ++reuses_;
    return;
  }
  cur_->plan = keyed ? plan.id() : 0;
  cur_->key = key;
  ++builds_;
  plan.FillMask(map_kind, head, b, qb, kvb, bytes_.data(), g.ld_kv);
  mk.mask_bits(g.QRows(qb), g.KvRows(kvb), bytes_.data(), g.ld_kv, cur_->bits.data(), ldm_,
               cur_->key_lo.data(), cur_->key_hi.data(), cur_->query_lo.data(),
               cur_->query_hi.data());
}

double TilePlan::UsesPerKvTile() const {
  const double computed = static_cast<double>(map_->Count(mask::BlockKind::kFull) +
                                              map_->Count(mask::BlockKind::kPartial));
  const double heads = map_->num_planes() == 1 ? static_cast<double>(g_.h) : 1.0;
  return computed * heads / static_cast<double>(std::max<int64_t>(1, g_.hkv * g_.nkvb));
}

KvRows::KvRows(const FlashParams& p, const Geometry& g, KeyFormat keys, double uses,
               ThreadPool& pool, bool tile_cache, const micro::MicroKernels* checked_copy)
    : g_(g), keys_(keys) {
  id_ = NewCallId();
  const TensorView& k = p.k;
  const TensorView& v = p.v;
  for (int i = 0; i < 3; ++i) {
    k_stride_[i] = k.stride[i < 2 ? i : 2];
    v_stride_[i] = v.stride[i < 2 ? i : 2];
  }
  const bool k_f32 = k.dtype == DType::kF32 && k.stride[3] == 1;
  const bool k_rows_dense = k.stride[1] == g.d || g.skv == 1;
  const bool v_f32 = v.dtype == DType::kF32 && v.stride[3] == 1;
  const bool v_whole_vectors = v_f32 && g.dv % micro::kVec == 0;
  const bool v_like_packed = v.stride[1] == g.dv && (g.dv <= 64 || g.dv % 128 != 0);
  // Copies per thread (see the class comment) for f32 tiles used too rarely
  // for a copy per call, unless both can be read in place as they are: rows
  // back to back and (V's aliasing penalty being per use) either read like
  // a packed tile or a tile used about once (decoding: a copy would cost a
  // whole extra pass over K and V).
  const bool in_place_as_is = keys == KeyFormat::kF32 && k_f32 && k_rows_dense && v_whole_vectors &&
                              v.stride[1] == g.dv && (v_like_packed || uses < kCopyMinUses);
  const bool bf16_keys = keys == KeyFormat::kBf16 || keys == KeyFormat::kBf16Tiles;
  // bf16 K and V for f32 products are widened in those per-thread copies
  // (never read in place): a sliding window's tiles are used a few times
  // each, and widening all of K and V once per call into fresh memory cost
  // a fifth of such a forward (docs/perf/PHASES.md).
  const bool k_bf16 = k.dtype == DType::kBF16 && k.stride[3] == 1;
  const bool v_bf16 = v.dtype == DType::kBF16 && v.stride[3] == 1;
  if (tile_cache && !bf16_keys && (k_f32 || k_bf16) && (v_f32 || v_bf16) && uses < kPackMinUses &&
      !in_place_as_is) {
    tile_cache_ = true;  // K and V below are then the copies' sources
    if (k_bf16) {
      k_widen_ = k.data;
    } else {
      k_in_place_ = k.data;
    }
    if (v_bf16) {
      v_widen_ = v.data;
    } else {
      v_in_place_ = v.data;
    }
    ldk_ = k.stride[1];
    ldv_ = v.stride[1];
    return;
  }
  // K (see the class comment): rows back to back are read in place; rows
  // of other heads in between (a [B, S, H, D] tensor with H > 1) put every
  // row of a tile on the same few L1 sets, which slows the score product —
  // packing pays once tiles are used often (docs/perf/DESIGN_MEASUREMENTS.md:
  // K rows in place).
  if (keys == KeyFormat::kF32 && k_f32 && (k_rows_dense || uses < kPackMinUses)) {
    k_in_place_ = k.data;
    ldk_ = k.stride[1];
  }
  // V (see the class comment): rows back to back with a panel spanning whole
  // rows (Dv <= 64) read like a packed tile; otherwise only when packing
  // would not pay.
  if (v_whole_vectors && (v_like_packed || uses < kPackMinUses)) {
    v_in_place_ = v.data;
    ldv_ = v.stride[1];
  }
  const int64_t d2 = micro::RoundUp(g.d, 2);
  ldk_bf16_ = d2;
  if (keys == KeyFormat::kBf16Tiles) {
    if (k.dtype == DType::kBF16 && k.stride[3] == 1 && k.stride[1] % 2 == 0 && g.d % 2 == 0) {
      k_bf16_in_place_ = static_cast<const uint16_t*>(k.data);
      ldk_bf16_ = k.stride[1];
    }
  }
  const int64_t tiles = g.b * g.hkv * g.nkvb;
  const bool pack_k = k_in_place_ == nullptr && k_bf16_in_place_ == nullptr;
  const bool pack_v = v_in_place_ == nullptr && keys != KeyFormat::kBf16Tiles;
  if (pack_k) {
    if (bf16_keys) {
      k_elems_ = g.bkv * d2;
      k_bf16_.Resize(static_cast<size_t>(tiles * k_elems_), /*zero=*/false);
    } else {
      ldk_ = g.ld_d;
      k_elems_ = g.bkv * g.ld_d;
      k_packed_.Resize(static_cast<size_t>(tiles * k_elems_), /*zero=*/false);
    }
  }
  if (pack_v) {
    ldv_ = g.ld_dv;
    v_elems_ = g.bkv * g.ld_dv;
    v_packed_.Resize(static_cast<size_t>(tiles * v_elems_), /*zero=*/false);
  }
  if (!pack_k && !pack_v) return;
  // f32 rows of unit stride: the checking copy when asked (same result as
  // PackRowsF32 with nr_pad = n: rows copied, columns zero padded to ld);
  // bf16 rows of unit stride: the checking widening copy, asked or not
  // (PackRowsF32 widens element by element).
  const micro::MicroKernels& mk =
      checked_copy != nullptr ? *checked_copy : micro::MicroKernelsFor(p.path);
  k_checked_ = checked_copy != nullptr && pack_k && !bf16_keys && (k_f32 || k_bf16);
  v_checked_ = checked_copy != nullptr && pack_v && (v_f32 || v_bf16);
  if (k_checked_ || v_checked_) packed_bad_.assign(static_cast<size_t>(tiles), 0);
  pool.ParallelFor(tiles, [&](int64_t t, int) {
    const int64_t kvb = t % g.nkvb, kh = (t / g.nkvb) % g.hkv, b = t / (g.nkvb * g.hkv);
    const int64_t n = g.KvRows(kvb);
    // Rows of `src` into f32 dst with leading dimension ld: the (checking)
    // copy or widening copy, or PackRowsF32.
    bool bad = false;
    auto pack_f32 = [&](const TensorView& src, int64_t cols, float* dst, int64_t ld) {
      const int64_t at = src.Offset(b, kvb * g.bkv, kh);
      if (src.dtype == DType::kBF16 && src.stride[3] == 1) {
        bad = mk.widen_rows_bf16(static_cast<const uint16_t*>(src.data) + at, src.stride[1], n,
                                 cols, dst, ld) ||
              bad;
      } else if (src.dtype == DType::kF32 && src.stride[3] == 1 && checked_copy != nullptr) {
        bad = mk.copy_rows_f32(static_cast<const float*>(src.data) + at, src.stride[1], n, cols,
                               dst, ld) ||
              bad;
      } else {
        PackRowsF32(Slab{&src, b, kh, kvb * g.bkv, n, cols}, dst, ld, n);
      }
    };
    if (pack_k && bf16_keys) {
      PackRowsBf16(Slab{&k, b, kh, kvb * g.bkv, n, g.d}, k_bf16_.data() + t * k_elems_, d2);
    } else if (pack_k) {
      pack_f32(k, g.d, k_packed_.data() + t * k_elems_, g.ld_d);
    }
    if (pack_v) pack_f32(v, g.dv, v_packed_.data() + t * v_elems_, g.ld_dv);
    // Flags kept only where the call asked for the check (packed_bad_ is
    // empty otherwise; the widening copy reports non-finite values anyway).
    if (bad && !packed_bad_.empty()) packed_bad_[static_cast<size_t>(t)] = 1;
  });
}

bool KvRows::NonFinite(const FlashParams& p, int64_t b, int64_t kh, int64_t kvb) const {
  const int64_t s0 = kvb * g_.bkv, n = g_.KvRows(kvb);
  if (!packed_bad_.empty() && packed_bad_[static_cast<size_t>(Tile(b, kh, kvb))] != 0) return true;
  const micro::MicroKernels& mk = micro::MicroKernelsFor(p.path);
  return (!k_checked_ && AnyNonFinite(p.k, b, s0, n, kh, &mk)) ||
         (!v_checked_ && AnyNonFinite(p.v, b, s0, n, kh, &mk));
}

const float* KvRows::Keys(int64_t b, int64_t kh, int64_t kvb) const {
  if (k_in_place_ != nullptr) {
    return static_cast<const float*>(k_in_place_) + Offset(k_stride_, b, kh, kvb);
  }
  return k_packed_.data() + Tile(b, kh, kvb) * k_elems_;
}

const uint16_t* KvRows::KeysBf16(int64_t b, int64_t kh, int64_t kvb) const {
  if (k_bf16_in_place_ != nullptr) {
    return k_bf16_in_place_ + Offset(k_stride_, b, kh, kvb);
  }
  return k_bf16_.data() + Tile(b, kh, kvb) * k_elems_;
}

const float* KvRows::Values(int64_t b, int64_t kh, int64_t kvb) const {
  if (keys_ == KeyFormat::kBf16Tiles) return nullptr;  // the caller reads the tensor
  if (v_in_place_ != nullptr) {
    return static_cast<const float*>(v_in_place_) + Offset(v_stride_, b, kh, kvb);
  }
  return v_packed_.data() + Tile(b, kh, kvb) * v_elems_;
}

uint64_t NewCallId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

int64_t TileCopies::Slots(int64_t floats, int64_t budget_bytes) {
  return std::clamp<int64_t>(budget_bytes / (floats * static_cast<int64_t>(sizeof(float))), 2, 16);
}

float* TileCopies::Find(uint64_t call, int64_t tile, int64_t floats, int64_t budget_bytes,
                        bool* hit) {
  const int64_t count = Slots(floats, budget_bytes);
  if (floats != floats_ || count != static_cast<int64_t>(slots_.size())) {  // another kind of tile
    floats_ = floats;
    slots_.assign(static_cast<size_t>(count), Slot{});
    data_.Resize(static_cast<size_t>(count * floats), /*zero=*/false);
  }
  Slot* s = FindOrEvict(
      std::span<Slot>(slots_), &clock_,
      [&](const Slot& x) { return x.call == call && x.tile == tile; }, hit);
  s->call = call;
  s->tile = tile;
  return data_.data() + (s - slots_.data()) * floats_;
}

KvTile KvTileCache::GetChecked(const KvRows& kv, const micro::MicroKernels& mk,
                               const FlashParams& p, std::vector<std::atomic<bool>>& claimed,
                               int64_t b, int64_t kh, int64_t kvb) {
  if (p.non_finite == nullptr) return Get(kv, mk, b, kh, kvb);
  if (!kv.tile_cache() &&
      !claimed[static_cast<size_t>(kv.Tile(b, kh, kvb))].exchange(true,
                                                                  std::memory_order_relaxed) &&
      kv.NonFinite(p, b, kh, kvb)) {
    p.non_finite->store(true);
  }
  bool bad = false;
  const KvTile kvt = Get(kv, mk, b, kh, kvb, &bad);
  if (bad) p.non_finite->store(true);
  return kvt;
}

int64_t KvTileCache::Together(const Geometry& g) {
  return TileCopies::Slots(g.bkv * (g.ld_d + g.ld_dv), kBudgetBytes);
}

KvTile KvTileCache::Get(const KvRows& kv, const micro::MicroKernels& mk, int64_t b, int64_t kh,
                        int64_t kvb, bool* non_finite) {
  const Geometry& g = kv.g_;
  if (!kv.tile_cache()) {
    return {kv.f32_keys() ? kv.Keys(b, kh, kvb) : nullptr, kv.ldk(), kv.Values(b, kh, kvb),
            kv.ldv()};
  }
  const int64_t k_floats = g.bkv * g.ld_d;
  bool hit = false;
  float* k =
      copies_.Find(kv.id_, kv.Tile(b, kh, kvb), k_floats + g.bkv * g.ld_dv, kBudgetBytes, &hit);
  if (!hit) {
    const int64_t n = g.KvRows(kvb);
    // tile_cache() implies K and V of unit inner stride, f32 (copied) or
    // bf16 (widened).
    const int64_t k_at = kv.Offset(kv.k_stride_, b, kh, kvb);
    const int64_t v_at = kv.Offset(kv.v_stride_, b, kh, kvb);
    float* v = k + k_floats;
    bool bad = kv.k_widen_ != nullptr
                   ? mk.widen_rows_bf16(static_cast<const uint16_t*>(kv.k_widen_) + k_at, kv.ldk(),
                                        n, g.d, k, g.ld_d)
                   : mk.copy_rows_f32(static_cast<const float*>(kv.k_in_place_) + k_at, kv.ldk(), n,
                                      g.d, k, g.ld_d);
    bad = (kv.v_widen_ != nullptr
               ? mk.widen_rows_bf16(static_cast<const uint16_t*>(kv.v_widen_) + v_at, kv.ldv(), n,
                                    g.dv, v, g.ld_dv)
               : mk.copy_rows_f32(static_cast<const float*>(kv.v_in_place_) + v_at, kv.ldv(), n,
                                  g.dv, v, g.ld_dv)) ||
          bad;
    if (non_finite != nullptr && bad) *non_finite = true;
  }
  return {k, g.ld_d, k + k_floats, g.ld_dv};
}

bool PackTransposed(const micro::MicroKernels& mk, const TensorView& t, int64_t b, int64_t head,
                    int64_t r0, int64_t rows, float* dst, int64_t ld) {
  const int64_t cols = t.shape[3];
  if (t.dtype == DType::kF32 && t.stride[3] == 1) {
    return mk.transpose_f32(rows, cols,
                            static_cast<const float*>(t.data) + t.Offset(b, r0, head, 0),
                            t.stride[1], dst, ld);
  } else {
    // Rows widened to f32 first, then the micro-kernels' transpose: faster
    // than an element-wise transposing copy (docs/perf/DESIGN_MEASUREMENTS.md:
    // widening before the transpose).
    thread_local AlignedBuffer<float> rows_f32;
    Grow(rows_f32, rows * cols);
    if (t.dtype == DType::kBF16 && t.stride[3] == 1) {
      // Its NaN/Inf report is not needed: the transpose checks the same values.
      const auto* first = static_cast<const uint16_t*>(t.data) + t.Offset(b, r0, head, 0);
      mk.widen_rows_bf16(first, t.stride[1], rows, cols, rows_f32.data(), cols);
    } else {
      PackRowsF32(Slab{&t, b, head, r0, rows, cols}, rows_f32.data(), cols, rows);
    }
    return mk.transpose_f32(rows, cols, rows_f32.data(), cols, dst, ld);
  }
}

void PackTransposedPairsBf16(const micro::MicroKernels& mk, const TensorView& t, int64_t b,
                             int64_t head, int64_t r0, int64_t rows, uint16_t* dst, int64_t ld) {
  const int64_t cols = t.shape[3];
  const auto* first = static_cast<const uint16_t*>(t.data) + t.Offset(b, r0, head, 0);
  const bool words = t.dtype == DType::kBF16 && t.stride[3] == 1 && cols % 2 == 0 &&
                     t.stride[1] % 2 == 0 && reinterpret_cast<uintptr_t>(first) % 4 == 0;
  if (!words) {
    PackTransposedBf16Pairs(Slab{&t, b, head, r0, rows, cols}, dst, ld);
    return;
  }
  // Loaded and stored by intrinsics only (micro.h TransposeF32Fn on the
  // AVX-512 tables, the only ones with bf16 products), which may alias.
  mk.transpose_f32(rows, cols / 2, reinterpret_cast<const float*>(first), t.stride[1] / 2,
                   reinterpret_cast<float*>(dst), ld);
}

std::pair<int64_t, int64_t> RangeSpan(micro::KRanges ranges, int64_t r0, int64_t r1, int64_t unit) {
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (ranges.hi[r] <= ranges.lo[r]) continue;
    lo = std::min<int64_t>(lo, ranges.lo[r]);
    hi = std::max<int64_t>(hi, ranges.hi[r]);
  }
  if (hi == 0) return {0, 0};
  return {lo / unit * unit, micro::RoundUp(hi, unit)};
}

void GemmBf16Panels(const micro::MicroKernels& mk, int64_t m, int64_t n, int64_t k2,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                    int64_t ldc, bool accumulate, micro::KRanges ranges) {
  if (ranges.lo == nullptr) {
    mk.gemm_bf16(m, n, k2, a, lda, b, ldb, c, ldc, nullptr, accumulate);
    return;
  }
  for (int64_t i = 0; i < m; i += kBf16Panel) {
    const int64_t rows = std::min(kBf16Panel, m - i);
    auto [lo, hi] = RangeSpan(ranges, i, i + rows, kBf16Panel);
    hi = std::min(hi, 2 * k2);
    if (hi <= lo) {
      if (accumulate) continue;
      lo = hi = 0;  // k2 = 0: C = 0
    }
    // Element lo of A's rows is pair lo / 2, B's pair row lo / 2.
    mk.gemm_bf16(rows, n, (hi - lo) / 2, a + i * lda + lo, lda, b + lo * ldb, ldb, c + i * ldc, ldc,
                 nullptr, accumulate);
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

// BlockMap: run-length encoded tile classification (SPEC §3).
//
// Build, per head plane and per major row (q block, or kv block for column
// maps), the kinds of all minor tiles:
//  * masks of structured leaves only: the minor blocks are split into
//    maximal stretches whose range ends (lo and hi) are each monotone (a
//    sorted layout is one stretch). Inside a stretch every predicate bit of
//    every leaf (leaf_classify.h) flips at most once, so the tuple of bits
//    (the "signature") is piecewise constant with at most (bits + 1) pieces,
//    and the tile kind, a function of the signature, is constant on each
//    piece. Pieces are found by galloping + binary search on "signature
//    equals the piece's first signature" (a monotone predicate), so a row
//    costs O(pieces * log(blocks)) instead of O(blocks). Unsorted positions
//    degrade to one evaluation per tile, never to a wrong answer.
//  * masks with Dense leaves: every tile is visited. The analytic answer
//    (Dense leaves counted as "partial") settles the tile when it is empty
//    or full; otherwise the tile's element mask is evaluated at its actual
//    positions (FillTileMask) and counted, which is exact. Planes whose
//    leaves are all Dense (or Full) keep the partial tiles' bitmaps,
//    de-duplicated by content, and FillPartial copies them; mixed planes
//    (e.g. Dense & Causal) re-evaluate the tree in FillPartial instead.
#include "src/mask/block_map.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "ringsplash/error.h"
#include "src/mask/leaf_classify.h"
#include "src/mask/mask_node.h"

namespace ringsplash::mask {
namespace {

using mask_detail::Int128;
using mask_detail::Node;
using mask_detail::NodeKind;

constexpr int32_t kOpAnd = -1;
constexpr int32_t kOpOr = -2;

// The mask tree of one head, PerHead nodes resolved, as a postfix program.
struct Program {
  std::vector<const Node*> leaves;
  std::vector<int32_t> code;  // >= 0: push leaf; kOpAnd / kOpOr: combine two
  bool has_dense = false;
  bool has_shaped = false;      // Causal, Local or Chunked leaves
  bool shift_invariant = true;  // only Full, Causal and Local leaves: a function of kv - q

  void Compile(const Node& n, int64_t head) {
    switch (n.kind) {
      case NodeKind::kPerHead:
        Compile(n.ForHead(head), head);
        return;
      case NodeKind::kAnd:
      case NodeKind::kOr:
        Compile(*n.children[0], head);
        Compile(*n.children[1], head);
        code.push_back(n.kind == NodeKind::kAnd ? kOpAnd : kOpOr);
        return;
      default:
        has_dense |= n.kind == NodeKind::kDense;
        has_shaped |= n.kind != NodeKind::kDense && n.kind != NodeKind::kFull;
        shift_invariant &=
            n.kind == NodeKind::kFull || n.kind == NodeKind::kCausal || n.kind == NodeKind::kLocal;
        code.push_back(static_cast<int32_t>(leaves.size()));
        leaves.push_back(&n);
        return;
    }
  }
};

// Maximal stretches [begin, end) of blocks whose lo and hi sequences are each
// monotone (non-decreasing or non-increasing, independently).
std::vector<int64_t> MonotoneStretchEnds(const BlockRanges& r) {
  std::vector<int64_t> ends;
  const int64_t n = r.num_blocks();
  int64_t b = 0;
  while (b < n) {
    int dir_lo = 0;
    int dir_hi = 0;
    int64_t e = b + 1;
    for (; e < n; ++e) {
      const int64_t lo0 = r.lo[e - 1], lo1 = r.lo[e];
      const int64_t hi0 = r.hi[e - 1], hi1 = r.hi[e];
      const int dl = (lo1 > lo0) - (lo1 < lo0);
      const int dh = (hi1 > hi0) - (hi1 < hi0);
      if ((dl != 0 && dir_lo != 0 && dl != dir_lo) || (dh != 0 && dir_hi != 0 && dh != dir_hi)) {
        break;
      }
      if (dl != 0) dir_lo = dl;
      if (dh != 0) dir_hi = dh;
    }
    ends.push_back(e);
    b = e;
  }
  return ends;
}

// FNV-1a style over 8-byte words (a hash only: equality is checked bytewise).
uint64_t HashBytes(const uint8_t* p, size_t n, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

class BlockMap::Builder {
 public:
  Builder(BlockMap& m, std::span<const int64_t> q_pos, std::span<const int64_t> kv_pos)
      : m_(m),
        q_pos_(q_pos),
        kv_pos_(kv_pos),
        q_ranges_(BlockRanges::Of(q_pos, m.bq_)),
        kv_ranges_(BlockRanges::Of(kv_pos, m.bkv_)),
        major_(m.by_column_ ? kv_ranges_ : q_ranges_),
        minor_(m.by_column_ ? q_ranges_ : kv_ranges_) {}

  void Run() {
    const int64_t rows = major_.num_blocks();
    const int64_t cols = minor_.num_blocks();
    const std::vector<int64_t> stretch_ends = MonotoneStretchEnds(minor_);
    m_.row_offsets_.reserve(static_cast<size_t>(m_.planes_ * rows + 1));
    for (int64_t plane = 0; plane < m_.planes_; ++plane) {
      prog_ = Program();
      prog_.Compile(m_.mask_.node(), plane);
      head_ = plane;
      words_ = (prog_.leaves.size() + 7) / 8;
      sig0_.assign(words_, 0);
      sig1_.assign(words_, 0);
      stack_.clear();
      stack_.reserve(prog_.code.size());
      m_.shift_invariant_.push_back(prog_.shift_invariant ? 1 : 0);
      const bool dedup = prog_.has_dense && !prog_.has_shaped;
      if (dedup && m_.dense_tile_ids_.empty()) {
        m_.dense_tile_ids_.assign(static_cast<size_t>(m_.planes_ * m_.nqb_ * m_.nkvb_), -1);
      }
      for (int64_t r = 0; r < rows; ++r) {
        m_.row_offsets_.push_back(static_cast<int64_t>(m_.runs_.size()));
        row_begin_ = m_.runs_.size();
        if (prog_.has_dense) {
          for (int64_t b = 0; b < cols; ++b) Emit(b, b + 1, DenseTileKind(plane, r, b, dedup));
        } else {
          int64_t begin = 0;
          for (const int64_t end : stretch_ends) {
            GallopStretch(r, begin, end);
            begin = end;
          }
        }
      }
    }
    m_.row_offsets_.push_back(static_cast<int64_t>(m_.runs_.size()));
  }

 private:
  // Analytic kind of tile (major r, minor b); Dense leaves count as partial.
  // Writes the tile's signature (8 bits per leaf) to `sig` unless null.
  BlockKind Eval(int64_t r, int64_t b, uint64_t* sig) {
    int64_t q_lo = major_.lo[r], q_hi = major_.hi[r];
    int64_t kv_lo = minor_.lo[b], kv_hi = minor_.hi[b];
    if (m_.by_column_) {
      std::swap(q_lo, kv_lo);
      std::swap(q_hi, kv_hi);
    }
    if (sig != nullptr) std::fill(sig, sig + words_, 0);
    stack_.clear();
    for (const int32_t c : prog_.code) {
      if (c >= 0) {
        const Node& leaf = *prog_.leaves[static_cast<size_t>(c)];
        if (leaf.kind == NodeKind::kDense) {
          stack_.push_back(BlockKind::kPartial);
          continue;
        }
        const uint32_t bits = mask_detail::LeafBits(leaf, q_lo, q_hi, kv_lo, kv_hi);
        if (sig != nullptr) sig[c / 8] |= uint64_t{bits} << (8 * (c % 8));
        stack_.push_back(mask_detail::LeafKindFromBits(leaf.kind, bits));
        continue;
      }
      const BlockKind y = stack_.back();
      stack_.pop_back();
      const BlockKind x = stack_.back();
      stack_.back() = c == kOpAnd ? mask_detail::CombineAnd(x, y) : mask_detail::CombineOr(x, y);
    }
    return stack_.back();
  }

  bool SameSig() const { return std::equal(sig0_.begin(), sig0_.end(), sig1_.begin()); }

  // Classifies minor blocks [begin, end) of row r, a monotone stretch.
  void GallopStretch(int64_t r, int64_t begin, int64_t end) {
    int64_t b = begin;
    while (b < end) {
      const BlockKind kind = Eval(r, b, sig0_.data());
      // Invariant: sig(lo) == sig(b); hi == end or sig(hi) != sig(b).
      int64_t lo = b;
      int64_t hi = end;
      for (int64_t step = 1;; step *= 2) {
        const int64_t probe = lo + step;
        if (probe >= end) break;
        Eval(r, probe, sig1_.data());
        if (!SameSig()) {
          hi = probe;
          break;
        }
        lo = probe;
      }
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        Eval(r, mid, sig1_.data());
        if (SameSig()) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      Emit(b, hi, kind);
      b = hi;
    }
  }

  // Exact kind of a tile of a mask with Dense leaves, scanning its elements
  // at the actual positions when the analytic answer is partial.
  BlockKind DenseTileKind(int64_t plane, int64_t r, int64_t b, bool dedup) {
    const BlockKind analytic = Eval(r, b, nullptr);
    if (analytic != BlockKind::kPartial) return analytic;
    const int64_t qb = m_.by_column_ ? b : r;
    const int64_t kvb = m_.by_column_ ? r : b;
    const int64_t q0 = qb * m_.bq_;
    const int64_t k0 = kvb * m_.bkv_;
    const auto rows = static_cast<size_t>(std::min(m_.bq_, m_.sq_ - q0));
    const auto cols = static_cast<size_t>(std::min(m_.bkv_, m_.skv_ - k0));
    tile_.resize(rows * cols);
    FillTileMask(m_.mask_, head_, q_pos_.subspan(static_cast<size_t>(q0), rows),
                 kv_pos_.subspan(static_cast<size_t>(k0), cols), tile_.data(),
                 static_cast<int64_t>(cols));
    size_t ones = 0;
    for (const uint8_t v : tile_) ones += v;
    if (ones == 0) return BlockKind::kEmpty;
    if (ones == tile_.size()) return BlockKind::kFull;
    if (dedup) {
      m_.dense_tile_ids_[static_cast<size_t>((plane * m_.nqb_ + qb) * m_.nkvb_ + kvb)] =
          Intern(rows, cols);
    }
    return BlockKind::kPartial;
  }

  // Id of the unique tile equal to tile_ (rows x cols), adding it if new.
  int32_t Intern(size_t rows, size_t cols) {
    const uint64_t h = HashBytes(tile_.data(), tile_.size(), rows * 1000003u + cols);
    std::vector<int32_t>& bucket = unique_[h];
    for (const int32_t id : bucket) {
      const UniqueTile& u = m_.dense_tiles_[static_cast<size_t>(id)];
      if (static_cast<size_t>(u.rows) == rows && static_cast<size_t>(u.cols) == cols &&
          std::memcmp(m_.dense_bytes_.data() + u.offset, tile_.data(), tile_.size()) == 0) {
        return id;
      }
    }
    const auto id = static_cast<int32_t>(m_.dense_tiles_.size());
    m_.dense_tiles_.push_back({static_cast<int64_t>(m_.dense_bytes_.size()),
                               static_cast<int32_t>(rows), static_cast<int32_t>(cols)});
    m_.dense_bytes_.insert(m_.dense_bytes_.end(), tile_.begin(), tile_.end());
    bucket.push_back(id);
    return id;
  }

  // Records minor blocks [b, e) of the current row as `kind`: counted always,
  // stored (merged with an adjacent run of the same kind) unless empty.
  void Emit(int64_t b, int64_t e, BlockKind kind) {
    m_.counts_[static_cast<int>(kind)] += e - b;
    if (kind == BlockKind::kEmpty) return;
    if (m_.runs_.size() > row_begin_) {
      BlockRun& last = m_.runs_.back();
      if (last.kind == kind && last.end == b) {
        last.end = static_cast<int32_t>(e);
        return;
      }
    }
    m_.runs_.push_back({static_cast<int32_t>(b), static_cast<int32_t>(e), kind});
  }

  BlockMap& m_;
  std::span<const int64_t> q_pos_, kv_pos_;
  BlockRanges q_ranges_, kv_ranges_;
  const BlockRanges& major_;
  const BlockRanges& minor_;
  Program prog_;
  int64_t head_ = 0;
  size_t words_ = 0;
  std::vector<uint64_t> sig0_, sig1_;
  std::vector<BlockKind> stack_;
  size_t row_begin_ = 0;
  std::vector<uint8_t> tile_;
  std::unordered_map<uint64_t, std::vector<int32_t>> unique_;
};

namespace {

// Splits positions into blocks of `block`, affine blocks as (first, step).
template <typename PositionBlock>
void CompressPositions(std::span<const int64_t> pos, int64_t block,
                       std::vector<PositionBlock>& blocks, std::vector<int64_t>& explicit_pos) {
  const auto n = static_cast<int64_t>(pos.size());
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    PositionBlock pb;
    pb.first = pos[static_cast<size_t>(begin)];
    const Int128 step =
        end - begin > 1 ? Int128{pos[static_cast<size_t>(begin + 1)]} - pb.first : Int128{0};
    bool affine = step >= INT64_MIN && step <= INT64_MAX;
    for (int64_t i = begin + 2; affine && i < end; ++i) {
      affine = Int128{pos[static_cast<size_t>(i)]} == pb.first + step * (i - begin);
    }
    if (affine) {
      pb.step = static_cast<int64_t>(step);
    } else {
      pb.explicit_at = static_cast<int64_t>(explicit_pos.size());
      explicit_pos.insert(explicit_pos.end(), pos.begin() + begin, pos.begin() + end);
    }
    blocks.push_back(pb);
  }
}

// first + step * i for i < n. The values are known to fit in int64 (they
// were verified against the input), intermediate products may not: unsigned
// arithmetic wraps modulo 2^64 and lands on the exact value.
void FillAffine(int64_t first, int64_t step, int64_t n, int64_t* buf) {
  const auto f = static_cast<uint64_t>(first);
  const auto s = static_cast<uint64_t>(step);
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<int64_t>(f + s * static_cast<uint64_t>(i));
}

}  // namespace

namespace {
std::atomic<int64_t> g_build_count{0};
}  // namespace

int64_t BlockMap::BuildCount() { return g_build_count.load(); }

BlockMap BlockMap::Build(const Mask& mask, std::span<const int64_t> q_pos,
                         std::span<const int64_t> kv_pos, int64_t bq, int64_t bkv,
                         int64_t num_query_heads, bool by_column) {
  Check(bq > 0 && bkv > 0, "BlockMap::Build: block sizes must be > 0, got bq=", bq, " bkv=", bkv);
  Check(num_query_heads >= 1, "BlockMap::Build: num_query_heads must be >= 1, got ",
        num_query_heads);
  const int64_t mask_heads = mask.num_heads();
  Check(mask_heads == 0 || mask_heads == num_query_heads, "BlockMap::Build: the mask is built for ",
        mask_heads, " query heads, but num_query_heads is ", num_query_heads);
  g_build_count.fetch_add(1);
  BlockMap m;
  m.mask_ = mask;
  m.sq_ = static_cast<int64_t>(q_pos.size());
  m.skv_ = static_cast<int64_t>(kv_pos.size());
  m.bq_ = bq;
  m.bkv_ = bkv;
  m.nqb_ = (m.sq_ + bq - 1) / bq;
  m.nkvb_ = (m.skv_ + bkv - 1) / bkv;
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
  Check(m.nqb_ < kMaxBlocks && m.nkvb_ < kMaxBlocks, "BlockMap::Build: too many blocks (", m.nqb_,
        " q blocks, ", m.nkvb_, " kv blocks; at most ", kMaxBlocks - 1,
        "): use larger block sizes");
  m.planes_ = mask_heads != 0 ? num_query_heads : 1;
  m.by_column_ = by_column;
  CompressPositions(q_pos, bq, m.q_blocks_, m.explicit_pos_);
  CompressPositions(kv_pos, bkv, m.kv_blocks_, m.explicit_pos_);
  Builder(m, q_pos, kv_pos).Run();
  m.runs_.shrink_to_fit();
  m.explicit_pos_.shrink_to_fit();
  return m;
}

std::span<const BlockRun> BlockMap::Runs(int64_t head, int64_t row) const {
  const int64_t rows = by_column_ ? nkvb_ : nqb_;
  const auto at = static_cast<size_t>(PlaneOf(head) * rows + row);
  const auto begin = static_cast<size_t>(row_offsets_[at]);
  const auto end = static_cast<size_t>(row_offsets_[at + 1]);
  return std::span<const BlockRun>(runs_.data() + begin, end - begin);
}

std::span<const int64_t> BlockMap::QPositions(int64_t qb, int64_t* buf) const {
  const PositionBlock& pb = q_blocks_[static_cast<size_t>(qb)];
  const int64_t n = std::min(bq_, sq_ - qb * bq_);
  if (pb.explicit_at >= 0) {
    return {explicit_pos_.data() + pb.explicit_at, static_cast<size_t>(n)};
  }
  FillAffine(pb.first, pb.step, n, buf);
  return {buf, static_cast<size_t>(n)};
}

std::span<const int64_t> BlockMap::KvPositions(int64_t kvb, int64_t* buf) const {
  const PositionBlock& pb = kv_blocks_[static_cast<size_t>(kvb)];
  const int64_t n = std::min(bkv_, skv_ - kvb * bkv_);
  if (pb.explicit_at >= 0) {
    return {explicit_pos_.data() + pb.explicit_at, static_cast<size_t>(n)};
  }
  FillAffine(pb.first, pb.step, n, buf);
  return {buf, static_cast<size_t>(n)};
}

bool BlockMap::ShiftKey(int64_t head, int64_t qb, int64_t kvb, TileShapeKey* key) const {
  const int64_t plane = PlaneOf(head);
  const PositionBlock& q = q_blocks_[static_cast<size_t>(qb)];
  const PositionBlock& kv = kv_blocks_[static_cast<size_t>(kvb)];
  if (shift_invariant_[static_cast<size_t>(plane)] == 0 || q.explicit_at >= 0 ||
      kv.explicit_at >= 0) {
    return false;
  }
  *key = TileShapeKey{plane,
                      q.first - kv.first,
                      q.step,
                      kv.step,
                      std::min(bq_, sq_ - qb * bq_),
                      std::min(bkv_, skv_ - kvb * bkv_)};
  return true;
}

void BlockMap::FillPartial(int64_t head, int64_t qb, int64_t kvb, uint8_t* out, int64_t ld) const {
  if (!dense_tile_ids_.empty()) {
    const int32_t id =
        dense_tile_ids_[static_cast<size_t>((PlaneOf(head) * nqb_ + qb) * nkvb_ + kvb)];
    if (id >= 0) {
      const UniqueTile& u = dense_tiles_[static_cast<size_t>(id)];
      const uint8_t* src = dense_bytes_.data() + u.offset;
      for (int32_t i = 0; i < u.rows; ++i) {
        std::memcpy(out + i * ld, src + static_cast<size_t>(i) * u.cols,
                    static_cast<size_t>(u.cols));
      }
      return;
    }
  }
  // Affine blocks are materialised into per-thread buffers (grown once).
  thread_local std::vector<int64_t> q_buf, kv_buf;
  if (q_buf.size() < static_cast<size_t>(bq_)) q_buf.resize(static_cast<size_t>(bq_));
  if (kv_buf.size() < static_cast<size_t>(bkv_)) kv_buf.resize(static_cast<size_t>(bkv_));
  FillTileMask(mask_, head, QPositions(qb, q_buf.data()), KvPositions(kvb, kv_buf.data()), out, ld);
}

int64_t BlockMap::Count(BlockKind kind) const { return counts_[static_cast<int>(kind)]; }

int64_t BlockMap::num_unique_partial_tiles() const {
  return static_cast<int64_t>(dense_tiles_.size());
}

size_t BlockMap::memory_bytes() const {
  return sizeof(*this) + q_blocks_.capacity() * sizeof(PositionBlock) +
         kv_blocks_.capacity() * sizeof(PositionBlock) +
         explicit_pos_.capacity() * sizeof(int64_t) + runs_.capacity() * sizeof(BlockRun) +
         row_offsets_.capacity() * sizeof(int64_t) + dense_tile_ids_.capacity() * sizeof(int32_t) +
         dense_tiles_.capacity() * sizeof(UniqueTile) + dense_bytes_.capacity() +
         shift_invariant_.capacity();
}

}  // namespace ringsplash::mask

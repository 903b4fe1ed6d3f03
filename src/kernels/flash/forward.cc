// FlashForward (flash.h): block-sparse online-softmax attention, SPEC §2
// steps 1-3 and 5 (no sinks, but for FlashForwardBf16Out, which applies them
// to each finished row; otherwise the caller adds them once per row).
//
// Short query blocks with GQA/MQA run as a stacked problem (decode/stacked_heads.h)
// whose rows are finished straight into their places (OutRows, Place).
// Tasks are (batch, query head, q block) — split further into ranges of kv
// tiles when there are few (ForwardKvSplits: partial results merged in range
// order), and in decoding-shaped calls taking up to kMaxHeadsTogether heads
// tile by tile (ForwardHeadsTogether: all heads' K/V rows read in one
// sweep) — on the AVX-512 and AVX2 paths, with few rows per kv head, in decoding mode
// (UseDecodeStep, DecodeHeads: the decoding step on K and V in place, no
// tiles). Otherwise each task packs its Q block once as Q^T
// (lanes = queries) and walks the non-empty kv tiles of its block-map row in
// the transposed layout of micro.h:
//   P^T = softmax step of (K Q^T)^T   (fused, lazily rescaled: ForwardTileFn)
//   acc = diag(alpha) acc + P V        (A = P^T read column-major)
// (bf16 inputs on the avx512_bf16 and amx paths: K Q^T on bf16 operands and
// P V with P rounded to bf16 — UseBf16Scores, UseBf16Pv — on vdpbf16ps or
// AMX tiles) and
// finally writes out = acc / l, lse = m + log(l) for its own rows only, so
// results are bitwise independent of the thread count.
//
// K and V rows are read where they are: f32 inputs with unit inner stride
// are used in place (no copy, no per-call memory growth — what lets a long
// ring step stay within its inputs' memory); other inputs, and rows whose
// stride would alias in L1, are packed once per call when tiles are used
// often (dense masks), else copied per thread as tasks use them
// (KvTileCache: sliding windows, short rows). Per-thread scratch lives as
// long as its thread (pool threads persist), so a call allocates nothing per
// tile and, without a per-call copy, nothing of size O(S).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "src/kernels/combine.h"
#include "src/kernels/decode/stacked_heads.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/merge.h"
#include "src/kernels/flash/rows.h"
#include "src/kernels/flash/schedule.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/poison.h"
#include "src/kernels/tiling/pack.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {
namespace {

using mask::BlockKind;
using micro::RoundUp;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The bf16 product path: K Q^T with vdpbf16ps or AMX tiles on bf16 operands
// (bf16 inputs only, so nothing is rounded that was not already bf16); the
// softmax stays f32, and P V rounds P to bf16 where the table can (UseBf16Pv).
bool UseBf16Scores(const FlashParams& p, const micro::MicroKernels& mk) {
  return p.q.dtype == DType::kBF16 && mk.gemm_bf16 != nullptr;
}

// q blocks computed together: each kv tile is fetched (from memory, or
// copied) once for up to kGroup q blocks instead of once per block, so it is
// read from L1/L2 by the other blocks of the group.
constexpr int kGroup = 4;

// Per-thread state of one q block of a group.
struct BlockState {
  AlignedBuffer<float> qt, acc, row_max, row_sum, alpha;
  AlignedBuffer<uint16_t> qt_bf16;

  RowState Rows() { return {acc.data(), row_max.data(), row_sum.data()}; }

  // Room for a block of up to `rows` rows (acc holds only those).
  void Reserve(const Geometry& g, bool bf16, int64_t rows) {
    if (bf16) {
      Grow(qt_bf16, RoundUp(g.d, 2) * g.ld_q);
    } else {
      Grow(qt, g.d * g.ld_q);
    }
    Grow(acc, rows * g.ld_dv);
    Grow(row_max, g.ld_q);
    Grow(row_sum, g.ld_q);
    Grow(alpha, g.ld_q);
  }
};

// The bf16 P V (avx512_bf16 on vdpbf16ps, amx on AMX tiles; bf16 inputs): P
// rounded to bf16 (relative error <= 2^-8 per probability, so |out error| <=
// 2^-8 max|v|: the bf16 tolerance the tests allow, and what FlashAttention
// does on GPUs), V (bf16 already, so exact) packed as pairs once per fetched
// kv tile. P V then runs at the bf16 product rate, well above f32 FMAs on
// both (docs/perf/DESIGN_MEASUREMENTS.md: bf16 P V).
bool UseBf16Pv(const FlashParams& p, const micro::MicroKernels& mk) {
  return UseBf16Scores(p, mk) && mk.pack_pairs_bf16 != nullptr &&
         mk.pack_pairs_from_bf16 != nullptr;
}

// How the call reads K and V (KvRows): with the bf16 P V and bf16 K and V
// of unit inner stride, K in place for the bf16 GEMMs and V pairs packed
// straight from the tensor: no per-call copies, which would be a large part
// of a long sliding-window forward, page faults included
// (docs/perf/DESIGN_MEASUREMENTS.md: bf16 K and V in place).
KvRows::KeyFormat KeyFormatFor(const FlashParams& p, bool bf16, bool bf16_pv) {
  if (!bf16) return KvRows::KeyFormat::kF32;
  const bool tensor_pairs = bf16_pv && p.v.dtype == DType::kBF16 && p.v.stride[3] == 1;
  return tensor_pairs ? KvRows::KeyFormat::kBf16Tiles : KvRows::KeyFormat::kBf16;
}

// Keys of a kv tile as the bf16 P V sees them: whole 16-pair AMX k steps
// (vdpbf16ps multiplies the zero pairs too: the same layout on both paths).
int64_t PvKeys(const Geometry& g) { return RoundUp(g.bkv, 32); }

// Whether x[0, n) holds a NaN or an infinity (exponent bits all ones), in a
// loop the compiler vectorises.
bool AnyNonFiniteF32(const float* x, int64_t n) {
  uint32_t worst = 0;  // the largest |bits| (sign cleared)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    worst = std::max(worst, bits & 0x7fffffffu);
  }
  return worst >= 0x7f800000u;
}

// Per-thread scratch of the task loop.
struct Workspace {
  AlignedBuffer<float> pt, tile;
  AlignedBuffer<uint16_t> p_bf16, v_pairs;  // bf16 P V: P [bq x PvKeys], V pairs
  BlockState blocks[kGroup];
  TileMask mask;
  KvTileCache kv_cache;

  static Workspace& ForThisThread(const Geometry& g, bool bf16, bool bf16_pv) {
    thread_local Workspace ws;
    for (BlockState& s : ws.blocks) s.Reserve(g, bf16, g.bq);
    Grow(ws.pt, g.bkv * g.ld_q);
    Grow(ws.tile, 3 * g.ld_q);
    if (bf16_pv) {
      Grow(ws.p_bf16, g.bq * PvKeys(g));
      Grow(ws.v_pairs, PvKeys(g) * g.ld_dv);
    }
    ws.mask.Reserve(g);
    return ws;
  }
};

// One call's task loop: what its tasks share (read-only, but for the
// non-finite flag, the claims on kv tiles to check and each worker's own
// counters).
class ForwardCall {
 public:
  ForwardCall(const FlashParams& p, const Geometry& g, ThreadPool& pool, bool merge,
              const OutRows& out, float* lse)
      : p_(p),
        g_(g),
        mk_(micro::MicroKernelsFor(p.path)),
        bf16_(UseBf16Scores(p, mk_)),
        bf16_pv_(UseBf16Pv(p, mk_)),
        decode_(UseDecodeStep(p)),
        plan_(p, g, /*by_column=*/false),
        check_(p.non_finite != nullptr),
        kv_checked_(check_ && !decode_ ? static_cast<size_t>(g.b * g.hkv * g.nkvb) : 0),
        merge_(merge),
        stream_(!merge && out.f32 != nullptr && g.b * g.sq * g.h * g.dv >= kStreamMinFloats),
        out_(out),
        lse_(lse),
        pool_(pool),
        wstats_(static_cast<size_t>(pool.size())),
        heads_together_(ForwardHeadsTogether(g)),
        splits_(ForwardKvSplits(g)) {
    if (!decode_) {
      kv_.emplace(p, g, KeyFormatFor(p, bf16_, bf16_pv_), plan_.UsesPerKvTile(), pool,
                  /*tile_cache=*/true, p.non_finite != nullptr ? &mk_ : nullptr);
    }
    if (splits_ > 1) {
      part_out_.resize(static_cast<size_t>(splits_ * g.b * g.sq * g.h * g.dv));
      part_lse_.resize(static_cast<size_t>(splits_ * g.b * g.h * g.sq));
    }
  }

  // Work items are runs of `chunk` consecutive q blocks of one (batch, head),
  // the last runs first (under causal masks they carry the most tiles), each
  // run in ascending groups of kGroup: with per-thread kv tile copies, a
  // thread's next group then finds all but its newest tiles in its cache (LRU
  // order). Items stay small enough for dynamic balancing (>= 8 per worker
  // with tile copies, >= 16 without).
  // Decoding-shaped calls (heads_together_ > 1) instead have items of up to
  // heads_together_ heads of one kv range (Heads), as few heads as it takes
  // for >= 4 items per worker: which heads share an item changes no result
  // (each head's walk is its own), so this may follow the thread count. In
  // decoding mode (decode_, any number of heads) items are rounded up to
  // whole kv groups (DecodeHeads), so each kv head's rows are read by one.
  void Run(KernelStats* stats) {
    const auto workers = static_cast<int64_t>(pool_.size());
    if (heads_together_ > 1 || decode_) {
      const int64_t want_chunks = (4 * workers + g_.b * splits_ - 1) / (g_.b * splits_);
      int64_t per_item =
          std::max<int64_t>(1, std::min(heads_together_, g_.h / std::max<int64_t>(1, want_chunks)));
      // Decoding: whole groups, so a kv head's rows are read by one item.
      if (decode_) per_item = std::min(g_.h, RoundUp(per_item, g_.group));
      const int64_t chunks = (g_.h + per_item - 1) / per_item;
      pool_.ParallelFor(g_.b * chunks * splits_, [&](int64_t item, int worker) {
        const int64_t split = item % splits_, chunk = (item / splits_) % chunks;
        const int64_t h0 = chunk * per_item;
        const int64_t b = item / (splits_ * chunks), h1 = std::min(h0 + per_item, g_.h);
        decode_ ? DecodeHeads(b, h0, h1, split, worker) : Heads(b, h0, h1, split, worker);
      });
      if (splits_ > 1) MergeSplits();
      AddStats(wstats_, stats);
      return;
    }
    const int64_t tasks = g_.b * g_.h * g_.nqb;
    const int64_t chunk = kv_->tile_cache()
                              ? std::clamp<int64_t>(tasks / (8 * workers), 1, 32)
                              : std::clamp<int64_t>(tasks / (16 * workers), 1, kGroup);
    const int64_t runs_per_head = (g_.nqb + chunk - 1) / chunk;
    pool_.ParallelFor(g_.b * g_.h * runs_per_head * splits_, [&](int64_t item, int worker) {
      const int64_t split = item % splits_, run_item = item / splits_;
      const int64_t run_hi = g_.nqb - (run_item % runs_per_head) * chunk;
      for (int64_t qb0 = std::max<int64_t>(0, run_hi - chunk); qb0 < run_hi; qb0 += kGroup) {
        Group(run_item / runs_per_head, qb0, std::min<int64_t>(qb0 + kGroup, run_hi), split,
              worker);
      }
    });
    if (splits_ > 1) MergeSplits();
    AddStats(wstats_, stats);
  }

 private:
  static constexpr int64_t kDone = std::numeric_limits<int64_t>::max();

  // Where one q block of a group stands in its walk over its kv tiles.
  struct Walk {
    std::span<const mask::BlockRun> runs;
    size_t run_at = 0;
    int64_t next = kDone;  // the next kv tile it needs
    int64_t computed = 0;
    micro::TileArgs t;
  };

  // q blocks [qb0, qb1) (at most kGroup) of (batch, head) bh = b * H + h,
  // kv tiles in ascending order, each fetched once for the blocks that use
  // it. Every block still meets its own tiles in ascending order, exactly as
  // alone, so results do not depend on how blocks are grouped.
  // With kv splits, only the tiles of range `split` are walked, and the
  // rows finish into that range's partial result.
  void Group(int64_t bh, int64_t qb0, int64_t qb1, int64_t split, int worker) {
    const int64_t h = bh % g_.h, b = bh / g_.h, kh = h / g_.group;
    const auto nb = static_cast<int>(qb1 - qb0);
    Workspace& ws = Workspace::ForThisThread(g_, bf16_, bf16_pv_);
    WorkerStats& st = wstats_[static_cast<size_t>(worker)];
    const int64_t kv_lo = split * g_.nkvb / splits_, kv_hi = (split + 1) * g_.nkvb / splits_;
    Walk walks[kGroup];
    for (int i = 0; i < nb; ++i) Begin(ws, b, h, qb0 + i, kv_lo, ws.blocks[i], walks[i]);
    while (true) {
      int64_t kvb = kDone;  // the lowest tile any block still needs
      for (int i = 0; i < nb; ++i) kvb = std::min(kvb, walks[i].next);
      if (kvb >= kv_hi) break;
      bool fetched = false;
      KvTile kvt{};
      for (int i = 0; i < nb; ++i) {
        Walk& w = walks[i];
        const int64_t qb = qb0 + i;
        BlockKind map_kind{};
        const BlockKind kind = Next(w, b, qb, kvb, &map_kind);
        if (kind == BlockKind::kEmpty) continue;
        if (!fetched) {  // once per group: check, copy or locate the tile
          fetched = true;
          kvt = Fetch(ws, b, kh, kvb);
          if (bf16_pv_) PackValuePairs(ws, kvt, b, kh, kvb);
        }
        Tile(ws, b, h, qb, kvb, map_kind, kind, kvt, ws.blocks[i], w);
        Count(st, kind, qb, kvb);
      }
    }
    for (int i = 0; i < nb; ++i) {
      Finish(st, walks[i], kv_hi - kv_lo, b, h, qb0 + i, ws.blocks[i], split);
    }
    if (stream_) StreamFence();
  }

  // A computed tile of q block qb in the worker's counters.
  void Count(WorkerStats& st, BlockKind kind, int64_t qb, int64_t kvb) const {
    (kind == BlockKind::kFull ? st.full : st.partial) += 1;
    st.flops += 2 * g_.QRows(qb) * g_.KvRows(kvb) * (g_.d + g_.dv);
  }

  // Block (b, h, qb) after its walk over `tiles` kv tiles: counted, and its
  // rows finished into range `split`'s partial result (with kv splits) or
  // their places.
  void Finish(WorkerStats& st, const Walk& w, int64_t tiles, int64_t b, int64_t h, int64_t qb,
              BlockState& s, int64_t split) {
    st.computed += w.computed;
    st.skipped += tiles - w.computed;
    if (splits_ > 1) {
      const OutRows part{.f32 = part_out_.data() + split * g_.b * g_.sq * g_.h * g_.dv,
                         .bf16 = {},
                         .overflow = nullptr};
      FinishRows(g_, b, h, qb, g_.QRows(qb), s.Rows(), /*merge=*/false, /*stream=*/false, part,
                 part_lse_.data() + split * g_.b * g_.h * g_.sq);
    } else {
      FinishRows(g_, b, h, qb, g_.QRows(qb), s.Rows(), merge_, stream_, out_, lse_);
    }
  }

  // Heads [h0, h1) of batch b, each with its one q block (decoding-shaped
  // calls: ForwardHeadsTogether), kv tile by kv tile: every head's part of
  // a tile before the next tile, so the K/V rows of all the heads are read
  // in one sweep. Each head still meets its own tiles in ascending order,
  // as in Group. With kv splits, only the tiles of range `split`.
  void Heads(int64_t b, int64_t h0, int64_t h1, int64_t split, int worker) {
    Workspace& ws = Workspace::ForThisThread(g_, bf16_, bf16_pv_);
    thread_local std::vector<BlockState> states;
    thread_local std::vector<Walk> walks;
    const int64_t n = h1 - h0, m = g_.QRows(0);
    if (static_cast<int64_t>(states.size()) < n) states.resize(static_cast<size_t>(n));
    if (static_cast<int64_t>(walks.size()) < n) walks.resize(static_cast<size_t>(n));
    WorkerStats& st = wstats_[static_cast<size_t>(worker)];
    const int64_t kv_lo = split * g_.nkvb / splits_, kv_hi = (split + 1) * g_.nkvb / splits_;
    for (int64_t i = 0; i < n; ++i) {
      BlockState& s = states[static_cast<size_t>(i)];
      s.Reserve(g_, bf16_, m);
      Begin(ws, b, h0 + i, 0, kv_lo, s, walks[static_cast<size_t>(i)]);
    }
    for (int64_t kvb = kv_lo; kvb < kv_hi; ++kvb) {
      int64_t fetched_kh = -1;  // heads of one group share their kv head's tile
      KvTile kvt{};
      for (int64_t i = 0; i < n; ++i) {
        Walk& w = walks[static_cast<size_t>(i)];
        BlockKind map_kind{};
        const BlockKind kind = Next(w, b, 0, kvb, &map_kind);
        if (kind == BlockKind::kEmpty) continue;
        const int64_t h = h0 + i, kh = h / g_.group;
        if (kh != fetched_kh) {
          fetched_kh = kh;
          kvt = Fetch(ws, b, kh, kvb);
          if (bf16_pv_) PackValuePairs(ws, kvt, b, kh, kvb);
        }
        Tile(ws, b, h, 0, kvb, map_kind, kind, kvt, states[static_cast<size_t>(i)], w);
        Count(st, kind, 0, kvb);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto at = static_cast<size_t>(i);
      Finish(st, walks[at], kv_hi - kv_lo, b, h0 + i, 0, states[at], split);
    }
    if (stream_) StreamFence();
  }

  // Heads [h0, h1) of batch b in decoding mode (decode_: m = Sq rows per
  // head, one q block): per kv tile, one mk_.decode_step over the rows of
  // the heads that compute it (entry i * m + r: row r of head h0 + i, so the
  // rows of one kv head are adjacent and the step takes them together), on
  // K and V rows in place. As in Heads, each head meets its own tiles in
  // ascending order, so which heads share an item changes no result. With
  // the non-finite check, q rows are checked as they are widened, K rows by
  // the step (a non-finite product q . k, before scale and soft cap) and V
  // rows by the accumulators (a NaN or infinity in any V row of a computed
  // tile leaves acc non-finite).
  void DecodeHeads(int64_t b, int64_t h0, int64_t h1, int64_t split, int worker) {
    Workspace& ws = Workspace::ForThisThread(g_, bf16_, bf16_pv_);
    thread_local std::vector<BlockState> states;
    thread_local std::vector<Walk> walks;
    thread_local std::vector<micro::DecodeHead> live;
    thread_local AlignedBuffer<uint16_t> allowed;  // [n * m][words]: key bits of partial tiles
    const int64_t n = h1 - h0, m = g_.QRows(0), words = (g_.bkv + 15) / 16;
    const auto un = static_cast<size_t>(n);
    if (states.size() < un) states.resize(un);
    if (walks.size() < un) walks.resize(un);
    if (live.size() < un * static_cast<size_t>(m)) live.resize(un * static_cast<size_t>(m));
    Grow(allowed, n * m * words);
    WorkerStats& st = wstats_[static_cast<size_t>(worker)];
    const int64_t kv_lo = split * g_.nkvb / splits_, kv_hi = (split + 1) * g_.nkvb / splits_;
    const bool bf16 = p_.q.dtype == DType::kBF16;
    const int64_t elem = bf16 ? 2 : 4;
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) {
      BlockState& s = states[static_cast<size_t>(i)];
      s.Reserve(g_, /*bf16=*/false, m);  // qt: d * ld_q >= m * d floats
      for (int64_t r = 0; r < m; ++r) {
        bad |= QueryRow(b, r, h0 + i, s.qt.data() + r * g_.d);
        s.row_max[r] = kNegInf;
        s.row_sum[r] = 0.0f;
        std::fill_n(s.acc.data() + r * g_.ld_dv, g_.dv, 0.0f);
      }
      Start(walks[static_cast<size_t>(i)], h0 + i, 0, kv_lo);
    }
    const auto* k_base = static_cast<const char*>(p_.k.data);
    const auto* v_base = static_cast<const char*>(p_.v.data);
    for (int64_t kvb = kv_lo; kvb < kv_hi; ++kvb) {
      const int64_t keys = g_.KvRows(kvb);
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) {
        Walk& w = walks[static_cast<size_t>(i)];
        BlockKind map_kind{};
        const BlockKind kind = Next(w, b, 0, kvb, &map_kind);
        if (kind == BlockKind::kEmpty) continue;
        const int64_t h = h0 + i, kh = h / g_.group;
        const uint16_t* tile = nullptr;  // the tile's mask bits (partial tiles)
        if (kind == BlockKind::kPartial) {
          ws.mask.Fill(plan_, mk_, map_kind, h, b, 0, kvb);
          tile = ws.mask.bits();
        }
        BlockState& s = states[static_cast<size_t>(i)];
        for (int64_t r = 0; r < m; ++r) {
          micro::DecodeHead& dh = live[static_cast<size_t>(count++)];
          dh.q = s.qt.data() + r * g_.d;
          dh.k = k_base + p_.k.Offset(b, kvb * g_.bkv, kh, 0) * elem;
          dh.v = v_base + p_.v.Offset(b, kvb * g_.bkv, kh, 0) * elem;
          dh.allowed = nullptr;
          if (tile != nullptr) {  // row r's bits of the transposed tile mask
            uint16_t* bits = allowed.data() + (i * m + r) * words;
            std::fill_n(bits, words, uint16_t{0});
            const int64_t ldm = ws.mask.ldm();
            for (int64_t j = 0; j < keys; ++j) {
              const unsigned bit = (tile[j * ldm + r / 16] >> (r % 16)) & 1u;
              bits[j / 16] |= static_cast<uint16_t>(bit << (j % 16));
            }
            dh.allowed = bits;
          }
          dh.acc = s.acc.data() + r * g_.ld_dv;
          dh.row_max = s.row_max.data() + r;
          dh.row_sum = s.row_sum.data() + r;
        }
        Count(st, kind, 0, kvb);
        ++w.computed;
      }
      if (count == 0) continue;
      const micro::DecodeArgs args{.heads = count,
                                   .keys = keys,
                                   .d = g_.d,
                                   .dv = g_.dv,
                                   .ldk = p_.k.stride[1],
                                   .ldv = p_.v.stride[1],
                                   .bf16 = bf16,
                                   .scale = p_.scale,
                                   .softcap = p_.softcap,
                                   .head = live.data()};
      bad |= mk_.decode_step(args);
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto at = static_cast<size_t>(i);
      if (check_) {
        for (int64_t r = 0; r < m; ++r) {
          bad |= AnyNonFiniteF32(states[at].acc.data() + r * g_.ld_dv, g_.dv);
        }
      }
      Finish(st, walks[at], kv_hi - kv_lo, b, h0 + i, 0, states[at], split);
    }
    if (check_ && bad) p_.non_finite->store(true);
    if (stream_) StreamFence();
  }

  // Query row (b, i, h) as f32 into q[0, d); whether it holds a NaN or an
  // infinity (exponent bits all ones). Rows of unit stride take loops the
  // compiler vectorises: at short Skv the rows of a decoding call are a
  // visible part of it (docs/perf/DESIGN_MEASUREMENTS.md: query
  // rows of decoding calls).
  bool QueryRow(int64_t b, int64_t i, int64_t h, float* q) const {
    const int64_t at = p_.q.Offset(b, i, h, 0), step = p_.q.stride[3];
    if (p_.q.dtype == DType::kBF16) {
      const uint16_t* src = static_cast<const uint16_t*>(p_.q.data) + at;
      uint16_t worst = 0;  // the largest |bits| (sign cleared)
      for (int64_t c = 0; c < g_.d; ++c) {
        const uint16_t x = step == 1 ? src[c] : src[c * step];
        q[c] = BF16ToF32(x);
        worst = std::max<uint16_t>(worst, x & 0x7fffu);
      }
      return worst >= 0x7f80u;
    }
    const float* src = static_cast<const float*>(p_.q.data) + at;
    for (int64_t c = 0; c < g_.d; ++c) q[c] = step == 1 ? src[c] : src[c * step];
    return AnyNonFiniteF32(q, g_.d);
  }

  // Each row's partial results of the kv ranges merged in range order
  // (MergePartial), then emitted as FinishRows would have.
  void MergeSplits() {
    const int64_t out_elems = g_.b * g_.sq * g_.h * g_.dv, lse_elems = g_.b * g_.h * g_.sq;
    pool_.ParallelFor(g_.b * g_.h, [&](int64_t bh, int) {
      const int64_t h = bh % g_.h, b = bh / g_.h;
      for (int64_t row = 0; row < g_.sq; ++row) {
        const int64_t at = ((b * g_.sq + row) * g_.h + h) * g_.dv;
        const int64_t li = (b * g_.h + h) * g_.sq + row;
        float* acc = part_out_.data() + at;
        float* acc_lse = part_lse_.data() + li;
        for (int64_t c = 1; c < splits_; ++c) {
          MergePartial(RowShape{1, 1, 1, g_.dv}, acc, acc_lse,
                       part_out_.data() + c * out_elems + at,
                       part_lse_.data() + c * lse_elems + li);
        }
        EmitRow(g_, b, row, h, acc, *acc_lse, merge_, out_, lse_, /*in_place=*/false);
      }
    });
  }

  // Packs q block qb as Q^T, checks its rows, resets its softmax state and
  // points its walk at its first kv tile.
  void Begin(Workspace& ws, int64_t b, int64_t h, int64_t qb, int64_t kv_lo, BlockState& s,
             Walk& w) {
    const int64_t m = g_.QRows(qb);
    bool bad = false;  // a NaN or inf in the block's q rows
    if (bf16_) {
      PackTransposedPairsBf16(mk_, p_.q, b, h, qb * g_.bq, m, s.qt_bf16.data(), g_.ld_q);
      bad = check_ && AnyNonFinite(p_.q, b, qb * g_.bq, m, h, &mk_);
    } else {
      bad = PackTransposed(mk_, p_.q, b, h, qb * g_.bq, m, s.qt.data(), g_.ld_q);
    }
    if (check_ && bad) p_.non_finite->store(true);
    for (int64_t r = 0; r < m; ++r) {
      s.row_max[r] = kNegInf;
      s.row_sum[r] = 0.0f;
    }
    micro::TileArgs& t = w.t;
    t.queries = m;
    t.d = g_.d;
    t.qt = s.qt.data();
    t.ldq = g_.ld_q;
    t.pt = ws.pt.data();
    t.ldp = g_.ld_q;
    t.scale = p_.scale;
    t.softcap = p_.softcap;
    t.scratch = ws.tile.data();
    Start(w, h, qb, kv_lo);
  }

  // Points the walk of (head h, q block qb) at its first kv tile from kv_lo.
  void Start(Walk& w, int64_t h, int64_t qb, int64_t kv_lo) const {
    w.runs = plan_.map().Runs(h, qb);
    w.run_at = 0;
    while (w.run_at < w.runs.size() && w.runs[w.run_at].end <= kv_lo) ++w.run_at;
    w.next = w.run_at < w.runs.size() ? std::max<int64_t>(w.runs[w.run_at].begin, kv_lo) : kDone;
    w.computed = 0;
  }

  // Whether walk w (q block qb of batch b) computes kv tile kvb: if kvb is
  // its next tile, moves it past the tile and returns the tile's refined
  // kind (kEmpty: skipped; *map_kind is the block map's kind, which mask
  // tiles are built from), else kEmpty.
  BlockKind Next(Walk& w, int64_t b, int64_t qb, int64_t kvb, BlockKind* map_kind) const {
    if (w.next != kvb) return BlockKind::kEmpty;
    *map_kind = w.runs[w.run_at].kind;
    Advance(w, kvb);
    return plan_.Refine(*map_kind, b, qb, kvb);
  }

  // Moves a walk past kv tile kvb (its current one).
  static void Advance(Walk& w, int64_t kvb) {
    if (kvb + 1 < w.runs[w.run_at].end) {
      w.next = kvb + 1;
    } else {
      ++w.run_at;
      w.next = w.run_at < w.runs.size() ? w.runs[w.run_at].begin : kDone;
    }
  }

  // K and V rows of kv tile (b, kh, kvb), checked for NaN/Inf when the call
  // asks (KvTileCache::GetChecked).
  KvTile Fetch(Workspace& ws, int64_t b, int64_t kh, int64_t kvb) {
    return ws.kv_cache.GetChecked(*kv_, mk_, p_, kv_checked_, b, kh, kvb);
  }

  // V of the fetched tile as bf16 pairs for the tile P V: from the bf16
  // tensor itself (KeyFormat::kBf16Tiles), else from the tile's f32 rows.
  void PackValuePairs(Workspace& ws, const KvTile& kvt, int64_t b, int64_t kh, int64_t kvb) {
    const int64_t n = g_.KvRows(kvb);
    if (kvt.v == nullptr) {
      const auto* v = static_cast<const uint16_t*>(p_.v.data) + p_.v.Offset(b, kvb * g_.bkv, kh, 0);
      mk_.pack_pairs_from_bf16(n, g_.dv, v, p_.v.stride[1], ws.v_pairs.data(), g_.ld_dv);
    } else {
      mk_.pack_pairs_bf16(n, g_.dvp, kvt.v, kvt.ldv, ws.v_pairs.data(), g_.ld_dv);
    }
  }

  // One online-softmax step of q block qb over kv tile kvb (refined kind
  // `kind`, partial or full): P^T from the fused score kernel, then
  // acc = diag(alpha) acc + P V (the first tile initialises acc).
  void Tile(Workspace& ws, int64_t b, int64_t h, int64_t qb, int64_t kvb, BlockKind map_kind,
            BlockKind kind, const KvTile& kvt, BlockState& s, Walk& w) {
    const int64_t m = g_.QRows(qb), n = g_.KvRows(kvb);
    micro::TileArgs& t = w.t;
    t.keys = n;
    t.mask = nullptr;
    micro::KRanges key_ranges;  // of each query: P V skips the keys it may not see
    if (kind == BlockKind::kPartial) {
      ws.mask.Fill(plan_, mk_, map_kind, h, b, qb, kvb);
      t.mask = ws.mask.bits();
      t.ldm = ws.mask.ldm();
      key_ranges = ws.mask.keys_of_query();
    }
    if (bf16_) {
      Bf16Scores(m, n, kv_->KeysBf16(b, h / g_.group, kvb), s, t,
                 t.mask != nullptr ? ws.mask.queries_of_key() : micro::KRanges{});
      if (bf16_pv_) {  // P straight to bf16 rows for the tile P V
        mk_.softmax_bf16(t, s.row_max.data(), s.row_sum.data(), s.alpha.data(), ws.p_bf16.data(),
                         PvKeys(g_));
      } else {
        mk_.softmax_columns(t, s.row_max.data(), s.row_sum.data(), s.alpha.data());
      }
    } else {
      t.k = kvt.k;
      t.ldk = kvt.ldk;
      mk_.forward_tile(t, s.row_max.data(), s.row_sum.data(), s.alpha.data());
    }
    // A block with no tile never reads acc.
    if (bf16_pv_) {
      Bf16Pv(ws, m, n, s, w.computed > 0, key_ranges);
    } else {
      mk_.gemm_f32_ranges(m, g_.dvp, n, t.pt, 1, t.ldp, kvt.v, kvt.ldv, s.acc.data(), g_.ld_dv,
                          s.alpha.data(), w.computed > 0, key_ranges);
    }
    ++w.computed;
  }

  // S^T = K Q^T of the tile into t.pt (n keys x RoundUp(m, kVec) queries).
  // In a partial tile (`queries`: each key's allowed queries) each panel of
  // kBf16Panel keys computes only the columns, in whole kBf16Panel blocks, that some
  // key of it may see: the rest of t.pt keeps stale values there, which
  // every softmax step masks out before use (to -inf or a zero P), so P
  // and the state are those of the full product. A diagonal or window-edge
  // tile computes 10 of its 16 32 x 32 blocks.
  void Bf16Scores(int64_t m, int64_t n, const uint16_t* k_rows, const BlockState& s,
                  const micro::TileArgs& t, micro::KRanges queries) {
    const int64_t d2 = RoundUp(g_.d, 2), mp = RoundUp(m, micro::kVec);
    const int64_t ldk = kv_->ldk_bf16();
    if (queries.lo == nullptr) {
      mk_.gemm_bf16(n, mp, d2 / 2, k_rows, ldk, s.qt_bf16.data(), g_.ld_q, t.pt, t.ldp, nullptr,
                    false);
      return;
    }
    for (int64_t j = 0; j < n; j += kBf16Panel) {
      const int64_t rows = std::min(kBf16Panel, n - j);
      const auto [lo, hi] = RangeSpan(queries, j, j + rows, kBf16Panel);
      if (hi == lo) continue;
      mk_.gemm_bf16(rows, std::min(hi, mp) - lo, d2 / 2, k_rows + j * ldk, ldk,
                    s.qt_bf16.data() + 2 * lo, g_.ld_q, t.pt + j * t.ldp + lo, t.ldp, nullptr,
                    false);
    }
  }

  // acc = diag(alpha) acc + P V on bf16 pairs: P is ws.p_bf16 (bf16 rows,
  // written by softmax_bf16), V is ws.v_pairs (packed by Group). The tile
  // GEMM cannot scale C, so rows whose alpha is not 1 (exact steps only:
  // lazy steps leave alpha at 1) are scaled first. In a partial tile (`keys`:
  // each query's allowed keys, where P is not zero) per panel of queries
  // only the keys some query of it may see (GemmBf16Panels).
  void Bf16Pv(Workspace& ws, int64_t m, int64_t n, BlockState& s, bool accumulate,
              micro::KRanges keys) {
    const int64_t ldp = PvKeys(g_);
    if (accumulate) {
      for (int64_t i = 0; i < m; ++i) {
        float* row = s.acc.data() + i * g_.ld_dv;
        if (s.alpha[i] != 1.0f) ScaleRow(row, row, g_.dvp, s.alpha[i], /*stream=*/false);
      }
    }
    GemmBf16Panels(mk_, m, g_.dvp, RoundUp(n, 32) / 2, ws.p_bf16.data(), ldp, ws.v_pairs.data(),
                   g_.ld_dv, s.acc.data(), g_.ld_dv, accumulate, keys);
  }

  const FlashParams& p_;
  const Geometry& g_;
  const micro::MicroKernels& mk_;
  const bool bf16_;
  const bool bf16_pv_;
  // Decoding mode (UseDecodeStep): items of whole kv groups (DecodeHeads),
  // each step on K and V in place by mk_.decode_step; kv_ is then not made
  // (nothing packed).
  const bool decode_;
  const TilePlan plan_;
  std::optional<const KvRows> kv_;
  // FlashParams::non_finite: kv tiles read in place are checked once each
  // (kv_checked_: (b, kv head, kvb) claimed by its first user); q rows by
  // their own task.
  const bool check_;
  std::vector<std::atomic<bool>> kv_checked_;
  const bool merge_;
  const bool stream_;  // outputs larger than the caches are written past them (ScaleRow)
  const OutRows out_;
  float* lse_;
  ThreadPool& pool_;
  std::vector<WorkerStats> wstats_;
  const int64_t heads_together_;  // ForwardHeadsTogether; 1: work items of one head
  // kv splits (ForwardKvSplits): range c holds kv tiles [c nkvb / splits_,
  // (c + 1) nkvb / splits_); with more than one, the partial results
  // [split][B, Sq, H, Dv] and [split][B, H, Sq].
  const int64_t splits_;
  std::vector<float> part_out_, part_lse_;
};

void Forward(const FlashParams& p, ThreadPool& pool, bool merge, const OutRows& out, float* lse,
             KernelStats* stats) {
  const Geometry g = Geometry::Of(p);
  if (g.b == 0 || g.sq == 0 || g.h == 0) return;
  if (g.skv == 0) {  // nothing to attend to: every row is empty (out 0, lse -inf)
    if (merge) return;
    std::vector<float> zero(static_cast<size_t>(g.dv));
    for (int64_t b = 0; b < g.b; ++b) {
      for (int64_t i = 0; i < g.sq; ++i) {
        for (int64_t h = 0; h < g.h; ++h) {
          std::fill(zero.begin(), zero.end(), 0.0f);
          EmitRow(g, b, i, h, zero.data(), kNegInf, /*merge=*/false, out, lse, /*in_place=*/false);
        }
      }
    }
    return;
  }
  if (UseStackedHeads(p)) {
    // The stacked problem, its rows finished straight into their places.
    const StackedHeads st(p, pool);
    OutRows stacked = out;
    stacked.stack_group = st.group();
    stacked.sq = g.sq;
    stacked.h = g.h;
    Forward(st.params(), pool, merge, stacked, lse, stats);
    return;
  }
  ForwardCall(p, g, pool, merge, out, lse).Run(stats);
}

}  // namespace

void FlashForward(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                  KernelStats* stats) {
  Forward(p, pool, /*merge=*/false, OutRows{.f32 = out, .bf16 = {}, .overflow = nullptr}, lse,
          stats);
}

bool FlashForwardBf16Out(const FlashParams& p, ThreadPool& pool, const Bf16Out& out, float* lse,
                         KernelStats* stats) {
  std::atomic<bool> overflow{false};
  Forward(p, pool, /*merge=*/false, OutRows{.bf16 = out, .overflow = &overflow}, lse, stats);
  return !overflow.load();
}

void FlashForwardMerge(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                       KernelStats* stats) {
  Forward(p, pool, /*merge=*/true, OutRows{.f32 = out, .bf16 = {}, .overflow = nullptr}, lse,
          stats);
}

}  // namespace ringsplash::kernels

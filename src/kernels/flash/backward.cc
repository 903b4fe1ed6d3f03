// FlashBackward (flash.h): gradients of block-sparse attention, SPEC §2.
//
// Every tile (q block of query head h, kv block kvb) is processed in the
// transposed layout of micro.h: one fused micro-kernel gives
//   P^T  = exp(x - lse)                      from K Q^T
//   dS^T = scale P^T (dP^T - delta) [* cap'] from dP^T = V dO^T
// and three products consume them:
//   dV_kvb += P^T dO,  dK_kvb += dS^T Q,  dQ_qb += dS K  (dS = dS^T read column-major).
// That is the five products the FLOP count of the CLI assumes (2.5 x forward).
// On the avx512_bf16 and amx paths with bf16 q, k, v and dout all five run
// on bf16 operands (Context::tile_products; vdpbf16ps, or AMX tiles): S^T
// and dP^T from the bf16 inputs (exact products, f32 sums), which the
// kernel's epilogues then read from memory;
// dV, dK and dQ with P^T and dS^T rounded to bf16 (relative error <= 2^-8
// each, as FlashAttention's bf16 backward on GPUs; f32 sums).
//
// Determinism without float atomics: every accumulator is owned by one task
// and summed in a fixed order. A kv head's group of query heads is split
// into BackwardHeadParts(g) consecutive parts (a function of the shapes
// only, > 1 when there are few (batch, kv head) pairs: MQA, small batches);
//   dK/dV tile of kvb, for each part in turn: the first product written,
//     then += over (query head of the part, q block) ascending, then added
//     to dk_acc / dv_acc (part 0's written there when the call writes its
//     accumulators: GradientSums);
//   dQ tile of (h, qb): likewise over kvb ascending, then added to (or
//     written into) dq_acc.
// Two schedules realise exactly these operation sequences:
//   one pass: tasks (batch, kv head, part) walk groups of up to four kv
//     blocks (KvBlocks), then the part's heads, then q blocks, each q tile
//     serving the group's kv tiles in kvb order, with the dQ tiles in
//     per-worker scratch (DqTiles: taken at a q tile's first kv tile, added
//     after its last); each tile computed once. Part 0 adds its dK/dV
//     tiles to the accumulators as it goes; later parts keep theirs in
//     per-part buffers, added in part order once every task is done (with
//     one worker, which runs the parts in order, they add theirs as they go
//     too);
//   two passes (when there are still too few tasks to keep the threads
//     busy): tasks (batch, kv head, kvb) for dK/dV, then tasks (batch, head,
//     q block) for dQ, recomputing P^T and dS^T with the same kernel on the
//     same inputs (bit-identical).
// So results are bitwise the same for every thread count.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/rows.h"
#include "src/kernels/flash/schedule.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/pack.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {
namespace {

using mask::BlockKind;
using micro::RoundUp;

// The q-side operands of one (b, h, q block): the B operands of the five
// products. As f32: Q^T [d][ld_q] and dO^T [dv][ld_q] (scores), Q [bq][ld_d]
// and dO [bq][ld_dv] (dK and dV). With tile products instead (the f32
// pointers null) as bf16 pairs (micro.h PackPairsBf16Fn): Q^T and dO^T
// paired over d (ld ld_q), Q and dO paired over queries (ld ld_d, ld_dv).
struct QTile {
  const float* qt = nullptr;
  const float* dot = nullptr;
  const float* q = nullptr;
  const float* dout = nullptr;
  const uint16_t* qt_pairs = nullptr;
  const uint16_t* dot_pairs = nullptr;
  const uint16_t* q_pairs = nullptr;
  const uint16_t* do_pairs = nullptr;
};

// Where the q-side tiles come from: packed once per call, or — when every kv
// tile needs few q tiles and its successor needs mostly the same ones (a
// sliding window: 5 of them, 4 shared) — packed per thread as the tasks use
// them (TileCopies in the workspace). Packing everything up front takes as
// much fresh, page-faulting memory as q and dO twice over (576 MiB at S =
// 32768, H = 8, D = 128), which cost a window backward more than the copies.
class QSide {
 public:
  static constexpr int64_t kBudgetBytes = 2 << 20;  // per-thread copies: L2-sized

  QSide(const FlashParams& p, const TensorView& dout, const Geometry& g,
        const micro::MicroKernels& mk, const TilePlan& cols, ThreadPool& pool, bool pairs)
      : p_(p), dout_(dout), g_(g), mk_(mk), id_(NewCallId()) {
    qt_elems_ = g.d * g.ld_q;
    dot_elems_ = g.dv * g.ld_q;
    q_elems_ = g.bq * g.ld_d;
    do_elems_ = g.bq * g.ld_dv;
    f32_elems_ = qt_elems_ + dot_elems_ + q_elems_ + do_elems_;
    elems_ = f32_elems_;
    if (pairs) {
      // Only bf16 pairs are kept (k padded to whole 16-pair steps; two per
      // float); the f32 copies they are made from are per-thread scratch.
      qt_pair_elems_ = RoundUp(g.d, 32) * g.ld_q / 2;
      dot_pair_elems_ = RoundUp(g.dv, 32) * g.ld_q / 2;
      q_pair_elems_ = RoundUp(g.bq, 32) * g.ld_d / 2;
      elems_ = qt_pair_elems_ + dot_pair_elems_ + q_pair_elems_ + RoundUp(g.bq, 32) * g.ld_dv / 2;
    }
    // Per thread when the q tiles of any kv tile (over the heads of one part
    // of its group: BackwardHeadParts), plus the one its successor adds, fit
    // in the copies.
    const int64_t slots = TileCopies::Slots(elems_, kBudgetBytes);
    const int64_t per_part = g.group / BackwardHeadParts(g);
    int64_t most = 0;
    for (int64_t h0 = 0; h0 < g.h; h0 += per_part) {
      for (int64_t kvb = 0; kvb < g.nkvb; ++kvb) {
        int64_t used = 0;
        for (int64_t h = h0; h < h0 + per_part; ++h) {
          for (const mask::BlockRun& run : cols.map().Runs(h, kvb)) used += run.end - run.begin;
        }
        most = std::max(most, used);
      }
    }
    per_thread_ = most + 1 <= slots;
    if (per_thread_) return;
    const int64_t tiles = g.b * g.h * g.nqb;
    all_.Resize(static_cast<size_t>(tiles * elems_));
    pool.ParallelFor(tiles, [&](int64_t t, int) {
      const int64_t qb = t % g.nqb, h = (t / g.nqb) % g.h, b = t / (g.nqb * g.h);
      Pack(b, h, qb, all_.data() + t * elems_);
    });
  }

  // The tile of (b, h, qb); from `copies` (this thread's) in per-thread
  // mode, valid until the next Get with the same copies.
  QTile Get(int64_t b, int64_t h, int64_t qb, TileCopies& copies) const {
    const int64_t t = (b * g_.h + h) * g_.nqb + qb;
    const float* base = nullptr;
    if (per_thread_) {
      bool hit = false;
      float* copy = copies.Find(id_, t, elems_, kBudgetBytes, &hit);
      if (!hit) Pack(b, h, qb, copy);
      base = copy;
    } else {
      base = all_.data() + t * elems_;
    }
    if (qt_pair_elems_ == 0) {
      return {.qt = base,
              .dot = base + qt_elems_,
              .q = base + qt_elems_ + dot_elems_,
              .dout = base + qt_elems_ + dot_elems_ + q_elems_};
    }
    auto pairs = [&](int64_t offset) { return reinterpret_cast<const uint16_t*>(base + offset); };
    const int64_t q_at = qt_pair_elems_ + dot_pair_elems_;
    return {.qt_pairs = pairs(0),
            .dot_pairs = pairs(qt_pair_elems_),
            .q_pairs = pairs(q_at),
            .do_pairs = pairs(q_at + q_pair_elems_)};
  }

 private:
  void Pack(int64_t b, int64_t h, int64_t qb, float* dst) const {
    const int64_t m = g_.QRows(qb), r0 = qb * g_.bq;
    const bool pairs = qt_pair_elems_ > 0;
    thread_local AlignedBuffer<float> scratch;
    float* f32 = pairs ? Grow(scratch, f32_elems_) : dst;
    float* qt = f32;
    float* dot = qt + qt_elems_;
    float* q = dot + dot_elems_;
    float* dout = q + q_elems_;
    // FlashParams::non_finite: the transpose notes NaN/Inf in the q rows it
    // packs (dout and out were checked by the caller's delta: a NaN or
    // infinity in either makes that row's delta one).
    if (PackTransposed(mk_, p_.q, b, h, r0, m, qt, g_.ld_q) && p_.non_finite != nullptr) {
      p_.non_finite->store(true);
    }
    PackTransposed(mk_, dout_, b, h, r0, m, dot, g_.ld_q);
    PackRowsF32(Slab{&p_.q, b, h, r0, m, g_.d}, q, g_.ld_d, m);
    PackRowsF32(Slab{&dout_, b, h, r0, m, g_.dv}, dout, g_.ld_dv, m);
    if (!pairs) return;
    // From the f32 copies just made: bf16 inputs, so exact.
    const int64_t mp = RoundUp(m, micro::kVec);
    auto* out = reinterpret_cast<uint16_t*>(dst);
    const int64_t q_at = 2 * (qt_pair_elems_ + dot_pair_elems_);
    mk_.pack_pairs_bf16(g_.d, mp, qt, g_.ld_q, out, g_.ld_q);
    mk_.pack_pairs_bf16(g_.dv, mp, dot, g_.ld_q, out + 2 * qt_pair_elems_, g_.ld_q);
    mk_.pack_pairs_bf16(m, g_.dp, q, g_.ld_d, out + q_at, g_.ld_d);
    mk_.pack_pairs_bf16(m, g_.dvp, dout, g_.ld_dv, out + q_at + 2 * q_pair_elems_, g_.ld_dv);
  }

  const FlashParams& p_;
  const TensorView& dout_;
  const Geometry& g_;
  const micro::MicroKernels& mk_;
  uint64_t id_;
  int64_t qt_elems_ = 0, dot_elems_ = 0, q_elems_ = 0, do_elems_ = 0, f32_elems_ = 0, elems_ = 0;
  int64_t qt_pair_elems_ = 0, dot_pair_elems_ = 0, q_pair_elems_ = 0;
  bool per_thread_ = false;
  AlignedBuffer<float> all_;
};

// At most this many kv tiles are computed together by one pass over the q
// tiles (KvBlocks): every q tile fetched serves all of them, so the q side
// (Q^T, dO^T, Q, dO and the dQ tile: ~350 KiB per (head, q block) at D =
// 128) streams through the caches once per group instead of once per kv
// tile. One tile at a time, the q side of a long query range (22 MiB per
// kv tile and head at 8192 queries) outgrows the L3 share of a core and
// the backward slows per FLOP (docs/perf/DESIGN_MEASUREMENTS.md:
// kv groups in the backward). The group's K, V, dK and dV (~290 KiB per
// tile at D = 128) stay in L2.
constexpr int64_t kKvGroup = 4;

// Per-thread scratch of one tile, or of a group of kv tiles.
struct Workspace {
  AlignedBuffer<float> pt, ds, deriv, tile, dq;
  AlignedBuffer<float> dk, dv;  // [kKvGroup][bkv][ld_d] and [kKvGroup][bkv][ld_dv]
  // bf16 products (avx512_bf16 and amx paths, bf16 q, k, v and dout), the
  // q side's pairs being in QTile and K's bf16 rows in KvRows: V rows as bf16 (ld
  // RoundUp(Dv, 2)) and K paired over keys (ld ld_d) once per kv tile of a
  // group (slot = its place in the group); P^T and dS^T as bf16 rows (ld
  // ld_q) and dS as bf16 rows (ld RoundUp(bkv, 32)) per tile.
  AlignedBuffer<uint16_t> v_bf16[kKvGroup], k_pairs[kKvGroup];
  AlignedBuffer<uint16_t> pt_bf16, ds_bf16, dsq_bf16;
  TileMask mask;
  TileCopies q_copies;   // QSide's per-thread mode
  KvTileCache kv_cache;  // where K and V are read (this thread's copies, or the call's)
  bool masked = false;   // whether the tile in pt / ds has a mask (then `mask` holds it)

  static Workspace& ForThisThread(const Geometry& g, bool capped, bool tile_products) {
    thread_local Workspace ws;
    if (tile_products) {
      for (int64_t slot = 0; slot < kKvGroup; ++slot) {
        Grow(ws.v_bf16[slot], g.bkv * RoundUp(g.dv, 2));
        Grow(ws.k_pairs[slot], RoundUp(g.bkv, 32) * g.ld_d);
      }
      Grow(ws.pt_bf16, g.bkv * g.ld_q);
      Grow(ws.ds_bf16, g.bkv * g.ld_q);
      Grow(ws.dsq_bf16, g.bq * RoundUp(g.bkv, 32));
    }
    Grow(ws.pt, g.bkv * g.ld_q);
    Grow(ws.ds, g.bkv * g.ld_q);
    if (capped) Grow(ws.deriv, g.bkv * g.ld_q);
    Grow(ws.tile, 3 * g.ld_q);
    Grow(ws.dk, kKvGroup * g.bkv * g.ld_d);
    Grow(ws.dv, kKvGroup * g.bkv * g.ld_dv);
    Grow(ws.dq, g.bq * g.ld_d);
    ws.mask.Reserve(g);
    return ws;
  }
};

// Everything a tile needs besides its indices.
struct Context {
  const FlashParams& p;
  const Geometry& g;
  const micro::MicroKernels& mk;
  const TilePlan& plan;
  const QSide& qs;
  const KvRows& kv;
  const float* lse;
  const float* delta;
  // All five products on bf16 operands (GemmBf16Fn: vdpbf16ps or AMX
  // tiles; q, k, v and dout bf16, so the bf16 operands made from them are
  // exact; K read through KvRows::KeysBf16): S^T = K Q^T and dP^T = V dO^T stored, then
  // BackwardTile's epilogues; dV, dK and dQ from bf16 P^T and dS^T
  // (GradOperandsBf16Fn).
  bool tile_products;
  // FlashParams::non_finite: the tiles claimed by the first user that checks
  // them in place (KvTileCache::GetChecked).
  std::vector<std::atomic<bool>>* kv_checked;

  // K and V rows of kv tile (b, kh, kvb), through the thread's copies.
  KvTile Fetch(Workspace& ws, int64_t b, int64_t kh, int64_t kvb) const {
    return ws.kv_cache.GetChecked(kv, mk, p, *kv_checked, b, kh, kvb);
  }
};

// Whether this call computes its products on tiles (Context).
bool TileProducts(const FlashParams& p, const TensorView& dout, const micro::MicroKernels& mk) {
  return p.q.dtype == DType::kBF16 && dout.dtype == DType::kBF16 && mk.pack_pairs_bf16 != nullptr &&
         mk.pack_pairs_from_bf16 != nullptr && mk.grad_operands_bf16 != nullptr &&
         mk.gemm_bf16 != nullptr;
}

// Which products' operands a tile is for: the one-pass schedule uses all
// three gradient products, its two-pass fallback dV and dK, then dQ.
enum class Uses { kAll, kKv, kQ };

// The kv tile's bf16 operands for tile products (once per kv tile and task)
// into the workspace's slot `slot`: V rows read from the bf16 input, and K
// pairs from K's bf16 rows when dQ is computed.
void KvToBf16(const Context& c, int64_t b, int64_t kh, int64_t kvb, Uses uses, Workspace& ws,
              int64_t slot) {
  if (!c.tile_products) return;
  const Geometry& g = c.g;
  const int64_t n = g.KvRows(kvb);
  PackRowsBf16(Slab{&c.p.v, b, kh, kvb * g.bkv, n, g.dv}, ws.v_bf16[slot].data(), RoundUp(g.dv, 2));
  if (uses != Uses::kKv) {
    c.mk.pack_pairs_from_bf16(n, g.d, c.kv.KeysBf16(b, kh, kvb), c.kv.ldk_bf16(),
                              ws.k_pairs[slot].data(), g.ld_d);
  }
}

// P^T and dS^T of tile (b, h, qb, kvb) into ws.pt / ws.ds (with tile
// products also as the bf16 operands `uses` needs); returns its kind
// (kEmpty: nothing computed). With tile products, the kv tile's bf16
// operands must be in ws's slot `slot` already, or (convert_kv) are made
// there once the tile is known not to be empty.
BlockKind TileProbs(const Context& c, const QTile& qs, const KvTile& kvt, BlockKind map_kind,
                    int64_t b, int64_t h, int64_t qb, int64_t kvb, Workspace& ws, Uses uses,
                    int64_t slot, bool convert_kv = false) {
  const Geometry& g = c.g;
  const BlockKind kind = c.plan.Refine(map_kind, b, qb, kvb);
  if (kind == BlockKind::kEmpty) return kind;
  if (convert_kv) KvToBf16(c, b, h / g.group, kvb, uses, ws, slot);
  const int64_t row = (b * g.h + h) * g.sq + qb * g.bq;
  micro::BackwardTileArgs a;
  micro::TileArgs& t = a.t;
  t.keys = g.KvRows(kvb);
  t.queries = g.QRows(qb);
  t.d = g.d;
  t.k = kvt.k;
  t.ldk = kvt.ldk;
  t.qt = qs.qt;
  t.ldq = g.ld_q;
  t.pt = ws.pt.data();
  t.ldp = g.ld_q;
  ws.masked = kind == BlockKind::kPartial;
  if (ws.masked) {
    ws.mask.Fill(c.plan, c.mk, map_kind, h, b, qb, kvb);
    t.mask = ws.mask.bits();
    t.ldm = ws.mask.ldm();
  }
  t.scale = c.p.scale;
  t.softcap = c.p.softcap;
  t.scratch = ws.tile.data();
  a.dv = g.dv;
  a.v = kvt.v;
  a.ldv = kvt.ldv;
  a.dot = qs.dot;
  a.lse = c.lse + row;
  a.delta = c.delta + row;
  a.ds = ws.ds.data();
  a.deriv = ws.deriv.data();
  if (c.tile_products) {
    const int64_t mp = RoundUp(t.queries, micro::kVec);
    const int64_t d2 = RoundUp(g.d, 2), dv2 = RoundUp(g.dv, 2);
    c.mk.gemm_bf16(t.keys, mp, d2 / 2, c.kv.KeysBf16(b, h / g.group, kvb), c.kv.ldk_bf16(),
                   qs.qt_pairs, g.ld_q, t.pt, t.ldp, nullptr, false);
    c.mk.gemm_bf16(t.keys, mp, dv2 / 2, ws.v_bf16[slot].data(), dv2, qs.dot_pairs, g.ld_q, a.ds,
                   t.ldp, nullptr, false);
    a.products_stored = true;
  }
  c.mk.backward_tile(a);
  if (c.tile_products) {
    const bool kv = uses != Uses::kQ, q = uses != Uses::kKv;
    c.mk.grad_operands_bf16(t.keys, t.queries, t.pt, a.ds, t.ldp, kv ? ws.pt_bf16.data() : nullptr,
                            kv ? ws.ds_bf16.data() : nullptr, g.ld_q,
                            q ? ws.dsq_bf16.data() : nullptr, RoundUp(g.bkv, 32));
  }
  return kind;
}

// dV += P^T dO and dK += dS^T Q for the tile in ws (rows = its keys); with
// accumulate = false, dV = P^T dO and dK = dS^T Q (a tile's first sum: no
// zeroed tile to read).
void AccumulateKv(const Context& c, const QTile& qs, int64_t qb, int64_t kvb, float* dk, float* dv,
                  const Workspace& ws, bool accumulate) {
  const Geometry& g = c.g;
  const int64_t m = g.QRows(qb), n = g.KvRows(kvb);
  // In a partial tile, key j's rows of P^T and dS^T are zero outside the
  // queries that may see it (masked lanes are written as 0): the products
  // skip those (docs/perf/DESIGN_MEASUREMENTS.md: masked ranges
  // in the backward), the bf16 ones per panel of keys (GemmBf16Panels).
  const micro::KRanges ranges = ws.masked ? ws.mask.queries_of_key() : micro::KRanges();
  if (c.tile_products) {
    // k over the tile's mp query lanes: pairs of P^T / dS^T rows with those
    // of Q / dO (zero beyond m on both sides).
    const int64_t k2 = RoundUp(m, micro::kVec) / 2;
    GemmBf16Panels(c.mk, n, g.dvp, k2, ws.pt_bf16.data(), g.ld_q, qs.do_pairs, g.ld_dv, dv, g.ld_dv,
                   accumulate, ranges);
    GemmBf16Panels(c.mk, n, g.dp, k2, ws.ds_bf16.data(), g.ld_q, qs.q_pairs, g.ld_d, dk, g.ld_d,
                   accumulate, ranges);
    return;
  }
  c.mk.gemm_f32_ranges(n, g.dvp, m, ws.pt.data(), g.ld_q, 1, qs.dout, g.ld_dv, dv, g.ld_dv, nullptr,
                       accumulate, ranges);
  c.mk.gemm_f32_ranges(n, g.dp, m, ws.ds.data(), g.ld_q, 1, qs.q, g.ld_d, dk, g.ld_d, nullptr,
                       accumulate, ranges);
}

// dQ += dS K for the tile in ws (rows = its queries; K's pairs in slot
// `slot`); with accumulate = false, dQ = dS K.
void AccumulateQ(const Context& c, const KvTile& kvt, int64_t qb, int64_t kvb, int64_t slot,
                 float* dq, const Workspace& ws, bool accumulate) {
  const Geometry& g = c.g;
  // Query i's column of dS^T is zero outside the keys it may see.
  const micro::KRanges ranges = ws.masked ? ws.mask.keys_of_query() : micro::KRanges();
  if (c.tile_products) {
    GemmBf16Panels(c.mk, g.QRows(qb), g.dp, RoundUp(g.KvRows(kvb), 2) / 2, ws.dsq_bf16.data(),
                   RoundUp(g.bkv, 32), ws.k_pairs[slot].data(), g.ld_d, dq, g.ld_d, accumulate,
                   ranges);
    return;
  }
  c.mk.gemm_f32_ranges(g.QRows(qb), g.dp, g.KvRows(kvb), ws.ds.data(), 1, g.ld_q, kvt.k, kvt.ldk,
                       dq, g.ld_d, nullptr, accumulate, ranges);
}

void CountTile(BlockKind kind, const Geometry& g, int64_t m, int64_t n, WorkerStats& st) {
  ++st.computed;
  (kind == BlockKind::kFull ? st.full : st.partial) += 1;
  // S, dP, dV, dK, dQ.
  st.flops += 2 * m * n * (3 * g.d + 2 * g.dv);
}

// The accumulators (FlashBackward) and what is done with their contents.
// Their tiles are summed in scratch first and added (or written) once: the
// products adding straight into rows Heads x D apart ran 2-6 % slower
// (docs/perf/DESIGN_MEASUREMENTS.md: gradient tiles summed in scratch).
struct Accumulators {
  float* dq;  // [B, Sq, H, D]
  float* dk;  // [B, Skv, Hkv, D]
  float* dv;  // [B, Skv, Hkv, Dv]
  GradientSums sums;
  // Written values go out with non-temporal stores (ScaleRow): accumulators
  // larger than the caches are not read again by the kernel.
  bool stream;
};

// `cols` values of `rows` rows of a tile (ld_src apart) into rows of an
// accumulator (ld_dst apart): added, or with add = false written (streamed
// with `stream`); a null tile (nothing computed) leaves them, or without add
// zeroes them.
void AddRows(float* dst, int64_t ld_dst, const float* tile, int64_t ld_src, int64_t rows,
             int64_t cols, bool add, bool stream) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * ld_dst;
    if (tile == nullptr) {
      if (!add) std::fill_n(d, cols, 0.0f);
      continue;
    }
    const float* t = tile + r * ld_src;
    if (add) {
      for (int64_t x = 0; x < cols; ++x) d[x] += t[x];
    } else {
      ScaleRow(d, t, cols, 1.0f, stream);
    }
  }
}

// The dK/dV tiles of (b, kh, kvb) into the accumulators; add: false for
// the first part's tiles when the call writes its accumulators.
void AddKvTile(const Geometry& g, int64_t b, int64_t kh, int64_t kvb, const float* dk,
               const float* dv, const Accumulators& acc, bool add) {
  const int64_t row = (b * g.skv + kvb * g.bkv) * g.hkv + kh;
  AddRows(acc.dk + row * g.d, g.hkv * g.d, dk, g.ld_d, g.KvRows(kvb), g.d, add, acc.stream);
  AddRows(acc.dv + row * g.dv, g.hkv * g.dv, dv, g.ld_dv, g.KvRows(kvb), g.dv, add, acc.stream);
}

// The dQ tile of (b, h, qb) (null: no kv tile wrote one) into dq.
void AddQTile(const Geometry& g, int64_t b, int64_t h, int64_t qb, const float* dq,
              const Accumulators& acc) {
  const int64_t row = (b * g.sq + qb * g.bq) * g.h + h;
  AddRows(acc.dq + row * g.d, g.h * g.d, dq, g.ld_d, g.QRows(qb), g.d, acc.sums.add_dq, acc.stream);
}

// One worker's dQ tiles of the one-pass schedule, [bq][ld_d] each: a q tile
// takes one when its first kv tile is computed and gives it back once the
// last kv tile its row of the mask has (`Last`) is done, so a sliding window
// keeps the few tiles it is working on (in L2) instead of a whole task's
// (16 MiB at S = 32768, D = 128: fresh memory every call, page faults, and
// read again from DRAM at the end: ~10 % of a window backward).
class DqTiles {
 public:
  // For task (b, kh, part) of `heads` query heads from h0: the last kv
  // block of every (head, q block) in the column map (-1: none).
  void Start(const Geometry& g, const TilePlan& cols, int64_t h0, int64_t heads) {
    h0_ = h0;
    nqb_ = g.nqb;
    last_.assign(static_cast<size_t>(heads * g.nqb), -1);
    slot_.assign(static_cast<size_t>(heads * g.nqb), kNone);
    open_.clear();
    for (int64_t h = h0; h < h0 + heads; ++h) {
      for (int64_t kvb = 0; kvb < g.nkvb; ++kvb) {
        for (const mask::BlockRun& run : cols.map().Runs(h, kvb)) {
          for (int64_t qb = run.begin; qb < run.end; ++qb) last_[At(h, qb)] = kvb;
        }
      }
    }
  }
  // The tile of (h, qb) and whether it was written before (else the caller
  // writes it whole).
  float* Get(const Geometry& g, int64_t h, int64_t qb, bool* written) {
    int32_t& slot = slot_[At(h, qb)];
    assert(slot != kDone && "a q tile computed after its last kv block");
    *written = slot != kNone;
    if (slot == kNone) {
      if (free_.empty()) {
        free_.push_back(static_cast<int32_t>(tiles_.size()));
        tiles_.emplace_back();
        // Not zeroed: a tile's first product writes it whole.
        tiles_.back().Resize(static_cast<size_t>(g.bq * g.ld_d), /*zero=*/false);
      }
      slot = free_.back();
      free_.pop_back();
      open_.push_back(At(h, qb));
    }
    return tiles_[static_cast<size_t>(slot)].data();
  }
  // Adds every open tile whose last kv block is below `kvb_end` to the
  // accumulator and frees its slot; all of them with kvb_end = nkvb.
  void Finish(const Geometry& g, int64_t b, int64_t kvb_end, const Accumulators& acc) {
    size_t kept = 0;
    for (const size_t at : open_) {
      if (last_[at] >= kvb_end) {
        open_[kept++] = at;
        continue;
      }
      const int64_t h = h0_ + static_cast<int64_t>(at) / nqb_, qb = static_cast<int64_t>(at) % nqb_;
      int32_t& slot = slot_[at];
      AddQTile(g, b, h, qb, tiles_[static_cast<size_t>(slot)].data(), acc);
      free_.push_back(slot);
      slot = kDone;
    }
    open_.resize(kept);
  }
  // Zeroes (unless dQ is added to) the tiles no kv tile wrote.
  void ZeroUnwritten(const Geometry& g, int64_t b, const Accumulators& acc) const {
    if (acc.sums.add_dq) return;
    for (size_t at = 0; at < slot_.size(); ++at) {
      if (slot_[at] != kNone) continue;
      AddQTile(g, b, h0_ + static_cast<int64_t>(at) / nqb_, static_cast<int64_t>(at) % nqb_,
               nullptr, acc);
    }
  }

 private:
  static constexpr int32_t kNone = -1, kDone = -2;
  size_t At(int64_t h, int64_t qb) const { return static_cast<size_t>((h - h0_) * nqb_ + qb); }

  int64_t h0_ = 0, nqb_ = 0;
  std::vector<int64_t> last_;
  std::vector<int32_t> slot_;  // per (head, q block): a tile, kNone, or kDone (added)
  std::vector<size_t> open_;   // (head, q block)s holding a tile
  std::vector<int32_t> free_;
  std::vector<AlignedBuffer<float>> tiles_;
};

// dK/dV of the nk <= kKvGroup kv tiles (b, kh, kvb0 + i) over the query
// heads of `part` (per_part heads) and every q block of the column map, into
// dk[i] [bkv][ld_d] and dv[i] [bkv][ld_dv] (written by their first computed
// tile, zeroed at the end if none was; no pass over memory to zero every
// tile first: a sliding window's backward spent 3 % of its time in that
// memset, docs/perf/PHASES.md); `on_tile(h, qb,
// kvb, slot, kind, kv tile)` runs after each computed tile (the one-pass
// schedule adds its dQ there). Each q tile is fetched once and computed
// against every tile of the group that needs it, in kv order; a kv tile
// still sees its (head, q block) pairs in ascending order, and a q tile its
// kv tiles, so the sums are the same as one kv tile at a time. With tile
// products the kv tiles' bf16 operands are made first (into slots 0 .. nk-1)
// unless `kv_ready` (the previous part of the same tiles made them). nk must
// not exceed KvTileCache::Together: the group's tiles are all read at once.
template <class OnTile>
void KvBlocks(const Context& c, const TilePlan& cols, int64_t b, int64_t kh, int64_t kvb0,
              int64_t nk, int64_t part, int64_t per_part, bool kv_ready, Uses uses, Workspace& ws,
              WorkerStats& st, float* const* dk, float* const* dv, OnTile&& on_tile) {
  const Geometry& g = c.g;
  KvTile kvt[kKvGroup];
  bool written[kKvGroup] = {};
  for (int64_t i = 0; i < nk; ++i) {
    const int64_t kvb = kvb0 + i;
    kvt[i] = c.Fetch(ws, b, kh, kvb);
    if (!kv_ready) KvToBf16(c, b, kh, kvb, uses, ws, i);
  }
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  const int64_t h0 = kh * g.group + part * per_part;
  int64_t computed = 0;
  for (int64_t h = h0; h < h0 + per_part; ++h) {
    // Each tile's runs (sorted, disjoint), walked together in q-block order.
    std::span<const mask::BlockRun> runs[kKvGroup];
    size_t at[kKvGroup] = {};
    int64_t qb = kNone;
    for (int64_t i = 0; i < nk; ++i) {
      runs[i] = cols.map().Runs(h, kvb0 + i);
      if (!runs[i].empty()) qb = std::min<int64_t>(qb, runs[i].front().begin);
    }
    while (qb != kNone) {
      QTile qs;
      bool fetched = false;
      int64_t next = kNone;
      for (int64_t i = 0; i < nk; ++i) {
        const std::span<const mask::BlockRun> r = runs[i];
        size_t& a = at[i];
        while (a < r.size() && r[a].end <= qb) ++a;
        if (a == r.size()) continue;
        if (r[a].begin <= qb) {
          if (!fetched) {
            qs = c.qs.Get(b, h, qb, ws.q_copies);
            fetched = true;
          }
          const int64_t kvb = kvb0 + i;
          const BlockKind kind = TileProbs(c, qs, kvt[i], r[a].kind, b, h, qb, kvb, ws, uses, i);
          if (kind != BlockKind::kEmpty) {
            AccumulateKv(c, qs, qb, kvb, dk[i], dv[i], ws, /*accumulate=*/written[i]);
            written[i] = true;
            on_tile(h, qb, kvb, i, kind, kvt[i]);
            ++computed;
          }
        }
        next = std::min(next, std::max<int64_t>(qb + 1, r[a].begin));
      }
      qb = next;
    }
  }
  for (int64_t i = 0; i < nk; ++i) {
    if (written[i]) continue;
    const int64_t n = g.KvRows(kvb0 + i);
    std::memset(dk[i], 0, static_cast<size_t>(n * g.ld_d) * sizeof(float));
    std::memset(dv[i], 0, static_cast<size_t>(n * g.ld_dv) * sizeof(float));
  }
  st.skipped += nk * per_part * g.nqb - computed;
}

}  // namespace

void FlashBackward(const FlashParams& p, ThreadPool& pool, const TensorView& dout, const float* lse,
                   const float* delta, float* dq_acc, float* dk_acc, float* dv_acc,
                   const GradientSums& sums, KernelStats* stats) {
  const Geometry g = Geometry::Of(p);
  const Accumulators acc{
      dq_acc, dk_acc, dv_acc, sums,
      g.b * (g.sq * g.h * g.d + g.skv * g.hkv * (g.d + g.dv)) >= kStreamMinFloats};
  if (g.b == 0 || g.sq == 0 || g.h == 0 || g.skv == 0) {
    if (!sums.add_dq) std::fill_n(dq_acc, g.b * g.sq * g.h * g.d, 0.0f);
    if (!sums.add_dkv) {
      std::fill_n(dk_acc, g.b * g.skv * g.hkv * g.d, 0.0f);
      std::fill_n(dv_acc, g.b * g.skv * g.hkv * g.dv, 0.0f);
    }
    return;
  }
  const micro::MicroKernels& mk = micro::MicroKernelsFor(p.path);
  const bool capped = p.softcap > 0.0f;
  const bool tile_products = TileProducts(p, dout, mk);
  const TilePlan cols(p, g, /*by_column=*/true);
  const QSide qs(p, dout, g, mk, cols, pool, tile_products);
  // With tile products K is read as bf16 (in place where it can be) and V
  // from the tensor: no f32 copies of either.
  const KvRows kv(
      p, g, tile_products ? KvRows::KeyFormat::kBf16Tiles : KvRows::KeyFormat::kF32Padded,
      cols.UsesPerKvTile(), pool, /*tile_cache=*/true, p.non_finite != nullptr ? &mk : nullptr);
  std::vector<std::atomic<bool>> kv_checked(
      p.non_finite != nullptr ? static_cast<size_t>(g.b * g.hkv * g.nkvb) : 0);
  std::vector<WorkerStats> wstats(static_cast<size_t>(pool.size()));

  const int64_t parts = BackwardHeadParts(g);
  const int64_t per_part = g.group / parts;
  if (BackwardInOnePass(g, pool.size())) {
    const Context c{p, g, mk, cols, qs, kv, lse, delta, tile_products, &kv_checked};
    std::vector<DqTiles> dq(static_cast<size_t>(pool.size()));
    // dK/dV tiles of parts 1 .. parts-1 per (b, kh): [nkvb][bkv][ld_d] and
    // [nkvb][bkv][ld_dv] each (part 0 adds its tiles to the accumulators).
    // One worker runs the tasks in order, parts of a (b, kh) one after the
    // other, so every part adds its tiles as it goes: the same sums in the
    // same order, without the buffers.
    const bool in_order = pool.size() == 1;
    const int64_t group = std::min(kKvGroup, KvTileCache::Together(g));
    const int64_t tile_elems = g.bkv * (g.ld_d + g.ld_dv);
    const int64_t later_parts = in_order ? 0 : g.b * g.hkv * (parts - 1);
    AlignedBuffer<float> later;
    later.Resize(static_cast<size_t>(later_parts * g.nkvb * tile_elems), /*zero=*/false);
    auto later_tile = [&](int64_t b, int64_t kh, int64_t part, int64_t kvb) {
      return later.data() +
             (((b * g.hkv + kh) * (parts - 1) + part - 1) * g.nkvb + kvb) * tile_elems;
    };
    pool.ParallelFor(g.b * g.hkv * parts, [&](int64_t task, int worker) {
      const int64_t part = task % parts, kh = (task / parts) % g.hkv, b = task / (parts * g.hkv);
      Workspace& ws = Workspace::ForThisThread(g, capped, tile_products);
      WorkerStats& st = wstats[static_cast<size_t>(worker)];
      // dQ tiles are written by their first computed tile (no zeroing pass)
      // and added to dq_acc once complete.
      DqTiles& dqs = dq[static_cast<size_t>(worker)];
      const int64_t h0 = kh * g.group + part * per_part;
      dqs.Start(g, cols, h0, per_part);
      const bool direct = part == 0 || in_order;
      for (int64_t kvb0 = 0; kvb0 < g.nkvb; kvb0 += group) {
        const int64_t nk = std::min(group, g.nkvb - kvb0);
        float* dk[kKvGroup];
        float* dv[kKvGroup];
        for (int64_t i = 0; i < nk; ++i) {
          dk[i] = direct ? ws.dk.data() + i * g.bkv * g.ld_d : later_tile(b, kh, part, kvb0 + i);
          dv[i] = direct ? ws.dv.data() + i * g.bkv * g.ld_dv : dk[i] + g.bkv * g.ld_d;
        }
        KvBlocks(c, cols, b, kh, kvb0, nk, part, per_part, /*kv_ready=*/false, Uses::kAll, ws, st,
                 dk, dv,
                 [&](int64_t h, int64_t qb, int64_t kvb, int64_t slot, BlockKind kind,
                     const KvTile& kvt) {
                   bool seen = false;
                   float* tile = dqs.Get(g, h, qb, &seen);
                   AccumulateQ(c, kvt, qb, kvb, slot, tile, ws, /*accumulate=*/seen);
                   CountTile(kind, g, g.QRows(qb), g.KvRows(kvb), st);
                 });
        dqs.Finish(g, b, kvb0 + nk, acc);
        if (!direct) continue;
        // Part 0 writes (or adds to) the accumulators; with one worker the
        // later parts, run right after it, add to them.
        for (int64_t i = 0; i < nk; ++i) {
          AddKvTile(g, b, kh, kvb0 + i, dk[i], dv[i], acc, part > 0 || sums.add_dkv);
        }
      }
      dqs.ZeroUnwritten(g, b, acc);
      if (acc.stream) StreamFence();
    });
    if (parts > 1 && !in_order) {
      pool.ParallelFor(g.b * g.hkv * g.nkvb, [&](int64_t task, int) {
        const int64_t kvb = task % g.nkvb, kh = (task / g.nkvb) % g.hkv;
        const int64_t b = task / (g.nkvb * g.hkv);
        for (int64_t part = 1; part < parts; ++part) {
          const float* dk = later_tile(b, kh, part, kvb);
          AddKvTile(g, b, kh, kvb, dk, dk + g.bkv * g.ld_d, acc, /*add=*/true);
        }
      });
    }
    AddStats(wstats, stats);
    return;
  }

  {  // Pass 1: dK, dV (tile counts as in the forward, FLOPs of its four products).
    const Context c{p, g, mk, cols, qs, kv, lse, delta, tile_products, &kv_checked};
    pool.ParallelFor(g.b * g.hkv * g.nkvb, [&](int64_t task, int worker) {
      const int64_t kvb = task % g.nkvb, kh = (task / g.nkvb) % g.hkv;
      const int64_t b = task / (g.nkvb * g.hkv);
      Workspace& ws = Workspace::ForThisThread(g, capped, tile_products);
      WorkerStats& st = wstats[static_cast<size_t>(worker)];
      float* dk = ws.dk.data();
      float* dv = ws.dv.data();
      for (int64_t part = 0; part < parts; ++part) {
        KvBlocks(c, cols, b, kh, kvb, 1, part, per_part, /*kv_ready=*/part > 0, Uses::kKv, ws, st,
                 &dk, &dv,
                 [&](int64_t, int64_t qb, int64_t, int64_t, BlockKind kind, const KvTile&) {
                   CountTile(kind, g, g.QRows(qb), g.KvRows(kvb), st);
                   st.flops -= 2 * g.QRows(qb) * g.KvRows(kvb) * g.d;  // no dQ product here
                 });
        AddKvTile(g, b, kh, kvb, dk, dv, acc, /*add=*/part > 0 || sums.add_dkv);
      }
      if (acc.stream) StreamFence();
    });
  }
  {  // Pass 2: dQ (recomputes S and dP: FLOPs only).
    const TilePlan rows(p, g, /*by_column=*/false);
    const Context c{p, g, mk, rows, qs, kv, lse, delta, tile_products, &kv_checked};
    pool.ParallelFor(g.b * g.h * g.nqb, [&](int64_t task, int worker) {
      const int64_t qb = g.nqb - 1 - task % g.nqb;
      const int64_t h = (task / g.nqb) % g.h, b = task / (g.nqb * g.h);
      Workspace& ws = Workspace::ForThisThread(g, capped, tile_products);
      WorkerStats& st = wstats[static_cast<size_t>(worker)];
      float* dq = ws.dq.data();
      bool written = false;
      const QTile qs = c.qs.Get(b, h, qb, ws.q_copies);
      for (const mask::BlockRun& run : rows.map().Runs(h, qb)) {
        for (int64_t kvb = run.begin; kvb < run.end; ++kvb) {
          const KvTile kvt = c.Fetch(ws, b, h / g.group, kvb);
          if (TileProbs(c, qs, kvt, run.kind, b, h, qb, kvb, ws, Uses::kQ, /*slot=*/0,
                        /*convert_kv=*/true) == BlockKind::kEmpty) {
            continue;
          }
          AccumulateQ(c, kvt, qb, kvb, /*slot=*/0, dq, ws, /*accumulate=*/written);
          written = true;
          st.flops += 2 * g.QRows(qb) * g.KvRows(kvb) * (2 * g.d + g.dv);
        }
      }
      AddQTile(g, b, h, qb, written ? dq : nullptr, acc);
      if (acc.stream) StreamFence();
    });
  }
  AddStats(wstats, stats);
}

}  // namespace ringsplash::kernels

// FlashForward (flash.h): block-sparse online-softmax attention, SPEC §2
// steps 1-3 and 5 (no sinks; the caller adds them once per row).
//
// Tasks are (batch, query head, q block); each packs its Q block once as Q^T
// (lanes = queries) and walks the non-empty kv tiles of its block-map row in
// the transposed layout of micro.h:
//   P^T = softmax step of (K Q^T)^T   (fused, lazily rescaled: ForwardTileFn)
//   acc = diag(alpha) acc + P V        (A = P^T read column-major)
// and finally writes out = acc / l, lse = m + log(l) for its own rows only, so
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
#include <immintrin.h>  // SSE2 non-temporal stores (x86-64 baseline)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "src/kernels/combine.h"
#include "src/kernels/flash.h"
#include "src/kernels/flash_common.h"
#include "src/kernels/flash_merge.h"
#include "src/kernels/micro.h"
#include "src/kernels/poison.h"
#include "src/kernels/tile_pack.h"

namespace ringsplash::kernels {
namespace {

using mask::BlockKind;
using micro::RoundUp;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kStreamMinFloats = int64_t{4} << 20;  // 16 MiB of output

// The bf16 product path: K Q^T with vdpbf16ps on bf16 operands (bf16 inputs
// only, so nothing is rounded that was not already bf16); the softmax and
// P V stay f32.
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
};

// Per-thread scratch of the task loop.
struct Workspace {
  AlignedBuffer<float> pt, tile;
  BlockState blocks[kGroup];
  TileMask mask;
  KvTileCache kv_cache;

  static Workspace& ForThisThread(const Geometry& g, bool bf16) {
    thread_local Workspace ws;
    const int64_t d2 = RoundUp(g.d, 2);
    for (BlockState& s : ws.blocks) {
      if (bf16) {
        Grow(s.qt_bf16, d2 * g.ld_q);
      } else {
        Grow(s.qt, g.d * g.ld_q);
      }
      Grow(s.acc, g.bq * g.ld_dv);
      Grow(s.row_max, g.ld_q);
      Grow(s.row_sum, g.ld_q);
      Grow(s.alpha, g.ld_q);
    }
    Grow(ws.pt, g.bkv * g.ld_q);
    Grow(ws.tile, 3 * g.ld_q);
    ws.mask.Reserve(g);
    return ws;
  }
};

// dst[c] = src[c] * s for c < n. With `stream`, 16-byte aligned rows are
// written with non-temporal stores: a large output is written once and not
// read back by the kernel, so fetching its lines first (read for ownership)
// would double the memory traffic of the last step (~5 % of a sliding-window
// forward at S = 32768). The caller orders them with a fence (_mm_sfence).
void ScaleRow(float* dst, const float* src, int64_t n, float s, bool stream) {
  if (stream && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const __m128 vs = _mm_set1_ps(s);
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) _mm_stream_ps(dst + c, _mm_mul_ps(_mm_loadu_ps(src + c), vs));
    for (; c < n; ++c) dst[c] = src[c] * s;
    return;
  }
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c] * s;
}

// out = acc / l and lse = m + log(l) for the task's rows (0 and -inf for a
// row without keys); with `merge`, that partial result is merged into the
// rows' existing (out, lse) by MergePartial, one row at a time.
void FinishRows(const Geometry& g, int64_t b, int64_t h, int64_t qb, int64_t m, BlockState& ws,
                bool merge, bool stream, float* out, float* lse) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = qb * g.bq + i;
    float* o = out + ((b * g.sq + row) * g.h + h) * g.dv;
    float* l_out = lse + (b * g.h + h) * g.sq + row;
    // The row's partial result; in place of its accumulator when merging.
    float* part = merge ? ws.acc.data() + i * g.ld_dv : o;
    float part_lse = kNegInf;
    const float l = ws.row_sum[i];
    if (l > 0.0f) {
      const float* a = ws.acc.data() + i * g.ld_dv;
      const float inv = 1.0f / l;
      ScaleRow(part, a, g.dv, inv, stream && !merge);
      part_lse = ws.row_max[i] + std::log(l);
    } else {
      std::memset(part, 0, static_cast<size_t>(g.dv) * sizeof(float));
    }
    if (merge) {
      MergePartial(RowShape{1, 1, 1, g.dv}, o, l_out, part, &part_lse);
    } else {
      *l_out = part_lse;
    }
  }
}

void Forward(const FlashParams& p, ThreadPool& pool, bool merge, float* out, float* lse,
             KernelStats* stats) {
  const Geometry g = Geometry::Of(p);
  if (g.b == 0 || g.sq == 0 || g.h == 0) return;
  if (g.skv == 0) {  // nothing to attend to: every row is empty
    if (merge) return;
    std::memset(out, 0, static_cast<size_t>(g.b * g.sq * g.h * g.dv) * sizeof(float));
    for (int64_t i = 0; i < g.b * g.h * g.sq; ++i) lse[i] = kNegInf;
    return;
  }
  const micro::MicroKernels& mk = micro::MicroKernelsFor(p.path);
  const bool bf16 = UseBf16Scores(p, mk);
  const TilePlan plan(p, g, /*by_column=*/false);
  const KvRows kv(p, g, bf16 ? KvRows::KeyFormat::kBf16 : KvRows::KeyFormat::kF32,
                  plan.UsesPerKvTile(), pool, /*tile_cache=*/true);
  std::vector<WorkerStats> wstats(static_cast<size_t>(pool.size()));
  // FlashParams::non_finite: each kv tile (b, kv head, kvb) is checked by the
  // first task that computes it (with per-thread tile copies: by every copy,
  // in cache); q rows by their own task.
  const bool check = p.non_finite != nullptr;
  std::vector<std::atomic<bool>> kv_checked(check ? static_cast<size_t>(g.b * g.hkv * g.nkvb) : 0);

  const int64_t d2 = RoundUp(g.d, 2);
  // Outputs larger than the caches are written past them (ScaleRow).
  const bool stream = !merge && g.b * g.sq * g.h * g.dv >= kStreamMinFloats;
  // q blocks [qb0, qb1) (at most kGroup) of (batch, head) bh = b * H + h,
  // kv tiles in ascending order, each fetched once for the blocks that use
  // it. Every block still meets its own tiles in ascending order, exactly as
  // alone, so results do not depend on how blocks are grouped.
  auto Group = [&](int64_t bh, int64_t qb0, int64_t qb1, int worker) {
    const int64_t h = bh % g.h;
    const int64_t b = bh / g.h;
    const int64_t kh = h / g.group;
    const auto nb = static_cast<int>(qb1 - qb0);
    Workspace& ws = Workspace::ForThisThread(g, bf16);
    WorkerStats& st = wstats[static_cast<size_t>(worker)];
    constexpr int64_t kDone = std::numeric_limits<int64_t>::max();
    std::span<const mask::BlockRun> runs[kGroup];
    size_t run_at[kGroup];
    int64_t next[kGroup], computed[kGroup];
    micro::TileArgs t[kGroup];
    for (int i = 0; i < nb; ++i) {
      const int64_t qb = qb0 + i, m = g.QRows(qb);
      BlockState& s = ws.blocks[i];
      if (bf16) {
        PackTransposedBf16Pairs(Slab{&p.q, b, h, qb * g.bq, m, g.d}, s.qt_bf16.data(), g.ld_q);
      } else {
        PackTransposed(mk, p.q, b, h, qb * g.bq, m, s.qt.data(), g.ld_q);
      }
      if (check && AnyNonFinite(p.q, b, qb * g.bq, m, h)) p.non_finite->store(true);
      for (int64_t r = 0; r < m; ++r) {
        s.row_max[r] = kNegInf;
        s.row_sum[r] = 0.0f;
      }
      t[i].queries = m;
      t[i].d = g.d;
      t[i].qt = s.qt.data();
      t[i].ldq = g.ld_q;
      t[i].pt = ws.pt.data();
      t[i].ldp = g.ld_q;
      t[i].scale = p.scale;
      t[i].softcap = p.softcap;
      t[i].scratch = ws.tile.data();
      runs[i] = plan.map().Runs(h, qb);
      run_at[i] = 0;
      next[i] = runs[i].empty() ? kDone : runs[i][0].begin;
      computed[i] = 0;
    }
    while (true) {
      const int64_t kvb = *std::min_element(next, next + nb);
      if (kvb == kDone) break;
      const int64_t n = g.KvRows(kvb);
      bool fetched = false;
      KvTile kvt{};
      for (int i = 0; i < nb; ++i) {
        if (next[i] != kvb) continue;
        const int64_t qb = qb0 + i, m = g.QRows(qb);
        const mask::BlockRun& run = runs[i][run_at[i]];
        if (kvb + 1 < run.end) {
          next[i] = kvb + 1;
        } else {
          ++run_at[i];
          next[i] = run_at[i] < runs[i].size() ? runs[i][run_at[i]].begin : kDone;
        }
        const BlockKind kind = plan.Refine(run.kind, b, qb, kvb);
        if (kind == BlockKind::kEmpty) continue;
        if (!fetched) {  // once per group: check, copy or locate the tile
          fetched = true;
          if (check && !kv.tile_cache() &&
              !kv_checked[static_cast<size_t>((b * g.hkv + kh) * g.nkvb + kvb)].exchange(
                  true, std::memory_order_relaxed)) {
            if (AnyNonFinite(p.k, b, kvb * g.bkv, n, kh) ||
                AnyNonFinite(p.v, b, kvb * g.bkv, n, kh)) {
              p.non_finite->store(true);
            }
          }
          bool bad = false;  // met by a per-thread copy
          kvt = ws.kv_cache.Get(kv, mk, b, kh, kvb, check ? &bad : nullptr);
          if (bad) p.non_finite->store(true);
        }
        BlockState& s = ws.blocks[i];
        micro::TileArgs& ti = t[i];
        ti.keys = n;
        ti.mask = nullptr;
        micro::KRanges key_ranges;  // of each query: P V skips the keys it may not see
        if (kind == BlockKind::kPartial) {
          ws.mask.Fill(plan, mk, run.kind, h, b, qb, kvb);
          ti.mask = ws.mask.bits();
          ti.ldm = ws.mask.ldm();
          key_ranges = ws.mask.keys_of_query();
        }
        if (bf16) {
          mk.gemm_bf16(n, RoundUp(m, micro::kVec), d2 / 2, kv.KeysBf16(b, kh, kvb), d2,
                       s.qt_bf16.data(), g.ld_q, ti.pt, ti.ldp, nullptr, false);
          mk.softmax_columns(ti, s.row_max.data(), s.row_sum.data(), s.alpha.data());
        } else {
          ti.k = kvt.k;
          ti.ldk = kvt.ldk;
          mk.forward_tile(ti, s.row_max.data(), s.row_sum.data(), s.alpha.data());
        }
        // The first tile initialises acc (a block with no tile never reads it).
        mk.gemm_f32_ranges(m, g.dvp, n, ti.pt, 1, ti.ldp, kvt.v, kvt.ldv, s.acc.data(), g.ld_dv,
                           s.alpha.data(), computed[i] > 0, key_ranges);
        ++computed[i];
        (kind == BlockKind::kFull ? st.full : st.partial) += 1;
        st.flops += 2 * m * n * (g.d + g.dv);
      }
    }
    for (int i = 0; i < nb; ++i) {
      st.computed += computed[i];
      st.skipped += g.nkvb - computed[i];
      FinishRows(g, b, h, qb0 + i, g.QRows(qb0 + i), ws.blocks[i], merge, stream, out, lse);
    }
    if (stream) _mm_sfence();
  };
  // Work items are runs of `chunk` consecutive q blocks of one (batch, head),
  // the last runs first (under causal masks they carry the most tiles), each
  // run in ascending groups of kGroup: with per-thread kv tile copies, a
  // thread's next group then finds all but its newest tiles in its cache (LRU
  // order). Items stay small enough for dynamic balancing (>= 8 per worker
  // with tile copies, >= 16 without).
  const auto workers = static_cast<int64_t>(pool.size());
  const int64_t tasks = g.b * g.h * g.nqb;
  const int64_t chunk = kv.tile_cache() ? std::clamp<int64_t>(tasks / (8 * workers), 1, 32)
                                        : std::clamp<int64_t>(tasks / (16 * workers), 1, kGroup);
  const int64_t runs_per_head = (g.nqb + chunk - 1) / chunk;
  pool.ParallelFor(g.b * g.h * runs_per_head, [&](int64_t item, int worker) {
    const int64_t run_hi = g.nqb - (item % runs_per_head) * chunk;
    for (int64_t qb0 = std::max<int64_t>(0, run_hi - chunk); qb0 < run_hi; qb0 += kGroup) {
      Group(item / runs_per_head, qb0, std::min<int64_t>(qb0 + kGroup, run_hi), worker);
    }
  });
  AddStats(wstats, stats);
}

}  // namespace

void FlashForward(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                  KernelStats* stats) {
  Forward(p, pool, /*merge=*/false, out, lse, stats);
}

void FlashForwardMerge(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                       KernelStats* stats) {
  Forward(p, pool, /*merge=*/true, out, lse, stats);
}

}  // namespace ringsplash::kernels

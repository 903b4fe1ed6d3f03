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

// Per-thread scratch of the task loop.
struct Workspace {
  AlignedBuffer<float> qt, pt, acc, row_max, row_sum, alpha, tile;
  AlignedBuffer<uint16_t> qt_bf16;
  TileMask mask;
  KvTileCache kv_cache;

  static Workspace& ForThisThread(const Geometry& g, bool bf16) {
    thread_local Workspace ws;
    const int64_t d2 = RoundUp(g.d, 2);
    Grow(ws.qt, g.d * g.ld_q);
    if (bf16) Grow(ws.qt_bf16, d2 * g.ld_q);
    Grow(ws.pt, g.bkv * g.ld_q);
    Grow(ws.acc, g.bq * g.ld_dv);
    Grow(ws.row_max, g.ld_q);
    Grow(ws.row_sum, g.ld_q);
    Grow(ws.alpha, g.ld_q);
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
void FinishRows(const Geometry& g, int64_t b, int64_t h, int64_t qb, int64_t m, Workspace& ws,
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
  // One q block qb of (batch, head) bh = b * H + h.
  auto Task = [&](int64_t bh, int64_t qb, int worker) {
    const int64_t h = bh % g.h;
    const int64_t b = bh / g.h;
    const int64_t kh = h / g.group;
    const int64_t m = g.QRows(qb);
    Workspace& ws = Workspace::ForThisThread(g, bf16);
    WorkerStats& st = wstats[static_cast<size_t>(worker)];

    if (bf16) {
      PackTransposedBf16Pairs(Slab{&p.q, b, h, qb * g.bq, m, g.d}, ws.qt_bf16.data(), g.ld_q);
    } else {
      PackTransposed(mk, p.q, b, h, qb * g.bq, m, ws.qt.data(), g.ld_q);
    }
    if (check && AnyNonFinite(p.q, b, qb * g.bq, m, h)) p.non_finite->store(true);
    for (int64_t i = 0; i < m; ++i) {
      ws.row_max[i] = kNegInf;
      ws.row_sum[i] = 0.0f;
    }

    micro::TileArgs t;
    t.queries = m;
    t.d = g.d;
    t.qt = ws.qt.data();
    t.ldq = g.ld_q;
    t.pt = ws.pt.data();
    t.ldp = g.ld_q;
    t.scale = p.scale;
    t.softcap = p.softcap;
    t.scratch = ws.tile.data();
    int64_t computed = 0;
    for (const mask::BlockRun& run : plan.map().Runs(h, qb)) {
      for (int64_t kvb = run.begin; kvb < run.end; ++kvb) {
        const BlockKind kind = plan.Refine(run.kind, b, qb, kvb);
        if (kind == BlockKind::kEmpty) continue;
        const int64_t n = g.KvRows(kvb);
        if (check && !kv.tile_cache() &&
            !kv_checked[static_cast<size_t>((b * g.hkv + kh) * g.nkvb + kvb)].exchange(
                true, std::memory_order_relaxed)) {
          if (AnyNonFinite(p.k, b, kvb * g.bkv, n, kh) ||
              AnyNonFinite(p.v, b, kvb * g.bkv, n, kh)) {
            p.non_finite->store(true);
          }
        }
        t.keys = n;
        t.mask = nullptr;
        micro::KRanges keys;  // of each query: P V skips the keys it may not see
        if (kind == BlockKind::kPartial) {
          ws.mask.Fill(plan, mk, run.kind, h, b, qb, kvb);
          t.mask = ws.mask.bits();
          t.ldm = ws.mask.ldm();
          keys = ws.mask.keys_of_query();
        }
        const float* values = kv.Values(b, kh, kvb);
        int64_t ldv = kv.ldv();
        if (bf16) {
          mk.gemm_bf16(n, RoundUp(m, micro::kVec), d2 / 2, kv.KeysBf16(b, kh, kvb), d2,
                       ws.qt_bf16.data(), g.ld_q, t.pt, t.ldp, nullptr, false);
          mk.softmax_columns(t, ws.row_max.data(), ws.row_sum.data(), ws.alpha.data());
        } else {
          t.k = kv.Keys(b, kh, kvb);
          t.ldk = kv.ldk();
          if (kv.tile_cache()) {
            bool bad = false;
            const KvTileCache::Tile copy =
                ws.kv_cache.Get(kv, mk, b, kh, kvb, check ? &bad : nullptr);
            if (bad) p.non_finite->store(true);
            t.k = copy.k;
            t.ldk = g.ld_d;
            values = copy.v;
            ldv = g.ld_dv;
          }
          mk.forward_tile(t, ws.row_max.data(), ws.row_sum.data(), ws.alpha.data());
        }
        // The first tile initialises acc (a task with no tile never reads it).
        mk.gemm_f32_ranges(m, g.dvp, n, t.pt, 1, t.ldp, values, ldv, ws.acc.data(), g.ld_dv,
                           ws.alpha.data(), computed > 0, keys);
        ++computed;
        (kind == BlockKind::kFull ? st.full : st.partial) += 1;
        st.flops += 2 * m * n * (g.d + g.dv);
      }
    }
    st.computed += computed;
    st.skipped += g.nkvb - computed;
    FinishRows(g, b, h, qb, m, ws, merge, stream, out, lse);
    if (stream) _mm_sfence();
  };
  // Work items are runs of `chunk` consecutive q blocks of one (batch, head),
  // the last runs first (under causal masks they carry the most tiles), each
  // run in ascending order: with per-thread kv tile copies, a thread's next
  // q block then finds all but its newest tile in its cache (LRU order).
  // Runs stay short enough (>= 8 per worker) for dynamic balancing.
  const int64_t chunk =
      kv.tile_cache()
          ? std::clamp<int64_t>(g.b * g.h * g.nqb / (8 * static_cast<int64_t>(pool.size())), 1, 32)
          : 1;
  const int64_t runs_per_head = (g.nqb + chunk - 1) / chunk;
  pool.ParallelFor(g.b * g.h * runs_per_head, [&](int64_t item, int worker) {
    const int64_t run_hi = g.nqb - (item % runs_per_head) * chunk;
    for (int64_t qb = std::max<int64_t>(0, run_hi - chunk); qb < run_hi; ++qb) {
      Task(item / runs_per_head, qb, worker);
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

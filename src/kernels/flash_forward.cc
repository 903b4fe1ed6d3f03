// FlashForward (flash.h): block-sparse online-softmax attention, SPEC §2
// steps 1-3 and 5 (no sinks; the caller adds them once per row).
//
// Structure: K^T and V are packed once per (batch, kv head, kv block) into a
// per-call scratch in the micro-kernels' formats (f32, or bf16 pairs on the
// avx512_bf16 path with bf16 inputs), shared read-only by every query head of
// the GQA group and every q block. Tasks are (batch, query head, q block);
// each walks the non-empty kv tiles of its block-map row:
//   S = Q K^T  ->  scale, soft cap, mask, online softmax  ->  acc = alpha acc + P V
// and finally writes out = acc / l, lse = m + log(l) for its own rows only, so
// results are bitwise independent of the thread count.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "src/kernels/flash.h"
#include "src/kernels/flash_common.h"
#include "src/kernels/micro.h"
#include "src/kernels/tile_pack.h"

namespace ringsplash::kernels {
namespace {

using mask::BlockKind;
using micro::RoundUp;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Packed K^T and V tiles of one call.
struct PackedKv {
  bool bf16 = false;
  int64_t kt_elems = 0, v_elems = 0;  // per tile
  AlignedBuffer<float> kt_f32, v_f32;
  AlignedBuffer<uint16_t> kt_bf16, v_bf16;
};

PackedKv PackKv(const FlashParams& p, const Geometry& g, bool bf16, ThreadPool& pool) {
  PackedKv pk;
  pk.bf16 = bf16;
  const int64_t tiles = g.b * g.hkv * g.nkvb;
  if (bf16) {
    pk.kt_elems = RoundUp(g.d, 2) * g.ld_kv;  // [d2 / 2][ld_kv][2]
    pk.v_elems = g.bkv * g.ld_dv;             // [bkv / 2][ld_dv][2]
    pk.kt_bf16.Resize(static_cast<size_t>(tiles * pk.kt_elems));
    pk.v_bf16.Resize(static_cast<size_t>(tiles * pk.v_elems));
  } else {
    pk.kt_elems = g.d * g.ld_kv;   // [d][ld_kv]
    pk.v_elems = g.bkv * g.ld_dv;  // [bkv][ld_dv]
    pk.kt_f32.Resize(static_cast<size_t>(tiles * pk.kt_elems));
    pk.v_f32.Resize(static_cast<size_t>(tiles * pk.v_elems));
  }
  pool.ParallelFor(tiles, [&](int64_t t, int) {
    const int64_t kvb = t % g.nkvb, kh = (t / g.nkvb) % g.hkv, b = t / (g.nkvb * g.hkv);
    const int64_t n = g.KvRows(kvb);
    const Slab ks{&p.k, b, kh, kvb * g.bkv, n, g.d};
    const Slab vs{&p.v, b, kh, kvb * g.bkv, n, g.dv};
    if (bf16) {
      PackTransposedBf16Pairs(ks, pk.kt_bf16.data() + t * pk.kt_elems, g.ld_kv);
      PackRowsBf16Pairs(vs, pk.v_bf16.data() + t * pk.v_elems, g.ld_dv, g.bkv);
    } else {
      PackTransposedF32(ks, pk.kt_f32.data() + t * pk.kt_elems, g.ld_kv);
      PackRowsF32(vs, pk.v_f32.data() + t * pk.v_elems, g.ld_dv, g.bkv);
    }
  });
  return pk;
}

struct Scratch {
  AlignedBuffer<float> q, s, acc, row_max, row_sum, alpha;
  AlignedBuffer<uint16_t> q_bf16, p_bf16;
  AlignedBuffer<uint8_t> mask;
  Scratch(const Geometry& g, bool bf16) {
    if (bf16) {
      q_bf16.Resize(static_cast<size_t>(g.bq * RoundUp(g.d, 2)));
      p_bf16.Resize(static_cast<size_t>(g.bq * g.ld_kv));
    } else {
      q.Resize(static_cast<size_t>(g.bq * g.d));
    }
    s.Resize(static_cast<size_t>(g.bq * g.ld_kv));
    acc.Resize(static_cast<size_t>(g.bq * g.ld_dv));
    row_max.Resize(static_cast<size_t>(g.bq));
    row_sum.Resize(static_cast<size_t>(g.bq));
    alpha.Resize(static_cast<size_t>(g.bq));
    mask.Resize(static_cast<size_t>(g.bq * g.ld_kv));
  }
};

}  // namespace

void FlashForward(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                  KernelStats* stats) {
  const Geometry g = Geometry::Of(p);
  if (g.b == 0 || g.sq == 0 || g.h == 0) return;
  if (g.skv == 0) {  // nothing to attend to: every row is empty
    std::memset(out, 0, static_cast<size_t>(g.b * g.sq * g.h * g.dv) * sizeof(float));
    for (int64_t i = 0; i < g.b * g.h * g.sq; ++i) lse[i] = kNegInf;
    return;
  }
  const micro::MicroKernels& mk = micro::MicroKernelsFor(p.path);
  const bool bf16 = p.q.dtype == DType::kBF16 && mk.gemm_bf16 != nullptr;
  const TilePlan plan(p, g, /*by_column=*/false);
  const PackedKv kv = PackKv(p, g, bf16, pool);

  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(pool.size()));
  for (int w = 0; w < pool.size(); ++w) scratch.emplace_back(g, bf16);
  std::vector<WorkerStats> wstats(static_cast<size_t>(pool.size()));

  const int64_t d2 = RoundUp(g.d, 2);
  pool.ParallelFor(g.b * g.h * g.nqb, [&](int64_t task, int worker) {
    // Last q blocks first: under causal masks they carry the most tiles.
    const int64_t qb = g.nqb - 1 - task % g.nqb;
    const int64_t h = (task / g.nqb) % g.h;
    const int64_t b = task / (g.nqb * g.h);
    const int64_t kh = h / g.group;
    const int64_t m = g.QRows(qb);
    Scratch& sc = scratch[static_cast<size_t>(worker)];
    WorkerStats& st = wstats[static_cast<size_t>(worker)];

    const Slab qs{&p.q, b, h, qb * g.bq, m, g.d};
    if (bf16) {
      PackRowsBf16(qs, sc.q_bf16.data(), d2);
    } else {
      PackRowsF32(qs, sc.q.data(), g.d, m);
    }
    for (int64_t i = 0; i < m; ++i) {
      sc.row_max[i] = kNegInf;
      sc.row_sum[i] = 0.0f;
    }
    std::memset(sc.acc.data(), 0, static_cast<size_t>(m * g.ld_dv) * sizeof(float));

    int64_t computed = 0;
    for (const mask::BlockRun& run : plan.map().Runs(h, qb)) {
      for (int64_t kvb = run.begin; kvb < run.end; ++kvb) {
        const BlockKind kind = plan.Refine(run.kind, b, qb, kvb);
        if (kind == BlockKind::kEmpty) continue;
        const int64_t n = g.KvRows(kvb), n16 = RoundUp(n, micro::kVec);
        const int64_t tile = (b * g.hkv + kh) * g.nkvb + kvb;
        const uint8_t* mask = nullptr;
        if (kind == BlockKind::kPartial) {
          plan.FillMask(run.kind, h, b, qb, kvb, sc.mask.data(), g.ld_kv);
          mask = sc.mask.data();
        }
        if (bf16) {
          mk.gemm_bf16(m, n16, d2 / 2, sc.q_bf16.data(), d2, kv.kt_bf16.data() + tile * kv.kt_elems,
                       g.ld_kv, sc.s.data(), g.ld_kv, nullptr, false);
        } else {
          mk.gemm_f32(m, n16, g.d, sc.q.data(), g.d, 1, kv.kt_f32.data() + tile * kv.kt_elems,
                      g.ld_kv, sc.s.data(), g.ld_kv, nullptr, false);
        }
        mk.softmax_forward(m, n, sc.s.data(), g.ld_kv, mask, g.ld_kv, p.scale, p.softcap,
                           sc.row_max.data(), sc.row_sum.data(), sc.alpha.data());
        if (bf16) {
          // P is rounded to bf16 for this product only (the row sums above
          // stay f32): the bf16 path's documented extra rounding.
          mk.to_bf16(m, n, sc.s.data(), g.ld_kv, sc.p_bf16.data(), g.ld_kv);
          mk.gemm_bf16(m, g.dvp, (n + 1) / 2, sc.p_bf16.data(), g.ld_kv,
                       kv.v_bf16.data() + tile * kv.v_elems, g.ld_dv, sc.acc.data(), g.ld_dv,
                       sc.alpha.data(), true);
        } else {
          mk.gemm_f32(m, g.dvp, n, sc.s.data(), g.ld_kv, 1, kv.v_f32.data() + tile * kv.v_elems,
                      g.ld_dv, sc.acc.data(), g.ld_dv, sc.alpha.data(), true);
        }
        ++computed;
        (kind == BlockKind::kFull ? st.full : st.partial) += 1;
        st.flops += 2 * m * n * (g.d + g.dv);
      }
    }
    st.computed += computed;
    st.skipped += g.nkvb - computed;

    // Finalise this task's rows: out [B, Sq, H, Dv], lse [B, H, Sq].
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = qb * g.bq + i;
      float* o = out + ((b * g.sq + row) * g.h + h) * g.dv;
      const float l = sc.row_sum[i];
      if (l > 0.0f) {
        const float* a = sc.acc.data() + i * g.ld_dv;
        for (int64_t c = 0; c < g.dv; ++c) o[c] = a[c] / l;
        lse[(b * g.h + h) * g.sq + row] = sc.row_max[i] + std::log(l);
      } else {
        std::memset(o, 0, static_cast<size_t>(g.dv) * sizeof(float));
        lse[(b * g.h + h) * g.sq + row] = kNegInf;
      }
    }
  });
  AddStats(wstats, stats);
}

}  // namespace ringsplash::kernels

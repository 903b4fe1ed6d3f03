// FlashBackward (flash.h): gradients of block-sparse attention, SPEC §2.
//
// Two passes, each task owning the output rows it writes, so there are no
// float atomics and results are bitwise independent of the thread count:
//   pass 1, tasks (batch, kv head, kv block), COLUMN block map: for every
//     query head of the GQA group and every non-empty q block, recompute
//     S, P = exp(S - lse), dP = dO V^T, dS = scale * P * (dP - delta) [* cap'],
//     then dV += P^T dO and dK += dS^T Q in a task-local tile, added to
//     dk_acc / dv_acc at the end;
//   pass 2, tasks (batch, query head, q block), ROW block map: recompute
//     P and dS the same way (same micro-kernels, same inputs: bit-identical)
//     and dQ += dS K.
// All operands are packed once per call as f32 (bf16/f16 inputs are widened;
// the backward has no bf16 product path).
#include <algorithm>
#include <cstring>
#include <vector>

#include "src/kernels/flash.h"
#include "src/kernels/flash_common.h"
#include "src/kernels/micro.h"
#include "src/kernels/tile_pack.h"

namespace ringsplash::kernels {
namespace {

using mask::BlockKind;
using micro::RoundUp;

// Every operand of the backward, packed as f32 once per call.
struct Packed {
  // Per (b, h, q block): Q [bq][ld_d] and dO [bq][ld_dv], zero padded.
  int64_t q_elems = 0, do_elems = 0;
  AlignedBuffer<float> q, dout;
  // Per (b, kv head, kv block): K^T [d][ld_kv], V^T [dv][ld_kv], K [bkv][ld_d].
  int64_t kt_elems = 0, vt_elems = 0, k_elems = 0;
  AlignedBuffer<float> kt, vt, k;
};

Packed PackAll(const FlashParams& p, const TensorView& dout, const Geometry& g, ThreadPool& pool) {
  Packed pk;
  const int64_t q_tiles = g.b * g.h * g.nqb, kv_tiles = g.b * g.hkv * g.nkvb;
  pk.q_elems = g.bq * g.ld_d;
  pk.do_elems = g.bq * g.ld_dv;
  pk.kt_elems = g.d * g.ld_kv;
  pk.vt_elems = g.dv * g.ld_kv;
  pk.k_elems = g.bkv * g.ld_d;
  pk.q.Resize(static_cast<size_t>(q_tiles * pk.q_elems));
  pk.dout.Resize(static_cast<size_t>(q_tiles * pk.do_elems));
  pk.kt.Resize(static_cast<size_t>(kv_tiles * pk.kt_elems));
  pk.vt.Resize(static_cast<size_t>(kv_tiles * pk.vt_elems));
  pk.k.Resize(static_cast<size_t>(kv_tiles * pk.k_elems));
  pool.ParallelFor(q_tiles + kv_tiles, [&](int64_t t, int) {
    if (t < q_tiles) {
      const int64_t qb = t % g.nqb, h = (t / g.nqb) % g.h, b = t / (g.nqb * g.h);
      const int64_t m = g.QRows(qb);
      PackRowsF32(Slab{&p.q, b, h, qb * g.bq, m, g.d}, pk.q.data() + t * pk.q_elems, g.ld_d, m);
      PackRowsF32(Slab{&dout, b, h, qb * g.bq, m, g.dv}, pk.dout.data() + t * pk.do_elems, g.ld_dv,
                  m);
    } else {
      t -= q_tiles;
      const int64_t kvb = t % g.nkvb, kh = (t / g.nkvb) % g.hkv, b = t / (g.nkvb * g.hkv);
      const int64_t n = g.KvRows(kvb);
      const Slab ks{&p.k, b, kh, kvb * g.bkv, n, g.d};
      PackTransposedF32(ks, pk.kt.data() + t * pk.kt_elems, g.ld_kv);
      PackTransposedF32(Slab{&p.v, b, kh, kvb * g.bkv, n, g.dv}, pk.vt.data() + t * pk.vt_elems,
                        g.ld_kv);
      PackRowsF32(ks, pk.k.data() + t * pk.k_elems, g.ld_d, n);
    }
  });
  return pk;
}

struct Scratch {
  AlignedBuffer<float> s, dp, deriv, acc_a, acc_b;
  AlignedBuffer<uint8_t> mask;
  explicit Scratch(const Geometry& g) {
    const size_t tile = static_cast<size_t>(g.bq * g.ld_kv);
    s.Resize(tile);
    dp.Resize(tile);
    deriv.Resize(tile);
    mask.Resize(tile);
    // Pass 1: dK [bkv][ld_d] and dV [bkv][ld_dv]; pass 2: dQ [bq][ld_d].
    acc_a.Resize(static_cast<size_t>(std::max(g.bkv, g.bq) * g.ld_d));
    acc_b.Resize(static_cast<size_t>(g.bkv * g.ld_dv));
  }
};

// The shared core of both passes: P (in sc.s) and dS (in sc.dp) of one tile.
struct TileOperands {
  const float *q, *dout, *kt, *vt, *lse, *delta;
  const uint8_t* mask;
};

void ProbsAndDs(const micro::MicroKernels& mk, const FlashParams& p, const Geometry& g, int64_t m,
                int64_t n, const TileOperands& t, Scratch& sc) {
  const int64_t n16 = RoundUp(n, micro::kVec);
  mk.gemm_f32(m, n16, g.d, t.q, g.ld_d, 1, t.kt, g.ld_kv, sc.s.data(), g.ld_kv, nullptr, false);
  mk.probs_backward(m, n, sc.s.data(), g.ld_kv, t.mask, g.ld_kv, p.scale, p.softcap, t.lse,
                    sc.deriv.data());
  mk.gemm_f32(m, n16, g.dv, t.dout, g.ld_dv, 1, t.vt, g.ld_kv, sc.dp.data(), g.ld_kv, nullptr,
              false);
  mk.ds_backward(m, n, sc.s.data(), sc.dp.data(), g.ld_kv, t.delta,
                 p.softcap > 0.0f ? sc.deriv.data() : nullptr, p.scale);
}

}  // namespace

void FlashBackward(const FlashParams& p, ThreadPool& pool, const TensorView& dout, const float* lse,
                   const float* delta, float* dq_acc, float* dk_acc, float* dv_acc,
                   KernelStats* stats) {
  const Geometry g = Geometry::Of(p);
  if (g.b == 0 || g.sq == 0 || g.h == 0 || g.skv == 0) return;
  const micro::MicroKernels& mk = micro::MicroKernelsFor(p.path);
  const Packed pk = PackAll(p, dout, g, pool);

  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(pool.size()));
  for (int w = 0; w < pool.size(); ++w) scratch.emplace_back(g);
  // Pass 1 counts FLOPs only; pass 2 counts tiles (as the forward does) and FLOPs.
  std::vector<WorkerStats> wstats(static_cast<size_t>(pool.size()));

  auto operands = [&](int64_t b, int64_t h, int64_t qb, int64_t kvb, const uint8_t* mask) {
    const int64_t qt = (b * g.h + h) * g.nqb + qb;
    const int64_t kt = (b * g.hkv + h / g.group) * g.nkvb + kvb;
    const int64_t row = (b * g.h + h) * g.sq + qb * g.bq;
    return TileOperands{pk.q.data() + qt * pk.q_elems,
                        pk.dout.data() + qt * pk.do_elems,
                        pk.kt.data() + kt * pk.kt_elems,
                        pk.vt.data() + kt * pk.vt_elems,
                        lse + row,
                        delta + row,
                        mask};
  };

  {  // Pass 1: dK, dV.
    const TilePlan plan(p, g, /*by_column=*/true);
    pool.ParallelFor(g.b * g.hkv * g.nkvb, [&](int64_t task, int worker) {
      const int64_t kvb = task % g.nkvb, kh = (task / g.nkvb) % g.hkv;
      const int64_t b = task / (g.nkvb * g.hkv);
      const int64_t n = g.KvRows(kvb);
      Scratch& sc = scratch[static_cast<size_t>(worker)];
      WorkerStats& st = wstats[static_cast<size_t>(worker)];
      float* dk = sc.acc_a.data();
      float* dv = sc.acc_b.data();
      std::memset(dk, 0, static_cast<size_t>(n * g.ld_d) * sizeof(float));
      std::memset(dv, 0, static_cast<size_t>(n * g.ld_dv) * sizeof(float));
      for (int64_t h = kh * g.group; h < (kh + 1) * g.group; ++h) {
        for (const mask::BlockRun& run : plan.map().Runs(h, kvb)) {
          for (int64_t qb = run.begin; qb < run.end; ++qb) {
            const BlockKind kind = plan.Refine(run.kind, b, qb, kvb);
            if (kind == BlockKind::kEmpty) continue;
            const int64_t m = g.QRows(qb);
            const uint8_t* mask = nullptr;
            if (kind == BlockKind::kPartial) {
              plan.FillMask(run.kind, h, b, qb, kvb, sc.mask.data(), g.ld_kv);
              mask = sc.mask.data();
            }
            const TileOperands t = operands(b, h, qb, kvb, mask);
            ProbsAndDs(mk, p, g, m, n, t, sc);
            // dV += P^T dO and dK += dS^T Q: A = P^T / dS^T read transposed.
            mk.gemm_f32(n, g.dvp, m, sc.s.data(), 1, g.ld_kv, t.dout, g.ld_dv, dv, g.ld_dv, nullptr,
                        true);
            mk.gemm_f32(n, g.dp, m, sc.dp.data(), 1, g.ld_kv, t.q, g.ld_d, dk, g.ld_d, nullptr,
                        true);
            st.flops += 4 * m * n * (g.d + g.dv);
          }
        }
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t row = (b * g.skv + kvb * g.bkv + j) * g.hkv + kh;
        float* dk_row = dk_acc + row * g.d;
        float* dv_row = dv_acc + row * g.dv;
        for (int64_t c = 0; c < g.d; ++c) dk_row[c] += dk[j * g.ld_d + c];
        for (int64_t c = 0; c < g.dv; ++c) dv_row[c] += dv[j * g.ld_dv + c];
      }
    });
  }

  {  // Pass 2: dQ.
    const TilePlan plan(p, g, /*by_column=*/false);
    pool.ParallelFor(g.b * g.h * g.nqb, [&](int64_t task, int worker) {
      const int64_t qb = g.nqb - 1 - task % g.nqb;
      const int64_t h = (task / g.nqb) % g.h, b = task / (g.nqb * g.h);
      const int64_t m = g.QRows(qb);
      Scratch& sc = scratch[static_cast<size_t>(worker)];
      WorkerStats& st = wstats[static_cast<size_t>(worker)];
      float* dq = sc.acc_a.data();
      std::memset(dq, 0, static_cast<size_t>(m * g.ld_d) * sizeof(float));
      int64_t computed = 0;
      for (const mask::BlockRun& run : plan.map().Runs(h, qb)) {
        for (int64_t kvb = run.begin; kvb < run.end; ++kvb) {
          const BlockKind kind = plan.Refine(run.kind, b, qb, kvb);
          if (kind == BlockKind::kEmpty) continue;
          const int64_t n = g.KvRows(kvb);
          const uint8_t* mask = nullptr;
          if (kind == BlockKind::kPartial) {
            plan.FillMask(run.kind, h, b, qb, kvb, sc.mask.data(), g.ld_kv);
            mask = sc.mask.data();
          }
          ProbsAndDs(mk, p, g, m, n, operands(b, h, qb, kvb, mask), sc);
          const int64_t kt = (b * g.hkv + h / g.group) * g.nkvb + kvb;
          mk.gemm_f32(m, g.dp, n, sc.dp.data(), g.ld_kv, 1, pk.k.data() + kt * pk.k_elems, g.ld_d,
                      dq, g.ld_d, nullptr, true);
          ++computed;
          (kind == BlockKind::kFull ? st.full : st.partial) += 1;
          st.flops += 2 * m * n * (2 * g.d + g.dv);
        }
      }
      st.computed += computed;
      st.skipped += g.nkvb - computed;
      for (int64_t i = 0; i < m; ++i) {
        float* dq_row = dq_acc + ((b * g.sq + qb * g.bq + i) * g.h + h) * g.d;
        for (int64_t c = 0; c < g.d; ++c) dq_row[c] += dq[i * g.ld_d + c];
      }
    });
  }
  AddStats(wstats, stats);
}

}  // namespace ringsplash::kernels

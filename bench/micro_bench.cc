// Google Benchmark micro-benchmarks of the flash kernels: the micro-kernels
// (QK^T and PV products, online softmax, probabilities, packing) on one tile,
// the decoding step, and the whole single-head FlashForward / FlashBackward
// loops on one thread.
//
// Every benchmark reports a FLOPS counter (rate over CPU time of the timing
// thread, which stays meaningful on a loaded machine) with the same FLOP
// conventions as `ringsplash bench`: a product of m x k by k x n is 2 m n k;
// softmax and packing report elements per second instead.
//
//   build/bench/ringsplash_micro_bench --benchmark_filter=Gemm
//   build/bench/ringsplash_micro_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true    (one command line)
//
// Paths the CPU lacks are skipped with an error message, never run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/thread_pool.h"
#include "src/kernels/tiling/pack.h"

namespace ringsplash::bench {
namespace {

using kernels::AlignedBuffer;
using kernels::micro::MicroKernels;
using kernels::micro::PaddedLd;
using kernels::micro::RoundUp;

constexpr KernelPath kPaths[] = {KernelPath::kPortable, KernelPath::kAvx2, KernelPath::kAvx512,
                                 KernelPath::kAvx512Bf16};

bool Supported(KernelPath path) {
  const std::vector<KernelPath> all = SupportedKernelPaths();
  return std::find(all.begin(), all.end(), path) != all.end();
}

// Fills with uniform values in [-1, 1) (seeded: every run sees the same data).
template <typename T, typename Convert>
void Fill(T* data, size_t n, uint32_t seed, Convert convert) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) data[i] = convert(dist(rng));
}
void FillF32(float* data, size_t n, uint32_t seed) {
  Fill(data, n, seed, [](float x) { return x; });
}
void FillBf16(uint16_t* data, size_t n, uint32_t seed) {
  Fill(data, n, seed, [](float x) { return F32ToBF16(x); });
}
// A float32 or bf16 tensor, as FillF32 or FillBf16 fill its elements.
void FillTensor(Tensor& t, uint32_t seed) {
  const auto n = static_cast<size_t>(t.numel());
  if (t.dtype() == DType::kF32) {
    FillF32(t.data_as<float>(), n, seed);
  } else {
    FillBf16(t.data_as<uint16_t>(), n, seed);
  }
}

// Looks up the table of a path, or marks the benchmark skipped.
const MicroKernels* KernelsOr(benchmark::State& state, KernelPath path) {
  if (!Supported(path)) {
    state.SkipWithError("kernel path not supported on this CPU");
    return nullptr;
  }
  return &kernels::micro::MicroKernelsFor(path);
}

void SetFlops(benchmark::State& state, double flops_per_iteration) {
  state.counters["FLOPS"] =
      benchmark::Counter(flops_per_iteration, benchmark::Counter::kIsIterationInvariantRate);
}

// A transposed tile as the flash loops see it (micro.h TileArgs): bkv keys,
// bq queries, head dim d, with random operands and per-query state.
struct Tile {
  int64_t keys, queries, d, ld;
  AlignedBuffer<float> k, qt, v, dot, pt, ds, scratch, row_max, row_sum, alpha, lse, delta, acc;
  Tile(int64_t bkv, int64_t bq, int64_t dim)
      : keys(bkv),
        queries(bq),
        d(dim),
        ld(PaddedLd(bq)),
        k(bkv * dim),
        qt(dim * PaddedLd(bq)),
        v(bkv * dim),
        dot(dim * PaddedLd(bq)),
        pt(bkv * PaddedLd(bq)),
        ds(bkv * PaddedLd(bq)),
        scratch(3 * PaddedLd(bq)),
        row_max(PaddedLd(bq)),
        row_sum(PaddedLd(bq)),
        alpha(PaddedLd(bq)),
        lse(PaddedLd(bq)),
        delta(PaddedLd(bq)),
        acc(bq * PaddedLd(dim)) {
    FillF32(k.data(), k.size(), 1);
    FillF32(qt.data(), qt.size(), 2);
    FillF32(v.data(), v.size(), 3);
    FillF32(dot.data(), dot.size(), 4);
    for (int64_t i = 0; i < bq; ++i) {
      lse[i] = 3.0f;
      delta[i] = 0.1f;
    }
  }
  kernels::micro::TileArgs Args(float scale) {
    kernels::micro::TileArgs t;
    t.keys = keys;
    t.queries = queries;
    t.d = d;
    t.k = k.data();
    t.ldk = d;
    t.qt = qt.data();
    t.ldq = ld;
    t.pt = pt.data();
    t.ldp = ld;
    t.scale = scale;
    t.scratch = scratch.data();
    return t;
  }
  // A state whose maxima are the tile's own (what a query has after its
  // first tile), so the forward takes its steady-state (lazy) step.
  void SteadyState(const MicroKernels& mk, float scale) {
    for (int64_t i = 0; i < queries; ++i) {
      row_max[i] = -std::numeric_limits<float>::infinity();
      row_sum[i] = 0.0f;
    }
    mk.forward_tile(Args(scale), row_max.data(), row_sum.data(), alpha.data());
  }
};

// The decoding step (micro.h DecodeStepFn; avx512 and avx2) of 8 query heads over one kv
// tile of `keys` keys read in place from [S, Hkv, D] rows, `group` heads per
// kv head (1: MHA; 8: all eight share one kv head's rows), f32 or bf16 K/V,
// D = Dv = 128; the state is reset every iteration (the first step's work
// equals any later one's). The rows stay in L1/L2 here, so this is the
// kernel's arithmetic rate; a real step at long Skv is bound by reading K
// and V (docs/PERFORMANCE.md, Decoding). FLOPs 4 D keys per head; KVBytes
// the bytes of K and V the step reads.
// Args: path, group, bf16 (0/1), keys.
void BM_DecodeStep(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  if (mk->decode_step == nullptr) {
    state.SkipWithError("no decoding step on this path");
    return;
  }
  constexpr int64_t kHeads = 8, kD = 128;
  const int64_t group = state.range(1), keys = state.range(3);
  const bool bf16 = state.range(2) != 0;
  const int64_t hkv = kHeads / group, ld = hkv * kD, elems = keys * ld;
  AlignedBuffer<float> k32(elems), v32(elems), q(kHeads * kD), acc(kHeads * kD);
  AlignedBuffer<float> row_max(kHeads), row_sum(kHeads);
  AlignedBuffer<uint16_t> k16(elems), v16(elems);
  FillF32(k32.data(), k32.size(), 11);
  FillF32(v32.data(), v32.size(), 12);
  FillF32(q.data(), q.size(), 13);
  FillBf16(k16.data(), k16.size(), 11);
  FillBf16(v16.data(), v16.size(), 12);
  const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
  const auto* kb = bf16 ? static_cast<const void*>(k16.data()) : k32.data();
  const auto* vb = bf16 ? static_cast<const void*>(v16.data()) : v32.data();
  std::vector<kernels::micro::DecodeHead> heads(kHeads);
  for (int64_t h = 0; h < kHeads; ++h) {
    const int64_t off = (h / group) * kD * static_cast<int64_t>(elem);
    heads[h].q = q.data() + h * kD;
    heads[h].k = static_cast<const char*>(kb) + off;
    heads[h].v = static_cast<const char*>(vb) + off;
    heads[h].acc = acc.data() + h * kD;
    heads[h].row_max = row_max.data() + h;
    heads[h].row_sum = row_sum.data() + h;
  }
  const kernels::micro::DecodeArgs args{.heads = kHeads,
                                        .keys = keys,
                                        .d = kD,
                                        .dv = kD,
                                        .ldk = ld,
                                        .ldv = ld,
                                        .bf16 = bf16,
                                        .scale = 1.0f / std::sqrt(static_cast<float>(kD)),
                                        .softcap = 0.0f,
                                        .head = heads.data()};
  for (auto _ : state) {
    std::fill_n(acc.data(), acc.size(), 0.0f);
    std::fill_n(row_max.data(), kHeads, -std::numeric_limits<float>::infinity());
    std::fill_n(row_sum.data(), kHeads, 0.0f);
    benchmark::DoNotOptimize(mk->decode_step(args));
    benchmark::ClobberMemory();
  }
  SetFlops(state, 4.0 * kD * keys * kHeads);
  state.counters["KVBytes"] = benchmark::Counter(2.0 * static_cast<double>(elems * elem),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// Args of the tile benchmarks: path, bq (queries), bkv (keys), d.
void TileArgsOf(benchmark::internal::Benchmark* b) {
  for (KernelPath path : kPaths) {
    for (int64_t d : {64, 128}) b->Args({static_cast<int64_t>(path), 64, 128, d});
    b->Args({static_cast<int64_t>(path), 64, 24, 128});
    b->Args({static_cast<int64_t>(path), 128, 128, 128});
    b->Args({static_cast<int64_t>(path), 64, 256, 128});
  }
  b->ArgNames({"path", "bq", "bkv", "d"});
}

// S^T = K Q^T of one tile, plain (the product inside every forward tile).
void BM_GemmScores(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  Tile tile(state.range(2), state.range(1), state.range(3));
  for (auto _ : state) {
    mk->gemm_f32(tile.keys, RoundUp(tile.queries, 16), tile.d, tile.k.data(), tile.d, 1,
                 tile.qt.data(), tile.ld, tile.pt.data(), tile.ld, nullptr, false);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * tile.keys * tile.queries * tile.d);
}

// acc = diag(alpha) acc + P V with P read from P^T (column-major A).
void BM_GemmPV(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  Tile tile(state.range(2), state.range(1), state.range(3));
  FillF32(tile.pt.data(), tile.pt.size(), 5);
  for (int64_t i = 0; i < tile.queries; ++i) tile.alpha[i] = 1.0f;
  // V rows as the loops pack them (PaddedLd: no L1 set aliasing).
  const int64_t ldacc = PaddedLd(tile.d);
  AlignedBuffer<float> v(tile.keys * ldacc);
  FillF32(v.data(), v.size(), 6);
  for (auto _ : state) {
    mk->gemm_f32(tile.queries, RoundUp(tile.d, 16), tile.keys, tile.pt.data(), 1, tile.ld, v.data(),
                 ldacc, tile.acc.data(), ldacc, tile.alpha.data(), true);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * tile.keys * tile.queries * tile.d);
}

// P V with V read in place from a [S, Hkv, Dv] tensor: row stride ldv floats
// (Hkv * Dv), against the packed stride PaddedLd(Dv). Args: ldv; bq 64,
// bkv 128, Dv 128.
void BM_GemmPVStride(benchmark::State& state) {
  const MicroKernels* mk = KernelsOr(state, KernelPath::kAvx512);
  if (mk == nullptr) return;
  const int64_t ldv = state.range(0);
  Tile tile(128, 64, 128);
  FillF32(tile.pt.data(), tile.pt.size(), 5);
  for (int64_t i = 0; i < tile.queries; ++i) tile.alpha[i] = 1.0f;
  const int64_t ldacc = PaddedLd(tile.d);
  AlignedBuffer<float> v(tile.keys * ldv);
  FillF32(v.data(), v.size(), 6);
  for (auto _ : state) {
    mk->gemm_f32(tile.queries, tile.d, tile.keys, tile.pt.data(), 1, tile.ld, v.data(), ldv,
                 tile.acc.data(), ldacc, tile.alpha.data(), true);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * tile.keys * tile.queries * tile.d);
}

// The fused forward tile with K read in place at row stride ldk (Hkv * D).
// Args: ldk; bq 64, bkv 128, D 128.
void BM_ForwardTileStride(benchmark::State& state) {
  const MicroKernels* mk = KernelsOr(state, KernelPath::kAvx512);
  if (mk == nullptr) return;
  const int64_t ldk = state.range(0);
  Tile tile(128, 64, 128);
  AlignedBuffer<float> k(tile.keys * ldk);
  FillF32(k.data(), k.size(), 7);
  const float scale = 1.0f / std::sqrt(static_cast<float>(tile.d));
  kernels::micro::TileArgs t = tile.Args(scale);
  t.k = k.data();
  t.ldk = ldk;
  for (int64_t i = 0; i < tile.queries; ++i) {
    tile.row_max[i] = -std::numeric_limits<float>::infinity();
    tile.row_sum[i] = 0.0f;
  }
  mk->forward_tile(t, tile.row_max.data(), tile.row_sum.data(), tile.alpha.data());
  for (auto _ : state) {
    mk->forward_tile(t, tile.row_max.data(), tile.row_sum.data(), tile.alpha.data());
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * tile.keys * tile.queries * tile.d);
}

// The fused forward tile (scores + online softmax). steady: the state's
// maxima are the tile's own, so the lazy step runs; otherwise a query's
// first tile (no reference max yet): the exact step, the state reset each
// iteration (two rows of at most 144 floats: a few ns of a tile's ~10-50
// us). A window row takes the exact step on one tile in ~5, a full-mask row
// on one in S / block_kv.
void ForwardTileBench(benchmark::State& state, bool steady) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  Tile tile(state.range(2), state.range(1), state.range(3));
  const float scale = 1.0f / std::sqrt(static_cast<float>(tile.d));
  if (steady) tile.SteadyState(*mk, scale);
  const kernels::micro::TileArgs t = tile.Args(scale);
  for (auto _ : state) {
    if (!steady) {
      std::fill_n(tile.row_max.data(), tile.row_max.size(),
                  -std::numeric_limits<float>::infinity());
      std::fill_n(tile.row_sum.data(), tile.row_sum.size(), 0.0f);
    }
    mk->forward_tile(t, tile.row_max.data(), tile.row_sum.data(), tile.alpha.data());
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * tile.keys * tile.queries * tile.d);
}
void BM_ForwardTile(benchmark::State& state) { ForwardTileBench(state, /*steady=*/true); }
void BM_ForwardTileExact(benchmark::State& state) { ForwardTileBench(state, /*steady=*/false); }

// The exact two-pass softmax step alone (in place on raw products).
void BM_SoftmaxColumns(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  Tile tile(state.range(2), state.range(1), state.range(3));
  const kernels::micro::TileArgs t = tile.Args(0.088f);
  AlignedBuffer<float> raw(tile.pt.size());
  FillF32(raw.data(), raw.size(), 6);
  for (auto _ : state) {
    state.PauseTiming();
    std::copy(raw.data(), raw.data() + raw.size(), tile.pt.data());
    for (int64_t i = 0; i < tile.queries; ++i) {
      tile.row_max[i] = 0.5f;
      tile.row_sum[i] = 1.0f;
    }
    state.ResumeTiming();
    mk->softmax_columns(t, tile.row_max.data(), tile.row_sum.data(), tile.alpha.data());
    benchmark::ClobberMemory();
  }
  state.counters["elements"] = benchmark::Counter(static_cast<double>(tile.keys * tile.queries),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// The bf16 path's softmax step alone (micro.h SoftmaxBf16Fn) on stored raw
// products. steady 1: every query has a finite max, so the lazy step runs
// (P evaluated against it and written transposed as bf16 rows, t.pt left
// as it is: each iteration sees the same products; row_sum only grows);
// steady 0: a query's first tile, the exact step, the state reset each
// iteration (and t.pt, which the exact step may use in place). The amx
// forward's largest phase after its tile products (docs/perf/XEON_HOST.md).
// Args: path, bq, bkv, steady.
void BM_SoftmaxBf16(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  const bool steady = state.range(3) != 0;
  Tile tile(state.range(2), state.range(1), 128);
  const kernels::micro::TileArgs t = tile.Args(0.088f);
  AlignedBuffer<float> raw(tile.pt.size());
  FillF32(raw.data(), raw.size(), 6);
  std::copy(raw.data(), raw.data() + raw.size(), tile.pt.data());
  const int64_t ldpb = RoundUp(tile.keys, 32);
  AlignedBuffer<uint16_t> p(tile.queries * ldpb);
  for (int64_t i = 0; i < tile.queries; ++i) {
    tile.row_max[i] = 0.5f;
    tile.row_sum[i] = 1.0f;
  }
  for (auto _ : state) {
    if (!steady) {
      state.PauseTiming();
      std::copy(raw.data(), raw.data() + raw.size(), tile.pt.data());
      std::fill_n(tile.row_max.data(), tile.queries, -std::numeric_limits<float>::infinity());
      std::fill_n(tile.row_sum.data(), tile.queries, 0.0f);
      state.ResumeTiming();
    }
    mk->softmax_bf16(t, tile.row_max.data(), tile.row_sum.data(), tile.alpha.data(), p.data(),
                     ldpb);
    benchmark::ClobberMemory();
  }
  state.counters["elements"] = benchmark::Counter(static_cast<double>(tile.keys * tile.queries),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// The fused backward tile: P^T from K Q^T and dS^T from V dO^T (two products).
void BM_BackwardTile(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const MicroKernels* mk = KernelsOr(state, path);
  if (mk == nullptr) return;
  Tile tile(state.range(2), state.range(1), state.range(3));
  kernels::micro::BackwardTileArgs b;
  b.t = tile.Args(1.0f / std::sqrt(static_cast<float>(tile.d)));
  b.dv = tile.d;
  b.v = tile.v.data();
  b.ldv = tile.d;
  b.dot = tile.dot.data();
  b.lse = tile.lse.data();
  b.delta = tile.delta.data();
  b.ds = tile.ds.data();
  for (auto _ : state) {
    mk->backward_tile(b);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * 2.0 * tile.keys * tile.queries * tile.d);
}

// The bf16 product S^T = K Q^T on the same shapes: vdpbf16ps (avx512_bf16)
// or AMX tiles (amx). Args: path, bq, bkv, d.
void BM_GemmBf16Scores(benchmark::State& state) {
  const int64_t m = state.range(1), n = state.range(2), d = state.range(3);
  const MicroKernels* mk = KernelsOr(state, static_cast<KernelPath>(state.range(0)));
  if (mk == nullptr) return;
  const int64_t ld = PaddedLd(m), d2 = RoundUp(d, 2);
  AlignedBuffer<uint16_t> k(n * d2), qt(d2 * ld);
  AlignedBuffer<float> s(n * ld);
  FillBf16(k.data(), k.size(), 1);
  FillBf16(qt.data(), qt.size(), 2);
  for (auto _ : state) {
    mk->gemm_bf16(n, RoundUp(m, 16), d2 / 2, k.data(), d2, qt.data(), ld, s.data(), ld, nullptr,
                  false);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * m * n * d);
}

// A gradient product of the bf16 backward, dV += P^T dO (dK, dQ alike): bkv
// rows, D columns, bq queries (pairs of them) summed into C. Args: path,
// bq, bkv, d.
void BM_GemmBf16Accumulate(benchmark::State& state) {
  const int64_t m = state.range(1), n = state.range(2), d = state.range(3);
  const MicroKernels* mk = KernelsOr(state, static_cast<KernelPath>(state.range(0)));
  if (mk == nullptr) return;
  const int64_t ldq = PaddedLd(m), ldd = PaddedLd(d);
  AlignedBuffer<uint16_t> pt(n * ldq), dout(RoundUp(m, 32) * ldd);
  AlignedBuffer<float> dv(n * ldd);
  FillBf16(pt.data(), pt.size(), 1);
  FillBf16(dout.data(), dout.size(), 2);
  for (auto _ : state) {
    mk->gemm_bf16(n, d, RoundUp(m, 16) / 2, pt.data(), ldq, dout.data(), ldd, dv.data(), ldd,
                  nullptr, true);
    benchmark::ClobberMemory();
  }
  SetFlops(state, 2.0 * m * n * d);
}

// Packing of one Q block as Q^T (f32), once per forward task. Args: bq, D.
void BM_PackTransposedF32(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1);
  Tensor k(DType::kF32, {1, n, 1, d});
  FillF32(k.data_as<float>(), static_cast<size_t>(n * d), 6);
  const TensorView view = k.view();
  const int64_t ld = PaddedLd(n);
  AlignedBuffer<float> dst(d * ld);
  for (auto _ : state) {
    kernels::PackTransposedF32(kernels::Slab{&view, 0, 0, 0, n, d}, dst.data(), ld);
    benchmark::ClobberMemory();
  }
  state.counters["elements"] =
      benchmark::Counter(static_cast<double>(n * d), benchmark::Counter::kIsIterationInvariantRate);
}

// Packing of one V tile, row-major f32 (args: bkv, Dv) from f32 or bf16 input.
void BM_PackRowsF32(benchmark::State& state) {
  const int64_t n = state.range(0), dv = state.range(1);
  const DType dtype = state.range(2) != 0 ? DType::kBF16 : DType::kF32;
  Tensor v(dtype, {1, n, 1, dv});
  if (dtype == DType::kF32) {
    FillF32(v.data_as<float>(), static_cast<size_t>(n * dv), 7);
  } else {
    FillBf16(v.data_as<uint16_t>(), static_cast<size_t>(n * dv), 7);
  }
  const TensorView view = v.view();
  const int64_t ld = PaddedLd(dv);
  AlignedBuffer<float> dst(n * ld);
  for (auto _ : state) {
    kernels::PackRowsF32(kernels::Slab{&view, 0, 0, 0, n, dv}, dst.data(), ld, n);
    benchmark::ClobberMemory();
  }
  state.counters["elements"] = benchmark::Counter(static_cast<double>(n * dv),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// A whole single-device forward or backward on one thread: B = 1, H = 1,
// S x S attention. Args: path, S, D, dtype (0 f32, 1 bf16), mask (0 full,
// 1 causal, 2 sliding window causal&local:512,0), backward (0/1), block q,
// block kv.
void BM_Flash(benchmark::State& state) {
  const auto path = static_cast<KernelPath>(state.range(0));
  const int64_t s = state.range(1), d = state.range(2);
  const DType dtype = state.range(3) != 0 ? DType::kBF16 : DType::kF32;
  const int64_t mask_kind = state.range(4);
  const bool backward = state.range(5) != 0;
  const BlockSizes blocks{state.range(6), state.range(7)};
  if (!Supported(path)) {
    state.SkipWithError("kernel path not supported on this CPU");
    return;
  }
  Tensor q(dtype, {1, s, 1, d}), k(dtype, {1, s, 1, d}), v(dtype, {1, s, 1, d});
  Tensor dout(dtype, {1, s, 1, d});
  for (Tensor* t : {&q, &k, &v, &dout}) FillTensor(*t, static_cast<uint32_t>(t->numel()));
  const Mask mask = mask_kind == 0   ? Mask::Full()
                    : mask_kind == 1 ? Mask::Causal()
                                     : Mask::Causal() & Mask::Local(512, 0);
  kernels::FlashParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.mask = &mask;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.path = path;
  p.blocks = blocks;
  kernels::ThreadPool pool(1);
  std::vector<float> out(static_cast<size_t>(s * d)), lse(static_cast<size_t>(s));
  std::vector<float> delta(static_cast<size_t>(s), 0.1f);
  std::vector<float> dq(out.size()), dk(out.size()), dv(out.size());
  kernels::FlashForward(p, pool, out.data(), lse.data(), nullptr);
  KernelStats stats;
  for (auto _ : state) {
    stats = KernelStats();
    if (backward) {
      kernels::FlashBackward(p, pool, dout.view(), lse.data(), delta.data(), dq.data(), dk.data(),
                             dv.data(), kernels::GradientSums{false, false}, &stats);
    } else {
      kernels::FlashForward(p, pool, out.data(), lse.data(), &stats);
    }
    benchmark::ClobberMemory();
  }
  // Useful FLOPs as `ringsplash bench` counts them: forward 4 D pairs,
  // backward 2.5 x that; causal counts S (S + 1) / 2 pairs, the window
  // min(i, 512) + 1 for row i.
  const auto sd = static_cast<double>(s);
  const double pairs = mask_kind == 0   ? sd * sd
                       : mask_kind == 1 ? 0.5 * sd * (sd + 1)
                                        : sd * 513.0 - 0.5 * 512.0 * 513.0;
  SetFlops(state, (backward ? 2.5 : 1.0) * 2.0 * 2.0 * static_cast<double>(d) * pairs);
  state.counters["kernel_FLOPS"] =
      benchmark::Counter(stats.flops, benchmark::Counter::kIsIterationInvariantRate);
}

// FlashForward / FlashBackward alone (no argument checks, no conversions) on
// `threads` threads, wall-clock time: the CLI's B=1, S, H=Hkv=8, D=128 full
// problem with 128 x 128 tiles. Args: S, threads, backward (0/1), heads,
// mask (0 full, 2 sliding window causal&local:512,0; useful FLOPs).
void BM_FlashThreads(benchmark::State& state) {
  const int64_t s = state.range(0), heads = state.range(3), d = 128;
  const bool window = state.range(4) == 2;
  const int threads = static_cast<int>(state.range(1));
  const bool backward = state.range(2) != 0;
  if (!Supported(KernelPath::kAvx512)) {
    state.SkipWithError("kernel path not supported on this CPU");
    return;
  }
  Tensor q(DType::kF32, {1, s, heads, d}), k(DType::kF32, {1, s, heads, d});
  Tensor v(DType::kF32, {1, s, heads, d}), dout(DType::kF32, {1, s, heads, d});
  for (Tensor* t : {&q, &k, &v, &dout}) FillTensor(*t, static_cast<uint32_t>(s));
  const Mask mask = window ? Mask::Causal() & Mask::Local(512, 0) : Mask::Full();
  kernels::FlashParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.mask = &mask;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.path = KernelPath::kAvx512;
  p.blocks = BlockSizes{128, 128};
  kernels::ThreadPool pool(threads);
  const size_t rows = static_cast<size_t>(s * heads);
  std::vector<float> out(rows * d), lse(rows), delta(rows, 0.1f);
  std::vector<float> dq(out.size()), dk(out.size()), dv(out.size());
  kernels::FlashForward(p, pool, out.data(), lse.data(), nullptr);
  for (auto _ : state) {
    if (backward) {
      kernels::FlashBackward(p, pool, dout.view(), lse.data(), delta.data(), dq.data(), dk.data(),
                             dv.data(), kernels::GradientSums{false, false}, nullptr);
    } else {
      kernels::FlashForward(p, pool, out.data(), lse.data(), nullptr);
    }
    benchmark::ClobberMemory();
  }
  const double sd = static_cast<double>(s);
  const double pairs = window ? sd * 513.0 - 0.5 * 512.0 * 513.0 : sd * sd;
  SetFlops(state, (backward ? 2.5 : 1.0) * 4.0 * d * pairs * heads);
}

// A whole public decoding call, as a serving loop makes it: AttentionForward
// (checks, schedule, thread pool, merges) of one bf16 token against Skv
// keys, D = 128, full mask, wall-clock time. At short Skv the call's fixed
// costs and its threads' hand-offs are a visible part of it (the pool's
// wake-ups, the kv ranges a call splits into: docs/perf/DESIGN_MEASUREMENTS.md,
// polling thread pool and decoding ranges). Args: Skv, H, Hkv, threads.
void BM_DecodingCall(benchmark::State& state) {
  const int64_t skv = state.range(0), heads = state.range(1), kv_heads = state.range(2), d = 128;
  Tensor q(DType::kBF16, {1, 1, heads, d}), k(DType::kBF16, {1, skv, kv_heads, d});
  Tensor v(DType::kBF16, {1, skv, kv_heads, d});
  for (Tensor* t : {&q, &k, &v}) FillTensor(*t, static_cast<uint32_t>(t->numel()));
  Tensor out(DType::kF32, {1, 1, heads, d}), lse(DType::kF32, {1, heads, 1});
  AttentionInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  AttentionOptions opt;
  opt.num_threads = static_cast<int>(state.range(3));
  AttentionForward(in, opt, out.view(), lse.view());
  for (auto _ : state) {
    AttentionForward(in, opt, out.view(), lse.view());
    benchmark::ClobberMemory();
  }
  SetFlops(state, 4.0 * static_cast<double>(d * heads * skv));
  state.counters["KVBytes"] = benchmark::Counter(static_cast<double>(2 * skv * kv_heads * d * 2),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

void FlashArgs(benchmark::internal::Benchmark* b) {
  const auto avx = static_cast<int64_t>(KernelPath::kAvx512);
  const auto bf = static_cast<int64_t>(KernelPath::kAvx512Bf16);
  const auto amx = static_cast<int64_t>(KernelPath::kAmx);
  const auto avx2 = static_cast<int64_t>(KernelPath::kAvx2);
  const BlockSizes def{128, 128};  // the recommended tile sizes (docs/PERFORMANCE.md)
  for (int64_t bwd : {0, 1}) {
    b->Args({avx2, 2048, 128, 0, 0, bwd, def.q, def.kv});
    b->Args({avx2, 2048, 64, 0, 0, bwd, def.q, def.kv});
    b->Args({avx, 2048, 128, 0, 0, bwd, def.q, def.kv});
    b->Args({avx, 2048, 64, 0, 0, bwd, def.q, def.kv});
    b->Args({avx, 2048, 128, 0, 1, bwd, def.q, def.kv});
    b->Args({avx, 8192, 128, 0, 2, bwd, def.q, def.kv});
    b->Args({avx, 2048, 128, 1, 0, bwd, def.q, def.kv});
    b->Args({bf, 2048, 128, 1, 0, bwd, def.q, def.kv});
    b->Args({amx, 2048, 128, 1, 0, bwd, def.q, def.kv});
  }
  // Tile sizes of the sliding window.
  for (const auto& [bq, bkv] : {std::pair<int64_t, int64_t>{64, 64}, {128, 64}, {256, 128}}) {
    b->Args({avx, 8192, 128, 0, 2, 0, bq, bkv});
  }
  // Sequence sweep: K/V of one head in L2 (1024) or streamed from L3.
  for (int64_t seq : {512, 1024, 4096}) b->Args({avx, seq, 128, 0, 0, 0, def.q, def.kv});
  // Tile-size sweep of the f32 forward and backward.
  for (int64_t bwd : {0, 1}) {
    for (int64_t bq : {32, 64, 128, 192, 256}) {
      for (int64_t bkv : {64, 128, 256}) b->Args({avx, 4096, 128, 0, 0, bwd, bq, bkv});
    }
  }
  b->ArgNames({"path", "S", "D", "bf16", "mask", "bwd", "bq", "bkv"});
  b->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_GemmScores)->Apply(TileArgsOf);
BENCHMARK(BM_DecodeStep)
    ->ArgsProduct({{static_cast<int64_t>(KernelPath::kAvx512),
                    static_cast<int64_t>(KernelPath::kAvx2)},
                   {1, 4, 8},
                   {0, 1},
                   {256}})
    ->ArgNames({"path", "group", "bf16", "keys"});
BENCHMARK(BM_GemmPV)->Apply(TileArgsOf);
BENCHMARK(BM_GemmPVStride)->Arg(144)->Arg(128)->Arg(256)->Arg(1024)->Arg(1040);
BENCHMARK(BM_ForwardTile)->Apply(TileArgsOf);
BENCHMARK(BM_ForwardTileExact)->Apply(TileArgsOf);
BENCHMARK(BM_ForwardTileStride)->Arg(128)->Arg(144)->Arg(256)->Arg(1024);
BENCHMARK(BM_SoftmaxColumns)->Apply(TileArgsOf);
BENCHMARK(BM_SoftmaxBf16)  // the amx table's step is avx512_bf16's
    ->ArgsProduct({{static_cast<int64_t>(KernelPath::kAvx512Bf16)}, {64, 128}, {128}, {0, 1}})
    ->ArgNames({"path", "bq", "bkv", "steady"});
BENCHMARK(BM_BackwardTile)->Apply(TileArgsOf);
BENCHMARK(BM_GemmBf16Scores)
    ->ArgsProduct({{static_cast<int64_t>(KernelPath::kAvx512Bf16),
                    static_cast<int64_t>(KernelPath::kAmx)},
                   {64, 128},
                   {128},
                   {64, 128}})
    ->ArgNames({"path", "bq", "bkv", "d"});
BENCHMARK(BM_GemmBf16Accumulate)
    ->ArgsProduct({{static_cast<int64_t>(KernelPath::kAvx512Bf16),
                    static_cast<int64_t>(KernelPath::kAmx)},
                   {128},
                   {128},
                   {64, 128}})
    ->ArgNames({"path", "bq", "bkv", "d"});
BENCHMARK(BM_PackTransposedF32)->Args({64, 128})->Args({64, 64});
BENCHMARK(BM_PackRowsF32)->Args({128, 128, 0})->Args({128, 128, 1});
BENCHMARK(BM_Flash)->Apply(FlashArgs);
BENCHMARK(BM_DecodingCall)
    ->ArgsProduct({{128, 1024, 4096}, {32}, {8}, {1, 2}})
    ->ArgsProduct({{512, 1024, 2048}, {8}, {1}, {1, 2}})
    ->ArgNames({"Skv", "H", "Hkv", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FlashThreads)
    ->ArgsProduct({{2048, 4096}, {1, 2}, {0, 1}, {8}, {0}})
    ->ArgsProduct({{2048}, {1}, {0}, {1, 2, 4}, {0}})
    ->ArgsProduct({{32768}, {1, 2}, {0}, {8}, {2}})
    ->ArgNames({"S", "threads", "bwd", "H", "mask"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ringsplash::bench

BENCHMARK_MAIN();

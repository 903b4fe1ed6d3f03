// Peak measurement: runtime dispatch, the portable loop, and the threads.
#include "tools/peak.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "ringsplash/attention.h"
#include "src/kernels/cpu_features.h"

namespace ringsplash::cli {
namespace {

double PortableFma(int64_t iters) {
  // Scalar chains; the compiler may vectorise them with the baseline ISA,
  // which is exactly what portable code can reach.
  constexpr int kChains = 8;
  float acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = static_cast<float>(j);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * 0.5f + 0.5f;
  }
  float sum = 0;
  for (float a : acc) sum += a;
  volatile float sink = sum;
  (void)sink;
  return static_cast<double>(iters) * kChains * 2;
}

#if defined(__x86_64__)
bool Supports(KernelPath path) {
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  return std::find(paths.begin(), paths.end(), path) != paths.end();
}
#endif

// GFLOP/s of `loop` running on `threads` threads at once for `seconds`.
double MeasureLoop(double (*loop)(int64_t), int threads, double seconds) {
  loop(1000);  // warm up: page in the code, let the clock ramp
  constexpr int64_t kChunk = 1 << 18;
  std::atomic<bool> go{false};
  std::vector<double> flops(static_cast<size_t>(threads), 0.0);
  std::vector<std::thread> pool;
  const auto duration = std::chrono::duration<double>(seconds);
  std::chrono::steady_clock::time_point start;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      const auto deadline = start + duration;
      double f = 0;
      while (std::chrono::steady_clock::now() < deadline) f += loop(kChunk);
      flops[t] = f;
    });
  }
  start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double f : flops) total += f;
  return total / elapsed / 1e9;
}

}  // namespace

Peak MeasurePeak(DType dtype, int threads, double seconds) {
  Peak peak;
  peak.threads = std::max(1, threads);
#if defined(__x86_64__)
  const bool avx512 = Supports(KernelPath::kAvx512) || Supports(KernelPath::kAvx512Bf16);
  if (!avx512 && Supports(KernelPath::kAvx2)) {
    // bf16 data runs as f32 FMAs on this path (no bf16 dot product).
    peak.method = "avx2 fmadd_ps";
    peak.gflops = MeasureLoop(peak_detail::FmaF32Avx2, peak.threads, seconds);
    return peak;
  }
  if (avx512) {
    peak.method = "avx512 fmadd_ps";
    peak.gflops = MeasureLoop(peak_detail::FmaF32Avx512, peak.threads, seconds);
    // bf16 data can run on either instruction (converted to f32 for FMA, or
    // vdpbf16ps directly); its peak is the faster of the two, so a kernel on
    // either path never exceeds 100 % of it.
    if (dtype == DType::kBF16 && Supports(KernelPath::kAvx512Bf16)) {
      const double dp = MeasureLoop(peak_detail::DpBf16Avx512, peak.threads, seconds);
      if (dp > peak.gflops) {
        peak.gflops = dp;
        peak.method = "avx512 dpbf16_ps";
      }
    }
    // Tiles only where the process may use them (the kernels asked already).
    if (dtype == DType::kBF16 && ResolveKernelPath(KernelPath::kAuto) == KernelPath::kAmx &&
        kernels::AmxTilesPermitted()) {
      peak.tile_gflops = MeasureLoop(peak_detail::TileBf16Amx, peak.threads, seconds);
    }
    return peak;
  }
#endif
  // No AVX2 (or not x86-64, where only the portable path is built).
  (void)dtype;
  peak.method = "portable scalar fma";
  peak.gflops = MeasureLoop(PortableFma, peak.threads, seconds);
  return peak;
}

}  // namespace ringsplash::cli

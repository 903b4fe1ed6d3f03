// Peak measurement: runtime dispatch, the portable loop, and the threads.
#include "tools/peak.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "ringsplash/attention.h"
#include "src/kernels/micro/cpu_features.h"

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

int UsableCores() {
#if defined(__linux__)
  // A mask as large as the kernel's: EINVAL means the set was too small for
  // it (machines of more than 1024 CPUs), so try a larger one.
  for (int cpus = 1024; cpus <= (1 << 20); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(size, set);
    const int rc = sched_getaffinity(0, size, set);
    const int count = rc == 0 ? CPU_COUNT_S(size, set) : 0;
    const int error = errno;
    CPU_FREE(set);
    if (rc == 0) {
      if (count > 0) return count;
      break;
    }
    if (error != EINVAL) break;
  }
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Peak MeasurePeak(DType dtype, int threads, double seconds) {
  Peak peak;
  peak.threads = std::clamp(threads, 1, UsableCores());
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

double RateBound(const Peak& peak) { return std::max(peak.gflops, peak.tile_gflops); }

PeakFraction FractionOfPeak(double gflops, const Peak& peak) {
  PeakFraction f;
  if (!(peak.gflops > 0)) {
    f.unreliable_reason = "no peak was measured";
    return f;
  }
  if (gflops > RateBound(peak)) {
    char why[256];
    std::snprintf(why, sizeof(why),
                  "the run's %.1f GFLOP/s is above the measured peak of %.1f GFLOP/s (%s, %d "
                  "threads): other work had the cores while the peak was measured",
                  gflops, RateBound(peak),
                  peak.tile_gflops > peak.gflops ? "AMX tiles" : peak.method.c_str(), peak.threads);
    f.unreliable_reason = why;
    return f;
  }
  f.of_peak = gflops / peak.gflops;
  if (peak.tile_gflops > 0) f.of_tile_peak = gflops / peak.tile_gflops;
  return f;
}

Peak HigherPeak(const Peak& a, const Peak& b) {
  Peak p = a;
  if (b.gflops > p.gflops) {
    p.gflops = b.gflops;
    p.method = b.method;
  }
  p.tile_gflops = std::max(a.tile_gflops, b.tile_gflops);
  return p;
}

SettledPeak SettlePeak(double gflops, const Peak& first,
                       const std::function<Peak()>& measure_again) {
  SettledPeak s;
  s.peak = first;
  s.fraction = FractionOfPeak(gflops, first);
  if (s.fraction.reliable()) return s;
  s.peak = HigherPeak(first, measure_again());
  s.measurements = 2;
  s.fraction = FractionOfPeak(gflops, s.peak);
  if (!s.fraction.reliable()) s.fraction.unreliable_reason += " (measured twice)";
  return s;
}

std::string DescribeFraction(const PeakFraction& fraction) {
  if (!fraction.reliable()) return "n/a (peak measurement unreliable on a busy machine)";
  char text[128];
  int n = std::snprintf(text, sizeof(text), "%.1f %% of peak", 100 * *fraction.of_peak);
  if (fraction.of_tile_peak) {
    std::snprintf(text + n, sizeof(text) - static_cast<size_t>(n), ", %.1f %% of the AMX tile peak",
                  100 * *fraction.of_tile_peak);
  }
  return text;
}

}  // namespace ringsplash::cli

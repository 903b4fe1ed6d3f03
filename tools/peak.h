// This machine's arithmetic peak, measured by the running process.
//
// A register-only micro-benchmark: many independent accumulator chains of the
// widest multiply-add the CPU has, on `threads` threads at once, for a fixed
// time. f32: _mm512_fmadd_ps (16 lanes x 2 FLOP). bf16: the faster of
// _mm512_dpbf16_ps (32 bf16 pairs x 2 FLOP = 64 FLOP) and the f32 FMA loop
// (bf16 data can be computed either way). Without AVX-512 but with AVX2:
// _mm256_fmadd_ps (8 lanes x 2 FLOP). Without either: a portable scalar
// loop, which is what a portable build could reach. On the amx kernel path
// bf16 runs also measure the AMX tile loop (TDPBF16PS, 16384 FLOP each) into
// tile_gflops: the bf16 forward's products run there, so its GFLOP/s can
// exceed the vector peak; gflops stays the vector peak the targets are
// defined against (docs/PERFORMANCE.md). Dispatch is at run time
// (SupportedKernelPaths), so one binary runs on any x86-64. Builds for other
// processors have only the portable loop (the AVX files are not compiled).
//
// A measured peak is only as good as the cores it had: other work on the
// machine lowers it, and a run can then appear to beat it. Such a fraction of
// peak is never reported as real (SettlePeak: measure once more, else mark
// the fraction unreliable).
#ifndef RINGSPLASH_TOOLS_PEAK_H_
#define RINGSPLASH_TOOLS_PEAK_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "ringsplash/tensor.h"

namespace ringsplash::cli {

struct Peak {
  double gflops = 0;       // all `threads` together
  std::string method;      // "avx512 fmadd_ps", "avx512 dpbf16_ps", "avx2 fmadd_ps",
                           // "portable scalar fma"
  int threads = 0;         // threads the loops ran on
  double tile_gflops = 0;  // AMX tile peak, bf16 on the amx path only (else 0)
};

// The CPUs this process may run on: the size of the calling thread's affinity
// mask (sched_getaffinity; taskset, cgroup cpusets and mpirun's binding shrink
// it), or std::thread::hardware_concurrency() where there is none. >= 1.
int UsableCores();

// Runs for about `seconds` of wall time on min(threads, UsableCores())
// threads (peak.threads): threads beyond the cores would only share them, and
// a loop that loses its core part of the time measures the scheduler, not the
// arithmetic units.
Peak MeasurePeak(DType dtype, int threads, double seconds = 0.25);

// A run's rate as a fraction of the peak measured for it.
struct PeakFraction {
  // gflops over Peak::gflops, and over Peak::tile_gflops where one was
  // measured; both absent when unreliable.
  std::optional<double> of_peak, of_tile_peak;
  // Non-empty exactly when the fractions are absent: why.
  std::string unreliable_reason;
  bool reliable() const { return unreliable_reason.empty(); }
};

// The fastest the run's products could go: the vector peak, or the AMX tile
// peak where one was measured (bf16 products on tiles can beat the vector
// peak, so only there may of_peak exceed 1).
double RateBound(const Peak& peak);

// The fractions of `gflops`, or, when it is above RateBound (no run beats the
// machine's real peak: the measurement was low) or no peak was measured, none
// and the reason.
PeakFraction FractionOfPeak(double gflops, const Peak& peak);

// Of two measurements of one peak, the higher per loop (a busy machine only
// ever lowers a measurement); threads and method of the first.
Peak HigherPeak(const Peak& a, const Peak& b);

// The peak and fractions of a run that reached `gflops`, given the peak
// measured after it (`first`): when the rate is above it, `measure_again` runs
// once and the higher of the two measurements counts; a rate still above it
// leaves the fractions unreliable. `measurements` is 1 or 2.
struct SettledPeak {
  Peak peak;
  PeakFraction fraction;
  int measurements = 1;
};
SettledPeak SettlePeak(double gflops, const Peak& first,
                       const std::function<Peak()>& measure_again);

// For the demo's table: "63.1 % of peak", with ", 41.0 % of the AMX tile
// peak" where one was measured, or "n/a (peak measurement unreliable on a
// busy machine)".
std::string DescribeFraction(const PeakFraction& fraction);

namespace peak_detail {
// Each runs `iters` loop trips and returns the FLOPs it performed. Defined in
// files compiled with the matching -m flags; call only when supported.
double FmaF32Avx2(int64_t iters);
double FmaF32Avx512(int64_t iters);
double DpBf16Avx512(int64_t iters);
double TileBf16Amx(int64_t iters);
}  // namespace peak_detail

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_PEAK_H_

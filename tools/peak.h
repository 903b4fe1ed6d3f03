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
#ifndef RINGSPLASH_TOOLS_PEAK_H_
#define RINGSPLASH_TOOLS_PEAK_H_

#include <cstdint>
#include <string>

#include "ringsplash/tensor.h"

namespace ringsplash::cli {

struct Peak {
  double gflops = 0;   // all `threads` together
  std::string method;  // "avx512 fmadd_ps", "avx512 dpbf16_ps", "avx2 fmadd_ps",
                       // "portable scalar fma"
  int threads = 0;
  double tile_gflops = 0;  // AMX tile peak, bf16 on the amx path only (else 0)
};

// Runs for about `seconds` of wall time.
Peak MeasurePeak(DType dtype, int threads, double seconds = 0.25);

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

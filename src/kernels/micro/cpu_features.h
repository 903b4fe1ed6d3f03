// Runtime CPU feature detection for the micro-kernel dispatch.
//
// The AVX2 and AVX-512 micro-kernels live in translation units compiled with
// those flags (micro/path_avx2.cc, micro/*_avx512*.cc, micro/path_amx.cc); nothing may call into
// them unless these checks say the CPU (and the OS, which must save the ymm / zmm state) supports
// them.
#ifndef RINGSPLASH_KERNELS_MICRO_CPU_FEATURES_H_
#define RINGSPLASH_KERNELS_MICRO_CPU_FEATURES_H_

namespace ringsplash::kernels {

struct CpuFeatures {
  bool avx2 = false;         // AVX2, FMA, F16C and OS ymm support
  bool avx512 = false;       // avx2 and AVX512 F+BW+VL+DQ and OS zmm support
  bool avx512_bf16 = false;  // avx512 and AVX512_BF16 (vdpbf16ps, vcvtneps2bf16)
  // Whether vdpbf16ps runs at (at least) the f32 FMA instruction rate, i.e.
  // bf16 products reach twice the f32 FLOP rate: set on AMD CPUs (Zen 4 and
  // 5 execute it on the FMA pipes at the FMA instruction rate), not on
  // Intel's (Sapphire Rapids-class cores issue vdpbf16ps zmm at half the FMA
  // rate, so its FLOP rate only equals f32 FMA and the avx512 path, bf16
  // widened to f32, is as fast and more accurate). Rates: docs/perf/PATHS.md,
  // "bf16 on vdpbf16ps". kAuto prefers avx512_bf16 only when this is true.
  bool fast_bf16_dot = false;
  // avx512_bf16 and AMX-TILE + AMX-BF16, and the OS saving the tile state
  // (XCR0 bits 17, 18). Linux also wants a per-process permission before the
  // first tile instruction (else SIGILL); that is asked only when tiles are
  // first needed: AmxTilesPermitted().
  bool amx = false;
  // Whether the hardware prefetchers keep up with the K/V row streams of
  // decoding steps that carry under 4 FLOPs per byte, so the AVX2 step
  // makes no software requests for them (decode/step_avx2.cc,
  // kRequestAhead): set on AMD CPUs. On a Zen 3 the requests made such steps
  // 1.2-1.4x slower; on the Intel Xeon host, requests made GQA steps
  // 1.3-1.6x faster (AVX-512 step; docs/perf/DESIGN_MEASUREMENTS.md:
  // decoding prefetch). A speed property, as fast_bf16_dot.
  bool hw_prefetch_streams = false;
};

// Detected once (cpuid + xgetbv), then cached; while a
// ScopedCpuFeaturesForTesting lives, its features instead.
const CpuFeatures& DetectCpuFeatures();

// Tests only: while alive, DetectCpuFeatures() (and with it the supported
// paths, ResolveKernelPath and kAuto) reports `features`, each instruction-
// set bit ANDed with what this CPU has and with the narrower sets it needs
// (an override can hide a set, never add one, so no path the CPU cannot
// run becomes callable), fast_bf16_dot and hw_prefetch_streams as
// given (speed properties, no instructions behind them). Lets the refusal of
// unsupported paths and the order kAuto resolves in be tested on any CPU.
// Not thread-safe: for test bodies that make no concurrent calls.
class ScopedCpuFeaturesForTesting {
 public:
  explicit ScopedCpuFeaturesForTesting(const CpuFeatures& features);
  ~ScopedCpuFeaturesForTesting();
  ScopedCpuFeaturesForTesting(const ScopedCpuFeaturesForTesting&) = delete;
  ScopedCpuFeaturesForTesting& operator=(const ScopedCpuFeaturesForTesting&) = delete;

 private:
  CpuFeatures features_;
  const CpuFeatures* previous_;
};

// Whether this process may run AMX tile instructions: DetectCpuFeatures().amx
// and, on Linux, the tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM),
// requested on the first call and cached. The permission is process-wide and
// cannot be dropped; afterwards Linux refuses sigaltstacks too small for the
// 8 KiB tile state, and the request fails if such a stack is installed
// already — so it is made only when bf16 work is about to use tiles, never
// by detection. Without it the amx path's products run on vdpbf16ps.
bool AmxTilesPermitted();

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_MICRO_CPU_FEATURES_H_

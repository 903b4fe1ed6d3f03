// Runtime CPU feature detection for the micro-kernel dispatch.
//
// The AVX2 and AVX-512 micro-kernels live in translation units compiled with
// those flags (micro_avx2.cc, micro_avx512*.cc); nothing may call into them
// unless these checks say the CPU (and the OS, which must save the ymm / zmm
// state) supports them.
#ifndef RINGSPLASH_KERNELS_CPU_FEATURES_H_
#define RINGSPLASH_KERNELS_CPU_FEATURES_H_

namespace ringsplash::kernels {

struct CpuFeatures {
  bool avx2 = false;         // AVX2, FMA, F16C and OS ymm support
  bool avx512 = false;       // avx2 and AVX512 F+BW+VL+DQ and OS zmm support
  bool avx512_bf16 = false;  // avx512 and AVX512_BF16 (vdpbf16ps, vcvtneps2bf16)
  // Whether vdpbf16ps runs at (at least) the f32 FMA instruction rate, i.e.
  // bf16 products are ~2x the f32 FLOP rate. Measured on Intel Sapphire
  // Rapids-class Xeons: vdpbf16ps zmm issues at half the FMA rate, so its
  // FLOP rate only equals f32 FMA and the avx512 path (bf16 widened to f32)
  // is as fast and more accurate. On AMD Zen 4/5 it executes on the FMA pipes
  // (assumed full rate: not measured on such a machine). kAuto prefers
  // avx512_bf16 only when this is true.
  bool fast_bf16_dot = false;
  // avx512_bf16 and AMX-TILE + AMX-BF16, the OS saving the tile state (XCR0
  // bits 17, 18) and, on Linux, granting this process the tile-data
  // permission (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile
  // instruction raises SIGILL). The request is made once, during detection.
  bool amx = false;
};

// Detected once (cpuid + xgetbv), then cached.
const CpuFeatures& DetectCpuFeatures();

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_CPU_FEATURES_H_

// Runtime CPU feature detection for the micro-kernel dispatch.
//
// The AVX-512 micro-kernels live in translation units compiled with AVX-512
// flags (micro_avx512*.cc); nothing may call into them unless these checks
// say the CPU (and the OS, which must save the zmm state) supports them.
#ifndef RINGSPLASH_KERNELS_CPU_FEATURES_H_
#define RINGSPLASH_KERNELS_CPU_FEATURES_H_

namespace ringsplash::kernels {

struct CpuFeatures {
  bool avx512 = false;       // AVX512 F+BW+VL+DQ, FMA, F16C and OS zmm support
  bool avx512_bf16 = false;  // avx512 and AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16)
};

// Detected once (cpuid + xgetbv), then cached.
const CpuFeatures& DetectCpuFeatures();

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_CPU_FEATURES_H_

// AVX-512 f32 micro-kernel table (compiled with -mavx512f/bw/vl/dq -mfma;
// used only after runtime detection, see micro.h). The GEMM building blocks
// live in micro_avx512.h, the fused transposed-layout tile kernels in
// micro_fused_avx512.cc.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "src/kernels/micro_avx512.h"

#include "src/kernels/micro.h"

namespace ringsplash::kernels::micro {

const MicroKernels& Avx512MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = PortableMicroKernels();
    t.name = "avx512";
    t.gemm_f32 = GemmF32Avx512;
    t.gemm_f32_ranges = GemmF32RangesAvx512;
    t.mask_bits = avx512::MaskBits;
    t.transpose_f32 = avx512::TransposeF32;
    t.softmax_columns = avx512::SoftmaxColumns;
    t.forward_tile = avx512::ForwardTile;
    t.backward_tile = avx512::BackwardTile;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro

// BackwardTileFn of the AVX-512 kernels, products computed in registers
// (micro/fused_bwd_avx512.h); products stored by tile GEMMs go to
// BackwardTileStored (micro/fused_bwd_stored_avx512.cc).
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "src/kernels/micro/fused_bwd_avx512.h"

namespace ringsplash::kernels::micro::avx512 {

void BackwardTile(const BackwardTileArgs& b) {
  if (b.products_stored) {
    BackwardTileStored(b);
    return;
  }
  bwd::BackwardTileImpl<false>(b);
}

}  // namespace ringsplash::kernels::micro::avx512

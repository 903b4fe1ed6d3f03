// BackwardTileFn of the AVX-512 kernels on products already stored in t.pt
// and b.ds (BackwardTileArgs::products_stored: the bf16 products' GemmBf16Fn);
// the epilogues are micro/fused_bwd_avx512.h's.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "src/kernels/micro/fused_bwd_avx512.h"

namespace ringsplash::kernels::micro::avx512 {

void BackwardTileStored(const BackwardTileArgs& b) { bwd::BackwardTileImpl<true>(b); }

}  // namespace ringsplash::kernels::micro::avx512

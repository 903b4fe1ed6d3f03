// FlashForwardMerge: the forward of flash.h merged into an existing partial
// result instead of overwriting it — for callers that combine several key
// slices (the ring's steps), so they need no second [B, Sq, H, Dv] buffer
// for each step's partial output.
#ifndef RINGSPLASH_KERNELS_FLASH_MERGE_H_
#define RINGSPLASH_KERNELS_FLASH_MERGE_H_

#include "src/kernels/flash/flash.h"

namespace ringsplash::kernels {

// (out, lse) <- MergePartial((out, lse), FlashForward over p's k/v): bitwise
// what FlashForward into scratch followed by MergePartial (combine.h) gives,
// row by row. out [B, Sq, H, Dv] and lse [B, H, Sq] are f32 contiguous and
// must hold a partial result already (an empty one: out 0, lse -inf).
void FlashForwardMerge(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                       KernelStats* stats);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_FLASH_MERGE_H_

// Useful FLOPs of attention: what the mask leaves to compute, not what a
// kernel happened to spend.
//
//   pairs    = number of allowed (q, kv) pairs, summed over query heads
//   forward  = 2 * B * (D + Dv) * pairs    (S = Q K^T: 2*D per pair; O = P V: 2*Dv per pair)
//              = 4 * B * H * D * pairs_per_head when Dv == D and the mask is head-independent
//   backward = 2.5 * forward               (dV, dP, dS->dQ, dS->dK: 4 matmuls, + recomputing S
//                                           counted as in FlashAttention-2's accounting)
//   forward + backward = 3.5 * forward
#ifndef RINGSPLASH_TOOLS_FLOP_COUNT_H_
#define RINGSPLASH_TOOLS_FLOP_COUNT_H_

#include <cstdint>

#include "ringsplash/mask.h"

namespace ringsplash::cli {

enum class Pass { kFwd, kBwd, kFwdBwd };
const char* PassName(Pass pass);  // "fwd", "bwd", "fwdbwd"

// Allowed pairs of `mask` over q positions 0..sq-1 and kv positions
// 0..skv-1, summed over `heads` query heads. Counts full tiles of the block
// map analytically and evaluates the mask only inside partial tiles, so a
// 32k x 32k causal mask costs O(S * tile) work, not O(S^2).
double AllowedPairs(const Mask& mask, int64_t sq, int64_t skv, int64_t heads);

// The formula above; `pairs` as returned by AllowedPairs.
double UsefulFlops(double pairs, int64_t batch, int64_t d, int64_t dv, Pass pass);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_FLOP_COUNT_H_

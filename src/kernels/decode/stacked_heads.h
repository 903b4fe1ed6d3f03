// Query heads stacked into rows for short query blocks (decoding, speculative
// and chunked steps) with GQA / MQA.
//
// With Sq rows per head, a head's q block holds only Sq rows (one token when
// decoding: one lane of sixteen), and every query head of a kv group streams
// the same K and V tiles again — unstacked, a decode step with H = 32,
// Hkv = 4 reads its K and V eight times. The stacked problem puts the
// group's heads side by side as rows of one head per kv head (i major, so
// rows of one position stay together):
//   q'[b, i * g + hh, kh, :]    = q[b, i, kh * g + hh, :]     (a copy: Sq small)
//   q_pos'[i * g + hh]          = q_pos[i]
//   q_segments'[b, i * g + hh]  = q_segments[b, i]
// with k, v, kv_pos and kv_segments unchanged (H' = Hkv, one head per group).
// Its results map back row for row (FlashForward finishes each stacked row
// straight into its place):
//   out'[b, i * g + hh, kh, :] -> out[b, i, kh * g + hh, :]
//   lse'[b, kh, i * g + hh]    -> lse[b, kh * g + hh, i]
// Each row sees the same keys in the same order; which tiles take the lazy
// or the exact softmax step depends on the rows sharing them, so results
// may round differently from an unstacked call (never with the thread
// count: stacking depends on the shapes only).
#ifndef RINGSPLASH_KERNELS_DECODE_STACKED_HEADS_H_
#define RINGSPLASH_KERNELS_DECODE_STACKED_HEADS_H_

#include <cstdint>
#include <vector>

#include "ringsplash/tensor.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/schedule.h"
#include "src/kernels/thread_pool.h"

namespace ringsplash::kernels {

class StackedHeads {
 public:
  // Whether p is stacked: the schedule's choice (UseStackedHeads,
  // flash/schedule.h).
  static bool Applies(const FlashParams& p) { return UseStackedHeads(p); }

  // Copies q (rows of each batch element in parallel on `pool`).
  StackedHeads(const FlashParams& p, ThreadPool& pool);
  StackedHeads(const StackedHeads&) = delete;
  StackedHeads& operator=(const StackedHeads&) = delete;

  const FlashParams& params() const { return params_; }
  int64_t group() const { return group_; }

 private:
  FlashParams params_;
  int64_t group_ = 1;
  Tensor q_;                    // [B, Sq * g, Hkv, D], q's dtype
  std::vector<int64_t> q_pos_;  // [Sq * g]
  Tensor q_segments_;           // [B, Sq * g] i32, when p has segments
};

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_DECODE_STACKED_HEADS_H_

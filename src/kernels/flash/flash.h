// The block-sparse flash kernels every entry point runs (SPEC §2), in the
// spirit of flash-attention's flash.h: one documented parameter struct, the
// variants (dtype, micro-kernel path) chosen inside.
//
// Callers validate inputs first (ValidateAttentionInputs); kernels assume
// checked shapes. Sinks are NOT applied here (but by FlashForwardBf16Out,
// which writes final rows): the forward produces a partial (out, lse) over
// the given k/v only, so the ring can merge steps and add sinks once per row
// (see combine.h).
#ifndef RINGSPLASH_KERNELS_FLASH_FLASH_H_
#define RINGSPLASH_KERNELS_FLASH_FLASH_H_

#include <atomic>
#include <cstdint>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "src/kernels/thread_pool.h"

namespace ringsplash::mask {
class BlockMap;
}

namespace ringsplash::kernels {

struct FlashParams {
  TensorView q;                     // [B, Sq, H, D]    f32 | bf16 | f16, any strides
  TensorView k;                     // [B, Skv, Hkv, D] same dtype
  TensorView v;                     // [B, Skv, Hkv, Dv] same dtype
  TensorView q_segments;            // [B, Sq] i32, or undefined
  TensorView kv_segments;           // [B, Skv] i32, or undefined (defined iff q_segments is)
  const int64_t* q_pos = nullptr;   // [Sq] global positions of q rows
  const int64_t* kv_pos = nullptr;  // [Skv] global positions of k/v rows
  const Mask* mask = nullptr;
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: no soft cap
  BlockSizes blocks;
  KernelPath path = KernelPath::kPortable;  // resolved: never kAuto
  // When set, the kernel (forward or backward) checks every q row and every
  // k/v row of the tiles it computes for NaN/Inf as it reads them, and sets
  // the flag if it meets one: then (and only then) the result may differ
  // from the non-finite rule of poison.h, and the caller must redo the call
  // on cleaned inputs. (The backward's other inputs are the caller's to
  // check: a non-finite out or dout shows in delta.) k/v rows in no
  // computed tile pair with no query, so skipping them cannot change the
  // rule's outcome. Costs nearly nothing: the rows
  // are checked while the compute brings them into cache anyway, instead of
  // in a separate memory-bound pass over every input.
  std::atomic<bool>* non_finite = nullptr;
  // Block maps built ahead for exactly this problem's q_pos, kv_pos, mask,
  // H and tile geometry (Geometry::Of): a RingPlan builds them once and
  // serves every call and ring step with them. Null (or a map of other
  // dimensions, e.g. for a restacked problem) and the call builds its own.
  const mask::BlockMap* row_map = nullptr;     // by_column = false (forward, dQ)
  const mask::BlockMap* column_map = nullptr;  // by_column = true (dK, dV)
};

// Partial forward over the given k/v, no sinks.
//   out [B, Sq, H, Dv] f32 contiguous: softmax-normalised over the allowed keys
//   lse [B, H, Sq]     f32 contiguous
// A row with no allowed key gets out = 0 and lse = -inf (never NaN).
void FlashForward(const FlashParams& p, ThreadPool& pool, float* out, float* lse,
                  KernelStats* stats);

// A bf16 out that FlashForwardBf16Out writes directly: element (b, i, h, c)
// at data[b * stride[0] + i * stride[1] + h * stride[2] + c] (strides in
// elements, unit stride over Dv). With `sinks` ([H], or null) every finished
// row also gets its head's sink logit in the denominator (ApplySinks, the
// same f32 operations on the row before it is rounded).
struct Bf16Out {
  uint16_t* data = nullptr;
  int64_t stride[3] = {0, 0, 0};
  const float* sinks = nullptr;
};

// FlashForward with out written as bf16 (rounded to nearest even) straight
// into `out` [B, Sq, H, Dv]: no f32 copy of out, twice out's bytes, for
// callers that want bf16 anyway. Equals rounding FlashForward's out (then
// ApplySinks's, with sinks; lse then includes them too). Returns false if a
// finite result rounded to a bf16 infinity (|out| beyond bf16's range, only
// possible when |v| reaches it); out is then incomplete and the caller
// redoes the call in f32 (for its error message).
bool FlashForwardBf16Out(const FlashParams& p, ThreadPool& pool, const Bf16Out& out, float* lse,
                         KernelStats* stats);

// What FlashBackward does with the contents of its accumulators: ADD (+=)
// to them, so the ring can add step after step, or WRITE them whole (every
// element, zeros where no pair contributes; the old contents are never
// read), which spares a caller zeroing them first — a pass over memory the
// kernel then writes anyway.
struct GradientSums {
  bool add_dq = true;   // dq_acc
  bool add_dkv = true;  // dk_acc and dv_acc
};

// Backward contribution of this (q, k/v) pair into f32 contiguous buffers
//   dq_acc [B, Sq, H, D], dk_acc [B, Skv, Hkv, D], dv_acc [B, Skv, Hkv, Dv]
// (added or written: `sums`).
// dout [B, Sq, H, Dv] (dtype of q or f32, any strides); lse [B, H, Sq] is the
// FINAL lse (all k/v and sinks); delta [B, H, Sq] = rowsum(dout * out) (f32).
// dk/dv sum over every query head of a group. Race-free and deterministic:
// no float atomics; the result does not depend on the thread count.
void FlashBackward(const FlashParams& p, ThreadPool& pool, const TensorView& dout, const float* lse,
                   const float* delta, float* dq_acc, float* dk_acc, float* dv_acc,
                   const GradientSums& sums, KernelStats* stats);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_FLASH_FLASH_H_

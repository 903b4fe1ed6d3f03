// Non-finite inputs (the "NaN and Inf" rule of docs/RELIABILITY.md): a NaN or
// infinity reaches exactly the outputs that mathematically depend on it, whole
// rows at a time, and masked pairs contribute nothing.
//
// The flash kernels cannot guarantee that by themselves (inside a partially
// masked tile a masked NaN value still meets P = 0 in a product: 0 * NaN), so
// the entry points do it around them:
//   1. scan the inputs for non-finite rows (one O(n) pass; the normal case
//      stops here);
//   2. run the kernels on CLEANED copies (non-finite -> 0), so every output
//      is finite and equal to attention over the cleaned inputs;
//   3. compute which output rows depend on a poisoned input (loops over the
//      poisoned rows only) and overwrite them whole with NaN.
// The dependency sets, with "allowed" = mask and segment ids and
// g = h / (H / Hkv):
//   lse[b,h,i]  q[b,i,h] bad and row i has an allowed key; an allowed k row
//               bad
//   out[b,h,i]  lse poisoned or an allowed v row bad
//   PR[b,h,i]   out poisoned or dout[b,i,h] bad (dq poisoned)
//   dk[b,j,g]   some row (b,h,i) of group g allowing j is PR
//   dv[b,j,g]   some row of group g allowing j has lse poisoned or bad dout
//   dsinks[h]   some row of head h is PR
// Sinks are not data here: NaN and +inf sinks are refused by validation
// (validate.cc) and -inf is a valid "no sink" (combine.h handles it).
// Row flags are chars (0/1); row-major orders are given per function.
#ifndef RINGSPLASH_KERNELS_POISON_H_
#define RINGSPLASH_KERNELS_POISON_H_

#include <cstdint>
#include <vector>

#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "src/kernels/validate.h"

namespace ringsplash::kernels::micro {
struct MicroKernels;
}  // namespace ringsplash::kernels::micro

namespace ringsplash::kernels {

class ThreadPool;

// Bits of a key/value row flag ([B, Skv, Hkv]).
constexpr char kKeyBad = 1;
constexpr char kValueBad = 2;

// Whether element `offset` of a float view (f32, bf16, f16) is NaN or +-inf.
bool NonFiniteAt(const TensorView& t, int64_t offset);

// Whether rows [s0, s0 + rows) of head `head` of batch b of a 4-D float view
// [B, S, Heads, X] hold a NaN or an infinity. (The kernels' own check of the
// rows they read, FlashParams::non_finite.) 16-bit rows of unit inner
// stride go to mk's any_non_finite16 where the table has one.
bool AnyNonFinite(const TensorView& t, int64_t b, int64_t s0, int64_t rows, int64_t head,
                  const micro::MicroKernels* mk = nullptr);

// Which (query row, key row) pairs are allowed: the mask on positions and
// equal segment ids. The views may be undefined (no segment ids).
struct PairRule {
  const Mask* mask = nullptr;
  const int64_t* q_pos = nullptr;   // [Sq]
  const int64_t* kv_pos = nullptr;  // [Skv]
  TensorView q_segments;            // [B, Sq] i32
  TensorView kv_segments;           // [B, Skv] i32
  bool Allowed(int64_t b, int64_t head, int64_t i, int64_t j) const;
};

// The rule's whole interface is the three pieces below, used the same way by
// the single-device entry points (attention.cc: one key/value set, the whole
// sequence) and by the ring (one set per ring step, a slice):
//   KeyValueScan / CleanKeyValuesInPlace  step 1-2 for k and v;
//   ForwardPoison                         step 1-2 for q, step 3 forward;
//   BackwardPoison                        steps 1-3 backward.
// In the normal case (nothing non-finite) each costs one scan and allocates
// nothing else.

// Step 1-2 for a set of key/value rows held contiguously (a ring slice, just
// packed): flags ([B, Skv, Hkv], resized to zeros) get kKeyBad / kValueBad
// for rows of k / v holding a NaN or an infinity, and those elements are
// replaced by 0. Returns whether any row was flagged.
bool CleanKeyValuesInPlace(const TensorView& k, const TensorView& v, std::vector<char>& flags);

// Step 1-2 for the caller's k and v ([B, Skv, Hkv, D] and [..., Dv], any
// strides): scans them and, when a row is not finite, makes cleaned copies.
class KeyValueScan {
 public:
  KeyValueScan(const TensorView& k, const TensorView& v, ThreadPool* pool);
  bool any() const { return any_; }
  // The row flags [B, Skv, Hkv] (kKeyBad | kValueBad), or null when no row
  // is flagged (what ForwardPoison::AddKeys takes).
  const char* flags() const { return any_ ? flags_.data() : nullptr; }
  // The views the kernels read: cleaned copies when any(), else k and v.
  const TensorView& k() const { return k_; }
  const TensorView& v() const { return v_; }

 private:
  std::vector<char> flags_;
  bool any_ = false;
  Tensor k_own_, v_own_;
  TensorView k_, v_;
};

// Steps 1-3 of a forward over this call's (or this rank's) query rows:
//   ForwardPoison fp(d, q, pool);       // scans q; q() is what kernels read
//   for each key/value set the rows see (cleaned, with its row flags):
//     fp.AddKeys(rule, flags);          // rule: this set's positions
//   ... kernels, merges, sinks ...
//   fp.Fill(out, lse);                  // NaN over the dependent rows
// `d` gives the query side (b, sq, h, dv) and, at each AddKeys, the set's
// skv and hkv: a ring slice has the same local sizes on every rank.
class ForwardPoison {
 public:
  ForwardPoison(const AttentionDims& d, const TensorView& q, ThreadPool* pool);
  bool any_q() const { return any_q_; }
  // The view the kernels read: a cleaned copy when any_q(), else q.
  const TensorView& q() const { return q_; }
  // Marks the rows [B, H, Sq] that depend on a poisoned q row or a flagged
  // k/v row of this set (`kv_flags` [B, Skv, Hkv], null: none flagged).
  // Nothing to do, and nothing done, when neither is poisoned.
  void AddKeys(const PairRule& rule, const char* kv_flags);
  // Whether some row depends on a poisoned input.
  bool any() const { return !lse_p_.empty(); }
  // Writes NaN over the dependent rows of out (f32 contiguous [B, Sq, H, Dv])
  // and lse (f32 contiguous [B, H, Sq]); nothing when !any().
  void Fill(float* out, float* lse) const;
  // Rows [B, H, Sq] whose lse / out are poisoned (empty when !any()).
  const std::vector<char>& lse_rows() const { return lse_p_; }
  const std::vector<char>& out_rows() const { return out_p_; }

 private:
  AttentionDims d_;
  std::vector<char> q_bad_;  // [B, Sq, H]
  bool any_q_ = false;
  Tensor q_own_;
  TensorView q_;
  std::vector<char> lse_p_, out_p_;
};

// Steps 1-3 of a backward over this call's (or this rank's) query rows:
//   BackwardPoison bp(d, q, out, lse, dout, pool[, &fwd]);  // scans
//   bp.Sanitize(lse32, delta);       // before the kernels read them
//   for each key/value set: kernels into dk/dv of the set, then
//     bp.FillKeys(rule, dk, dv);
//   bp.FillQueries(dq); bp.FillDSinks(ds);
// Which query rows are poisoned follows from the out, lse and dout given
// (NaN rows of a forward that met poison) and, with `forward` (the
// single-device backward, which can see every key), from recomputing the
// forward's dependencies; the ring relies on the lse and out its forward
// wrote, and carries dk/dv poison home in its travelling accumulators.
class BackwardPoison {
 public:
  // q [B, Sq, H, D], out [B, Sq, H, Dv], dout like out, lse [B, H, Sq], any
  // strides. `forward`, if given, was built on the same q.
  BackwardPoison(const AttentionDims& d, const TensorView& q, const TensorView& out,
                 const TensorView& lse, const TensorView& dout, ThreadPool* pool,
                 const ForwardPoison* forward = nullptr);
  bool any() const { return any_; }
  // The views the kernels read: cleaned copies of q / dout when they held a
  // non-finite row, else the given views.
  const TensorView& q() const { return q_; }
  const TensorView& dout() const { return dout_; }
  // lse32 (f32 contiguous [B, H, Sq], the kernels' copy) gets -inf, the "no
  // key" marker, on poisoned lse rows: P = 0, so they contribute nothing;
  // delta [B, H, Sq] gets 0 where not finite (a row whose dependants are all
  // overwritten). Nothing when !any().
  void Sanitize(float* lse32, float* delta) const;
  // After the kernels wrote dk / dv (f32 contiguous [B, Skv, Hkv, D] and
  // [..., Dv]) for one key/value set: NaN over the rows some poisoned query
  // row allowed by `rule` depends on. Nothing when !any().
  void FillKeys(const PairRule& rule, float* dk, float* dv) const;
  // dq (f32 contiguous [B, Sq, H, D]) and ds ([H]): NaN over the rows / heads
  // that depend on a poisoned row. Nothing when !any().
  void FillQueries(float* dq) const;
  void FillDSinks(float* ds) const;

 private:
  AttentionDims d_;
  bool any_ = false;
  Tensor q_own_, dout_own_;
  TensorView q_, dout_;
  // Rows [B, H, Sq]: lse poisoned; PR (dq, dk, dsinks); dv sources.
  std::vector<char> lse_p_, pr_, dv_src_;
};

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_POISON_H_

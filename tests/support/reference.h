// The f64 dense reference: SPEC §2 implemented literally, forward and
// backward, O(Sq * Skv) per (b, h). Every numeric test compares against it
// (it is itself checked by finite differences in reference_test.cc).
#ifndef RINGSPLASH_TESTS_SUPPORT_REFERENCE_H_
#define RINGSPLASH_TESTS_SUPPORT_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "ringsplash/mask.h"

namespace ringsplash::testing {

// All tensors f64 (or i32 segments), C order, model layout.
struct RefProblem {
  int64_t b = 1, sq = 0, skv = 0, h = 1, hkv = 1, d = 0, dv = 0;
  std::vector<double> q;        // [B, Sq, H, D]
  std::vector<double> k;        // [B, Skv, Hkv, D]
  std::vector<double> v;        // [B, Skv, Hkv, Dv]
  std::vector<double> sinks;    // [H] or empty
  std::vector<int32_t> q_seg;   // [B, Sq] or empty
  std::vector<int32_t> kv_seg;  // [B, Skv] or empty
  std::vector<int64_t> q_pos;   // [Sq] global positions, empty: 0..Sq-1
  std::vector<int64_t> kv_pos;  // [Skv], empty: 0..Skv-1
  Mask mask;
  double scale = 0;    // 0: 1/sqrt(D)
  double softcap = 0;  // 0: none
};

struct RefForward {
  std::vector<double> out;  // [B, Sq, H, Dv]
  std::vector<double> lse;  // [B, H, Sq]; -inf for rows with nothing allowed and no sink
};

struct RefBackward {
  std::vector<double> dq;      // [B, Sq, H, D]
  std::vector<double> dk;      // [B, Skv, Hkv, D]
  std::vector<double> dv;      // [B, Skv, Hkv, Dv]
  std::vector<double> dsinks;  // [H] (empty without sinks)
  // [H] sum over rows of |exp(sink - lse_i) D_i|: dsinks is a sum of B * Sq
  // signed terms that may cancel, so its rounding scales with this, not with
  // |dsinks|.
  std::vector<double> dsinks_terms;
  // Same shapes as dq and dk: the sums of the magnitudes of their terms,
  // |scale * p_ij * (dout_i . v_j - D_i) * k_j| with both dot products taken
  // over |.|. A row whose keys' dS cancel (one allowed key: p = 1 and
  // dout . v - D = 0 exactly) has dq ~ 0 while its f32 rounding is ~u times
  // these sums, so dq and dk errors are measured against them too.
  std::vector<double> dq_terms;
  std::vector<double> dk_terms;
  // Same shape as dv: sum_i p_ij |dout_i|, the magnitudes of dv's terms.
  // Products rounded to bf16 (the bf16 backward rounds P to bf16 for dV)
  // err by up to u times this, however much the signed terms cancel.
  std::vector<double> dv_terms;
  // Same shapes as dq and dk: sum_j |scale ds_ij k_j| and sum_i |scale ds_ij
  // q_i| with the exact ds (dq_terms, dk_terms bound ds's own rounding and
  // are larger). Rounding dS to bf16 (the bf16 backward's dQ and dK) errs by
  // up to u times these.
  std::vector<double> dq_ds_terms;
  std::vector<double> dk_ds_terms;
};

RefForward ReferenceForward(const RefProblem& p);
// dout: [B, Sq, H, Dv].
RefBackward ReferenceBackward(const RefProblem& p, const std::vector<double>& dout);

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_REFERENCE_H_

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

namespace ringsplash::kernels {

class ThreadPool;

// Bits of a key/value row flag ([B, Skv, Hkv]).
constexpr char kKeyBad = 1;
constexpr char kValueBad = 2;

// Whether element `offset` of a float view (f32, bf16, f16) is NaN or +-inf.
bool NonFiniteAt(const TensorView& t, int64_t offset);

// Rows of a 4-D float view [B, S, Heads, X]: flags[(b * S + s) * Heads + head]
// |= `bit` when that row holds a non-finite element. `flags` is resized (to
// zeros) when empty. Returns whether any row was flagged. With a pool, large
// views are scanned by all its workers (the scan is memory-bound: one pass
// over every input byte of every call).
bool ScanRows(const TensorView& t, char bit, std::vector<char>& flags, ThreadPool* pool = nullptr);

// Whether rows [s0, s0 + rows) of head `head` of batch b of a 4-D float view
// [B, S, Heads, X] hold a NaN or an infinity.
bool AnyNonFinite(const TensorView& t, int64_t b, int64_t s0, int64_t rows, int64_t head);

// Non-finite rows of the inputs of one call (or one rank's part of it).
struct InputScan {
  std::vector<char> q;   // [B, Sq, H]
  std::vector<char> kv;  // [B, Skv, Hkv]: kKeyBad | kValueBad
  bool any_q = false, any_kv = false;
  bool any() const { return any_q || any_kv; }
};

// Scans q, k, v (4-D float views; k and v may be undefined: not scanned).
InputScan ScanInputs(const TensorView& q, const TensorView& k, const TensorView& v,
                     ThreadPool* pool = nullptr);

// A contiguous copy of the 4-D float view `t`, same dtype, with every
// non-finite element replaced by 0.
Tensor CleanCopy(const TensorView& t);

// Replaces every non-finite element of the contiguous float view `t` by 0.
void CleanInPlace(const TensorView& t);

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

// Forward dependencies on one set of key/value rows (the whole key sequence,
// or one ring slice of it; `d.skv` is its length): a row [B, H, Sq] gets
// lse_p when it allows a row flagged kKeyBad, or when q_bad ([B, Sq, H], may
// be null) flags it and it allows any row; out_p when it allows a row
// flagged kValueBad. `kv_flags` is [B, Skv, Hkv] (may be null: no bad rows).
void MarkForward(const PairRule& rule, const AttentionDims& d, const char* kv_flags,
                 const char* q_bad, char* lse_p, char* out_p);

// Backward dependencies on one set of key/value rows: dk_p[b,j,g] when a
// row of `pr` ([B, H, Sq]) allows j, dv_p[b,j,g] when a row of `dv_src`
// allows j. Outputs [B, Skv, Hkv].
void MarkBackward(const PairRule& rule, const AttentionDims& d, const char* pr, const char* dv_src,
                  char* dk_p, char* dv_p);

// Backward: lse rows [B, H, Sq] (a [B, H, Sq] view) that are NaN or +inf
// get flags[r] = 1 (-inf is an empty row, not poison). Returns whether any did.
bool ScanLse(const AttentionDims& d, const TensorView& lse, char* flags);

// Backward poison sets of rows [B, H, Sq] (the table in docs/RELIABILITY.md):
//   pr[r]     = lse_p | out_p | out_bad | dout_bad   (dq, dk, dsinks)
//   dv_src[r] = lse_p | dout_bad                     (dv)
// lse_p and out_p are [B, H, Sq] (out_p may be null); out_bad and dout_bad
// are ScanRows flags [B, Sq, H] (may be empty: none bad).
void BackwardSets(const AttentionDims& d, const char* lse_p, const char* out_p,
                  const std::vector<char>& out_bad, const std::vector<char>& dout_bad, char* pr,
                  char* dv_src);

// ds[h] = NaN for every head h with a row flagged in `pr` ([B, H, Sq]).
void PoisonDSinks(const AttentionDims& d, const char* pr, float* ds);

// Writes NaN over the rows flagged in `rows_bhs` ([B, H, Sq]) of an f32
// contiguous [B, Sq, H, X] buffer (out, dq).
void FillQueryRows(float* buf, const AttentionDims& d, int64_t x, const char* rows_bhs);

// Writes NaN over the rows flagged in `flags` ([B, S, Heads]) of an f32
// contiguous [B, S, Heads, X] buffer (dk, dv).
void FillRows(float* buf, int64_t rows, int64_t x, const char* flags);

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_POISON_H_

// Helpers shared by the numeric tests: random tensors, conversions between
// the library's tensor views and the f64 reference's vectors, relative-error
// comparison and bf16/f16 rounding.
#ifndef RINGSPLASH_TESTS_SUPPORT_TEST_UTIL_H_
#define RINGSPLASH_TESTS_SUPPORT_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"
#include "tests/support/reference.h"

namespace ringsplash::testing {

using Rng = std::mt19937_64;

// Uniform in [lo, hi], then rounded to `dtype` (so the tensor holds exactly
// the values it reports).
Tensor RandomTensor(Rng& rng, DType dtype, std::vector<int64_t> shape, double lo = -1.0,
                    double hi = 1.0);
// Fills an existing view (any strides) the same way.
void FillRandom(Rng& rng, const TensorView& t, double lo = -1.0, double hi = 1.0);
// n floats uniform in [lo, hi] (micro-kernel operands).
std::vector<float> RandomFloats(Rng& rng, size_t n, float lo = -1.0f, float hi = 1.0f);
// x rounded up to a multiple of 16 (a 16-lane vector's).
inline int64_t RoundUpTo16(int64_t x) { return (x + 15) / 16 * 16; }

// Packed-document segment ids [B, S] i32: non-decreasing runs of random
// lengths with ids starting at `first_id` (so q and kv can use different id
// sets to create rows without any key).
Tensor RandomSegments(Rng& rng, int64_t b, int64_t s, int64_t max_docs, int32_t first_id = 0);

// The elements of a float/i32 view as doubles in C order of its logical shape
// (whatever its strides).
std::vector<double> ToDoubles(const TensorView& t);
// Writes `values` (C order of the view's logical shape) into `t`, rounding to
// its dtype.
void FromDoubles(const std::vector<double>& values, const TensorView& t);
// A new C-order tensor holding `values` rounded to `dtype`.
Tensor TensorFromDoubles(const std::vector<double>& values, DType dtype,
                         std::vector<int64_t> shape);

// The f64 reference problem equal to an API call: q/k/v/sinks as stored in
// the views (so bf16 inputs are already rounded), segments, positions, mask,
// scale and soft cap.
RefProblem MakeRefProblem(const AttentionInputs& in, const AttentionOptions& opt);

// Owning storage for an AttentionInputs.
struct OwnedInputs {
  Tensor q, k, v, sinks, q_seg, kv_seg;
  // Set when q/k/v are stored [B, H, S, D] and viewed as [B, S, H, D].
  bool bhsd = false;
  std::vector<int64_t> q_pos, kv_pos;
  AttentionInputs inputs() const;
};

// Sizes and contents of a random problem.
struct ProblemSpec {
  ProblemSpec() = default;
  ProblemSpec(int64_t b_, int64_t sq_, int64_t skv_, int64_t h_, int64_t hkv_, int64_t d_,
              int64_t dv_)
      : b(b_), sq(sq_), skv(skv_), h(h_), hkv(hkv_), d(d_), dv(dv_) {}
  int64_t b = 1, sq = 16, skv = 16, h = 2, hkv = 2, d = 16, dv = 16;
  DType dtype = DType::kF32;
  bool sinks = false;
  bool segments = false;
  bool bhsd = false;      // store q/k/v as [B, H, S, D] (strided views)
  double qk_range = 1.0;  // q, k uniform in [-qk_range, qk_range]
};
OwnedInputs RandomInputs(Rng& rng, const ProblemSpec& spec);

// Error of `actual` against `expected`, both in C order of one shape.
struct Comparison {
  double max_abs_err = 0;           // max |a - e| over finite expected entries
  double expected_max = 0;          // max |e| over finite expected entries
  int64_t worst = -1;               // index of the max error (-1 if none)
  bool nonfinite_mismatch = false;  // NaN anywhere, or an inf where the other is not the same inf
  // max_abs_err / max(expected_max, floor): error relative to the largest
  // magnitude (the scale float rounding errors are proportional to).
  double Relative(double floor = 1e-30) const;
  std::string Describe() const;
};
Comparison Compare(const std::vector<double>& actual, const std::vector<double>& expected);

double MaxAbs(const std::vector<double>& v);

// ---- Running the public API and the reference on one problem ----

// A copy of `in` with q/k/v converted to `dtype` (same layout); sinks,
// segments and positions copied unchanged.
OwnedInputs ConvertInputs(const OwnedInputs& in, DType dtype);

// How RunAttention allocates the caller's outputs.
struct ApiRun {
  DType out_dtype = DType::kF32;   // out (and dout is whatever the caller made)
  DType grad_dtype = DType::kF32;  // dq, dk, dv
  // Store out/dq/dk/dv as [B, H, S, D] and pass [B, S, H, D] strided views.
  bool strided_outputs = false;
};

// Everything an API call produced, as doubles in C order of the logical
// shapes (out [B,Sq,H,Dv], lse [B,H,Sq], dq/dk/dv shapes of q/k/v, dsinks [H]).
struct ApiResult {
  std::vector<double> out, lse, dq, dk, dv, dsinks;
  KernelStats fwd, bwd;
};

// AttentionForward, then (if dout is given) AttentionBackward with the
// forward's own out and lse.
ApiResult RunAttention(const OwnedInputs& in, const AttentionOptions& opt, const Tensor* dout,
                       const ApiRun& run = {});

struct RefResult {
  RefForward fwd;
  RefBackward bwd;  // empty without dout
};
// The f64 reference on exactly the values the API saw (inputs as stored,
// dout as stored).
RefResult RunReference(const OwnedInputs& in, const AttentionOptions& opt, const Tensor* dout);

// Per-tensor errors relative to max(largest expected magnitude,
// kMagnitudeFloor) (lse: to max(1, max |lse|)); +inf for a NaN or a
// mismatched infinity. The floor matters when a tensor is exactly zero or
// nearly so (e.g. dq of rows with a single allowed key, where p = 1 and
// dp - D cancels): the API's rounding noise there is ~u times the size of
// the cancelling terms, which are O(0.1..10) for the O(1) test inputs, so
// it is measured against that scale rather than against 0. dq, dk and dv
// are measured against the largest sum of their terms' magnitudes
// (RefBackward::dq_terms, dk_terms, dv_terms) when that is larger, since
// their rounding is ~u times it however much the terms cancel; a wrong mask
// element or GQA head moves them by one whole term, >= 1/Skv of the sum, far
// above 1e-5 for the test shapes. dsinks, a sum of
// B * Sq signed terms, is measured against the sum of their magnitudes
// (RefBackward::dsinks_terms) when that is larger: its f32 rounding is
// ~sqrt(B * Sq) u times that sum however much the terms cancel, while a lost
// or wrong term is ~1 / (B * Sq) of it (>= 1e-3 for the test shapes).
struct Errors {
  double out = 0, lse = 0, dq = 0, dk = 0, dv = 0, dsinks = 0;
  std::string Describe() const;
};
constexpr double kMagnitudeFloor = 1e-2;
Errors ErrorsOf(const ApiResult& api, const RefResult& ref);

// True iff any value is NaN.
bool HasNaN(const std::vector<double>& v);

// Rounds through the given storage dtype (f32, bf16 or f16).
double RoundTo(DType dtype, double x);
double RoundToBF16(double x);

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_TEST_UTIL_H_

// The flash kernels' test harness (FlashForward / FlashBackward called
// directly on seeded random problems), shared by flash_kernel_test.cc and
// flash_schedule_test.cc: a Problem, its run configuration, and checks
// against the f64 reference with the tolerances the kernels are held to.
#ifndef RINGSPLASH_TESTS_SUPPORT_FLASH_PROBLEM_H_
#define RINGSPLASH_TESTS_SUPPORT_FLASH_PROBLEM_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/thread_pool.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {

// f32 tolerance, relative to the largest expected magnitude of a tensor. The
// kernels accumulate in f32 over at most a few hundred terms (D <= 256, Skv
// <= ~300 here); the f64 reference is exact to ~1e-16. Rounding of inputs of
// O(1) gives errors ~ sqrt(terms) * 2^-24 ~ 1e-6 of the largest magnitude, and
// the vectorised exp/tanh add ~1e-7 relative. 1e-5 leaves a 10x margin while
// still catching any real bug (a wrong mask entry or a dropped tile moves
// results by > 1e-2).
constexpr double kF32Tol = 1e-5;

std::vector<double> ToDoubleVec(const std::vector<float>& v);
std::vector<int64_t> Iota(int64_t n);  // 0, 1, ..., n - 1

struct RunConfig {
  Mask mask;
  float softcap = 0.0f;
  BlockSizes blocks{32, 32};
  KernelPath path = KernelPath::kPortable;
  int threads = 2;
  // The backward's GradientSums: false writes the gradients into buffers
  // filled with NaN (an element the kernel leaves unwritten shows); true
  // adds them to buffers holding 0.5, subtracted again afterwards.
  bool add_gradients = false;
};

// Kernel outputs of one forward (+ backward) run.
struct Result {
  std::vector<float> out, lse;  // [B, Sq, H, Dv], [B, H, Sq]
  std::vector<float> dq, dk, dv;
  KernelStats fwd_stats, bwd_stats;
};

// Whether two runs wrote bitwise identical outputs (and gradients, where
// they ran the backward); names the first array that differs.
::testing::AssertionResult BitwiseEqual(const Result& a, const Result& b);

class Problem {
 public:
  Problem(uint64_t seed, const ProblemSpec& spec) : rng_(seed), spec_(spec) {
    owned_ = RandomInputs(rng_, spec);
    in_ = owned_.inputs();
    q_pos_ = in_.q_positions.empty() ? Iota(spec.sq) : in_.q_positions;
    kv_pos_ = in_.kv_positions.empty() ? Iota(spec.skv) : in_.kv_positions;
    scale_ = 1.0f / std::sqrt(static_cast<float>(spec.d));
    // dout in the inputs' dtype: with bf16 q, k, v and dout the avx512_bf16
    // and amx paths run all five of the backward's products on bf16 operands
    // (flash/backward.cc).
    dout_ = RandomTensor(rng_, spec.dtype, {spec.b, spec.sq, spec.h, spec.dv});
  }

  OwnedInputs& owned() { return owned_; }
  const ProblemSpec& spec() const { return spec_; }
  // Call after changing owned() (e.g. segments, positions).
  void Refresh() {
    in_ = owned_.inputs();
    if (!owned_.q_pos.empty()) q_pos_ = owned_.q_pos;
    if (!owned_.kv_pos.empty()) kv_pos_ = owned_.kv_pos;
    in_.q_positions = q_pos_;
    in_.kv_positions = kv_pos_;
  }

  RefProblem Ref(const RunConfig& s) const {
    AttentionOptions opt;
    opt.mask = s.mask;
    opt.scale = scale_;
    if (s.softcap > 0) opt.softcap = s.softcap;
    AttentionInputs in = in_;
    in.sinks = TensorView();
    in.q_positions = q_pos_;
    in.kv_positions = kv_pos_;
    return MakeRefProblem(in, opt);
  }
  std::vector<double> Dout() const { return ToDoubles(dout_.view()); }

  kernels::FlashParams Params(const RunConfig& s) const {
    kernels::FlashParams p;
    p.q = in_.q;
    p.k = in_.k;
    p.v = in_.v;
    p.q_segments = in_.q_segments;
    p.kv_segments = in_.kv_segments;
    p.q_pos = q_pos_.data();
    p.kv_pos = kv_pos_.data();
    p.mask = &s.mask;
    p.scale = scale_;
    p.softcap = s.softcap;
    p.blocks = s.blocks;
    p.path = s.path;
    return p;
  }

  // Forward; with `backward` also the backward, fed the reference's f32-rounded
  // lse and delta so its check isolates the backward kernel.
  Result Run(const RunConfig& s, bool backward, const RefForward* ref = nullptr) const;

 private:
  Rng rng_;
  ProblemSpec spec_;
  OwnedInputs owned_;
  AttentionInputs in_;
  std::vector<int64_t> q_pos_, kv_pos_;
  float scale_ = 1.0f;
  Tensor dout_;
};

// Paths whose bf16 forward rounds P to bf16 for P V (avx512_bf16, amx).
bool RoundsP(KernelPath path);

// actual against expected, relative to expected's largest magnitude.
void ExpectClose(const std::vector<float>& actual, const std::vector<double>& expected, double tol,
                 const std::string& what);

// Element by element: |actual_e - expected_e| <= u * terms_e + allowance,
// where allowance = 2 * tol * max|expected| (twice the f32 check's bound: a
// different summation order) and u = 2^-8 (bf16's unit roundoff).
void ExpectWithinTerms(const std::vector<float>& actual, const std::vector<double>& expected,
                       const std::vector<double>& terms, double tol, const std::string& what);

// dq, dk and dv of run r against the reference g within `tol` (f32 math on
// the rounded inputs), relative to each tensor's largest magnitude. Where the
// path rounds P and dS to bf16 for its gradient products (the avx512_bf16
// and amx backward with bf16 q, k, v and dout: dtype is also dout's), each element errs by up
// to 2^-8 times the sum of the magnitudes of the terms the rounding touches
// (RefBackward::dq_ds_terms, dk_ds_terms, dv_terms; only one operand of each
// product is rounded, the other is an exact bf16 input), plus the f32 error.
void ExpectGradients(const Result& r, const RefBackward& g, KernelPath path, DType dtype,
                     double tol, const std::string& what, double dv_tol = -1.0);

struct Shape {
  int64_t b, sq, skv, h, hkv, d, dv;
};

ProblemSpec SpecOf(const Shape& sh, DType dtype = DType::kF32, bool segments = false);

// Forward (and backward) of a random problem of shape sh against the
// reference: out and lse within kF32Tol (plus P's bf16 rounding where the
// path rounds it), gradients as ExpectGradients. Query i sits at global
// position q_offset + i (keys at 0, 1, ...).
void CheckAgainstReference(const Shape& sh, DType dtype, const RunConfig& s, bool segments,
                           uint64_t seed, bool backward = true, int64_t q_offset = 0);

// Rows [lo, lo + n) of a [B, S, H, C] view.
TensorView SliceRows(const TensorView& t, int64_t lo, int64_t n);

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_FLASH_PROBLEM_H_

// Where non-finite inputs may show up in attention outputs (issue #6.4).
//
// THE RULE (docs/RELIABILITY.md, "NaN and Inf"): a NaN or infinity in an
// input reaches exactly the outputs that mathematically depend on it, with
// masked pairs contributing nothing at all (not 0 * NaN). Rows are poisoned
// whole (every element of the row is non-finite) by:
//   lse[b,h,i]   q[b,i,h] non-finite and row i has an allowed key; or an
//                allowed key row k[b,j,g] non-finite
// (Sinks are parameters, not data: a NaN or +inf sink is refused with an
// Error naming sinks[h], and -inf is a valid "no sink for this head".)
//   out[b,i,h]   lse poisoned, or an allowed value row v[b,j,g] non-finite
//   dq[b,i,h]    out poisoned, or dout[b,i,h] non-finite        (call it PR)
//   dk[b,j,g]    some row (b,h,i) of group g that allows j is PR
//   dv[b,j,g]    some row of group g that allows j has lse poisoned or a
//                non-finite dout row
//   dsinks[h]    some row of head h is PR
// (g = h / (H / Hkv); "allowed" = mask and segment ids.) Everything else is
// finite and equal to attention over the same inputs with the non-finite
// rows replaced by anything finite. A row with no allowed key and no sink is
// empty whatever its q holds: out 0, lse -inf, zero gradients.
//
// PoisonMap computes those sets for a problem; the tests check both ways:
// poisoned entries are non-finite (never silently replaced by a finite
// value) and clean entries are finite and match the f64 reference run on a
// cleaned copy of the inputs.
#ifndef RINGSPLASH_TESTS_RELIABILITY_POISON_H_
#define RINGSPLASH_TESTS_RELIABILITY_POISON_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {

struct PoisonMap {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0;
  // Per row: [B, H, Sq] for lse/out/dq; [B, Skv, Hkv] for dk/dv; [H] dsinks.
  std::vector<char> lse, out, dq, dk, dv, dsinks;

  // `in` holds the poisoned inputs, `dout` the upstream gradient (may be
  // null: forward only). Positions and mask as the call will use them.
  static PoisonMap Of(const AttentionInputs& in, const AttentionOptions& opt, const Tensor* dout);
  int64_t count_out() const;
};

// A copy of `in` with every non-finite element of q, k and v set to 0 (the
// "anything finite" of the rule; sinks are copied as they are).
OwnedInputs CleanCopy(const OwnedInputs& in);
Tensor CleanCopy(const Tensor& t);

// Checks `actual` (C order of the logical shape [outer..., rows, inner]) row
// by row: for kPropagation, rows flagged in `poisoned` must be entirely
// non-finite; for kConfinement, the other rows must be finite and within
// `tol` * max|expected| of `expected`. `row_of(index)` maps
// an element index to its row flag index. Returns "" or a description of the
// first violations.
// Which direction of the rule CheckPoisonPattern checks.
enum class PoisonCheck {
  kConfinement,  // clean rows are finite and correct
  kPropagation,  // poisoned rows are non-finite
};

template <typename RowOf>
std::string CheckPoisonPattern(const std::vector<double>& actual,
                               const std::vector<double>& expected,
                               const std::vector<char>& poisoned, RowOf row_of, double tol,
                               const char* name, PoisonCheck check) {
  double scale = 0;
  for (double e : expected) {
    if (std::isfinite(e)) scale = std::max(scale, std::fabs(e));
  }
  scale = std::max(scale, 1e-30);
  std::string errors;
  int reported = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const bool bad_row = poisoned[static_cast<size_t>(row_of(static_cast<int64_t>(i)))] != 0;
    const double a = actual[i], e = expected[i];
    std::string why;
    if (bad_row) {
      if (check == PoisonCheck::kPropagation && std::isfinite(a)) {
        why = "finite " + std::to_string(a) + " in a poisoned row";
      }
    } else if (check == PoisonCheck::kPropagation) {
    } else if (std::isinf(e)) {
      if (a != e) why = std::to_string(a) + " where " + std::to_string(e) + " was expected";
    } else if (!std::isfinite(a)) {
      why = "non-finite in a clean row";
    } else if (std::fabs(a - e) > tol * scale) {
      why = "error " + std::to_string(std::fabs(a - e) / scale) + " relative (expected " +
            std::to_string(e) + ", got " + std::to_string(a) + ")";
    }
    if (!why.empty() && reported++ < 4) {
      errors += std::string(name) + "[" + std::to_string(i) + "]: " + why + "; ";
    }
  }
  if (reported > 4) errors += "... " + std::to_string(reported) + " violations in " + name + "; ";
  return errors;
}

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_RELIABILITY_POISON_H_

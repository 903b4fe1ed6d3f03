// Decodes fuzzer bytes into one call of AttentionForward (and, optionally,
// AttentionBackward): shapes, dtypes, strides, masks, positions, options and
// output views — mostly valid, sometimes with deliberately broken arguments —
// together with the verdict the public contract implies for it.
//
// Values come from a PRNG seeded by the input (the bytes choose structure,
// not every float), so short inputs reach every branch.
#ifndef RINGSPLASH_FUZZ_ATTENTION_PROBLEM_H_
#define RINGSPLASH_FUZZ_ATTENTION_PROBLEM_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"

namespace ringsplash::fuzz {

// A tensor argument: its own storage and the view handed to the API (which
// may be strided, transposed, broadcast or walk memory backwards).
struct Arg {
  Tensor storage;
  TensorView view;
};

// What the contract says about a decoded call.
struct Verdict {
  // Some argument is certainly invalid: the call must throw Error.
  bool invalid = false;
  // Some argument is one the contract does not pin down (e.g. negative
  // strides, an empty dimension): throwing is allowed, and so is a result —
  // but then it must be correct.
  bool uncertain = false;
  // What was broken, and the argument names an Error message may start with.
  std::vector<std::string> reasons;
  std::vector<std::string> names;
  void Invalid(const std::string& why, std::vector<std::string> arg_names) {
    invalid = true;
    reasons.push_back(why);
    names.insert(names.end(), arg_names.begin(), arg_names.end());
  }
  void Uncertain(const std::string& why) {
    uncertain = true;
    reasons.push_back(why + " (either outcome allowed)");
  }
  std::string Describe() const;
};

struct FuzzProblem {
  AttentionInputs in;
  AttentionOptions opt;
  Arg q, k, v, sinks, q_seg, kv_seg;
  Arg out, lse;
  Verdict forward;  // verdict of AttentionForward

  bool backward = false;
  Arg dout, dq, dk, dv, dsinks;
  Verdict backward_verdict;  // extra problems of the backward's own arguments

  // Largest |logit| the inputs can produce (for tolerances).
  double max_logit = 0;
  std::string Describe() const;
};

// Decodes one problem. Never throws (mask constructors that reject their
// arguments are not generated).
FuzzProblem DecodeProblem(ByteReader& r);

}  // namespace ringsplash::fuzz

#endif  // RINGSPLASH_FUZZ_ATTENTION_PROBLEM_H_

// Fuzz target: the attention entry points' argument validation and results.
//
// DecodeProblem (attention_problem.h) builds a call with random shapes,
// dtypes, strides, masks, positions and options, some arguments broken on
// purpose, and the verdict the contract implies. Properties:
//   - only ringsplash::Error is ever thrown (no other exception, no crash,
//     no sanitizer report);
//   - a call with an invalid argument throws, and when exactly one argument
//     was broken the message starts with that argument's name;
//   - a valid call does not throw;
//   - an accepted call matches the f64 reference (tests/support/reference.h):
//     every element written, no NaN, out/lse within the tolerance below, and
//     for all-f32 calls the gradients too.
//
// The numeric comparison and its tolerances: attention_check.h.
#include <string>
#include <vector>

#include "fuzz/attention_check.h"
#include "fuzz/attention_problem.h"
#include "fuzz/fuzz_targets.h"
#include "fuzz/fuzz_util.h"
#include "ringsplash/attention.h"

namespace ringsplash::fuzz {
namespace {

bool StartsWithAny(const std::string& text, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (text.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

// The outcome must match the verdict; returns whether the call was accepted.
bool CheckOutcome(bool threw, const std::string& msg, const Verdict& v, const char* what,
                  const FuzzProblem& p) {
  if (threw) {
    FuzzCheck(v.invalid || v.uncertain, what, " rejected a valid call: \"", msg, "\"; ",
              p.Describe());
    FuzzCheck(!msg.empty(), what, " threw an Error without a message");
    if (v.invalid && !v.uncertain && v.reasons.size() == 1) {
      FuzzCheck(StartsWithAny(msg, v.names), what, " error \"", msg,
                "\" does not start with the broken argument's name (", v.reasons[0], ")");
    }
    return false;
  }
  FuzzCheck(!v.invalid, what, " accepted an invalid call; ", p.Describe());
  return true;
}

}  // namespace

int AttentionOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  ByteReader reader(data, size);
  FuzzProblem p = DecodeProblem(reader);

  std::string msg;
  const bool fwd_threw =
      Throws([&] { AttentionForward(p.in, p.opt, p.out.view, p.lse.view); }, &msg);
  if (!CheckOutcome(fwd_threw, msg, p.forward, "AttentionForward", p)) return 0;

  const ReferenceCheck check(p);
  check.Forward("AttentionForward");

  if (!p.backward) return 0;
  const bool bwd_threw = Throws(
      [&] {
        AttentionBackward(p.in, p.opt, p.out.view, p.lse.view, p.dout.view, p.dq.view, p.dk.view,
                          p.dv.view, p.dsinks.view);
      },
      &msg);
  if (!CheckOutcome(bwd_threw, msg, p.backward_verdict, "AttentionBackward", p)) return 0;

  check.Backward("AttentionBackward");
  return 0;
}

}  // namespace ringsplash::fuzz

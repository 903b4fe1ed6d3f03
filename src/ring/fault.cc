// Fault injection for tests of failure handling (RINGSPLASH_FAULT=R:S[:fwd|:bwd]):
// the named rank fails at the named ring step, after telling its peers.
#include <cstdlib>
#include <optional>
#include <string>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/ring/ring_internal.h"

namespace ringsplash {

namespace {

// A non-negative decimal integer, all of `text`.
bool ParseIndex(const std::string& text, int* value) {
  if (text.empty() || text.size() > 9) return false;
  int v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *value = v;
  return true;
}

}  // namespace

FaultSpec FaultSpec::Parse(const std::string& text) {
  FaultSpec spec;
  const size_t a = text.find(':');
  const size_t b = a == std::string::npos ? a : text.find(':', a + 1);
  const std::string rank = text.substr(0, a);
  const std::string step =
      a == std::string::npos ? "" : text.substr(a + 1, b == std::string::npos ? b : b - a - 1);
  const std::string pass = b == std::string::npos ? "" : text.substr(b + 1);
  const bool ok = ParseIndex(rank, &spec.rank) && ParseIndex(step, &spec.step) &&
                  (b == std::string::npos || pass == "bwd" || pass == "fwd");
  if (!ok) {
    Fail(
        "fault spec (RINGSPLASH_FAULT): expected RANK:STEP, RANK:STEP:fwd or RANK:STEP:bwd with "
        "non-negative integers, got '",
        text, "'");
  }
  spec.backward = pass == "bwd";
  return spec;
}

std::optional<FaultSpec> FaultSpec::FromEnv() {
  const char* v = std::getenv("RINGSPLASH_FAULT");
  if (v == nullptr || *v == '\0') return std::nullopt;
  return Parse(v);
}

void FaultSpec::CheckFits(int num_ranks, const std::string& what) const {
  if (rank < 0 || step < 0) return;
  Check(rank < num_ranks, what, ": rank ", rank, " is not in this ring of ", num_ranks,
        " ranks (expected RANK in 0..", num_ranks - 1, ")");
  Check(step < num_ranks, what, ": step ", step,
        " is past the last ring step (expected STEP in 0..", num_ranks - 1, " with ", num_ranks,
        " ranks)");
}

namespace ring_internal {

void MaybeInjectFault(Communicator& comm, const RingSetup& setup, int step, bool backward) {
  if (!setup.fault || setup.fault->rank != setup.rank || setup.fault->step != step ||
      setup.fault->backward != backward) {
    return;
  }
  const std::string message = "injected fault at rank " + std::to_string(setup.rank) + " step " +
                              std::to_string(step) + (backward ? " (backward)" : "");
  comm.Abort(message);
  throw Error(message);
}

}  // namespace ring_internal

}  // namespace ringsplash

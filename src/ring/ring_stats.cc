// RankStats accessors: totals over the forward and backward ring steps.
#include "ringsplash/ring.h"

namespace ringsplash {

namespace {

template <typename T, typename F>
T SumSteps(const RankStats& s, F f) {
  T total = 0;
  for (const RingStepStats& st : s.forward_steps) total += f(st);
  for (const RingStepStats& st : s.backward_steps) total += f(st);
  return total;
}

}  // namespace

double RankStats::compute_seconds() const {
  return SumSteps<double>(*this, [](const RingStepStats& s) { return s.compute_seconds; });
}

double RankStats::comm_wait_seconds() const {
  return SumSteps<double>(*this, [](const RingStepStats& s) { return s.comm_wait_seconds; });
}

double RankStats::flops() const {
  return SumSteps<double>(*this, [](const RingStepStats& s) { return s.kernel.flops; });
}

int64_t RankStats::computed_blocks() const {
  return SumSteps<int64_t>(*this, [](const RingStepStats& s) { return s.kernel.computed_blocks; });
}

int64_t RankStats::skipped_blocks() const {
  return SumSteps<int64_t>(*this, [](const RingStepStats& s) { return s.kernel.skipped_blocks; });
}

}  // namespace ringsplash

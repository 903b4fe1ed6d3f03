// Runs a ring the way an application does: every thread rank shards the
// global inputs itself (ShardSequence) and calls RingAttentionForward and
// RingAttentionBackward with options of its own (e.g. its own RingPlan, or
// a Mask::DenseRows of its own rows), then the shards are gathered.
#ifndef RINGSPLASH_TESTS_SUPPORT_RING_RUN_H_
#define RINGSPLASH_TESTS_SUPPORT_RING_RUN_H_

#include <functional>

#include "ringsplash/ring.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {

// Forward, then backward with the forward's own out and lse, of the global
// problem `in` (no positions; sinks and segment ids if present; f32
// outputs) on `ranks` thread ranks; rank r runs with options_of(r), whose
// layout must be `layout`. Returns the gathered out, lse, dq, dk, dv and
// dsinks (rank 0's) as doubles.
ApiResult RunRingSharded(const OwnedInputs& in, const Tensor& dout, int ranks, Layout layout,
                         const std::function<RingOptions(int rank)>& options_of);

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_RING_RUN_H_

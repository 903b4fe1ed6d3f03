// Tests of the ring's per-call setup (src/ring/ring_internal.h): it cannot be
// copied, and the kernel parameters it hands out point into the setup that
// handed them out, also after a move.
#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "src/ring/ring_internal.h"
#include "tests/support/test_util.h"

namespace ringsplash::ring_internal {
namespace {

// Copies would share nothing with the original yet be easy to pair with
// parameters handed out by it: refused at compile time.
static_assert(!std::is_copy_constructible_v<RingSetup>);
static_assert(!std::is_copy_assignable_v<RingSetup>);
// PrepareRing returns it by value.
static_assert(std::is_move_constructible_v<RingSetup>);

TEST(RingSetupTest, ParametersPointIntoTheSetupAfterAMove) {
  constexpr int kRanks = 2;
  const int64_t sq = 8, skv = 12, h = 2, d = 16;  // local rows per rank
  RunThreadRanks(kRanks, CommOptions{}, [&](Communicator& comm) {
    testing::Rng rng(static_cast<uint64_t>(50 + comm.rank()));
    const Tensor q = testing::RandomTensor(rng, DType::kF32, {1, sq, h, d});
    const Tensor k = testing::RandomTensor(rng, DType::kF32, {1, skv, h, d});
    const Tensor v = testing::RandomTensor(rng, DType::kF32, {1, skv, h, d});
    AttentionInputs local;
    local.q = q.view();
    local.k = k.view();
    local.v = v.view();
    RingOptions options;
    options.layout = Layout::kZigzag;
    options.attention.mask = Mask::Causal();

    RingSetup first = PrepareRing(comm, local, options, /*backward=*/false);
    const std::vector<int64_t> q_pos = first.q_pos;
    const std::vector<std::vector<int64_t>> kv_pos = first.kv_pos;
    ASSERT_EQ(q_pos.size(), static_cast<size_t>(sq));
    ASSERT_EQ(kv_pos.size(), static_cast<size_t>(kRanks));
    // The stored parameters hold no pointer into the setup.
    EXPECT_EQ(first.params.q_pos, nullptr);
    EXPECT_EQ(first.params.kv_pos, nullptr);

    const RingSetup s = std::move(first);
    const SliceLayout layout(s.dims, DType::kF32, /*segments=*/false);
    Tensor slice = ByteBuffer(layout.bytes);
    for (int source = 0; source < kRanks; ++source) {
      SCOPED_TRACE(source);
      const kernels::FlashParams p = s.StepParams(layout, slice.data(), source);
      EXPECT_EQ(p.q_pos, s.q_pos.data());
      EXPECT_EQ(p.kv_pos, s.kv_pos[static_cast<size_t>(source)].data());
      EXPECT_EQ(std::vector<int64_t>(p.q_pos, p.q_pos + sq), q_pos);
      EXPECT_EQ(std::vector<int64_t>(p.kv_pos, p.kv_pos + skv),
                kv_pos[static_cast<size_t>(source)]);
    }
  });
}

}  // namespace
}  // namespace ringsplash::ring_internal

// Sequence layouts: positions partition 0..S-1 exactly across ranks (each in
// increasing order, with the pattern SPEC §4 describes), shard/gather round
// trips over strided views, and clear errors.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"

namespace ringsplash {
namespace {

constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(LayoutTest, NamesRoundTripAndUnknownNamesListTheValidOnes) {
  for (Layout l : kLayouts) EXPECT_EQ(ParseLayout(LayoutName(l)), l);
  const std::string msg = ErrorOf([] { ParseLayout("spiral"); });
  EXPECT_NE(msg.find("spiral"), std::string::npos) << msg;
  for (const char* name : {"contiguous", "zigzag", "striped"})
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
}

TEST(LayoutTest, PositionsPartitionTheSequence) {
  for (Layout l : kLayouts) {
    for (int n : {1, 2, 3, 4, 8}) {
      const int64_t s = 2 * n * 6;  // divides for every layout
      std::vector<int> owner(s, -1);
      for (int r = 0; r < n; ++r) {
        const std::vector<int64_t> pos = LayoutPositions(l, s, r, n);
        ASSERT_EQ(static_cast<int64_t>(pos.size()), s / n);
        for (size_t i = 0; i < pos.size(); ++i) {
          ASSERT_GE(pos[i], 0);
          ASSERT_LT(pos[i], s);
          if (i > 0) {
            EXPECT_LT(pos[i - 1], pos[i]) << "positions must increase";
          }
          EXPECT_EQ(owner[pos[i]], -1) << "position " << pos[i] << " held twice";
          owner[pos[i]] = r;
        }
      }
      for (int64_t t = 0; t < s; ++t) {
        ASSERT_NE(owner[t], -1) << LayoutName(l) << " N=" << n << ": position " << t;
        // The documented owner of each token.
        int expect = 0;
        if (l == Layout::kContiguous) expect = static_cast<int>(t / (s / n));
        if (l == Layout::kStriped) expect = static_cast<int>(t % n);
        if (l == Layout::kZigzag) {
          const int64_t chunk = t / (s / (2 * n));
          expect = static_cast<int>(chunk < n ? chunk : 2 * n - 1 - chunk);
        }
        EXPECT_EQ(owner[t], expect) << LayoutName(l) << " N=" << n << ": position " << t;
      }
    }
  }
}

TEST(LayoutTest, IndivisibleLengthsAreErrorsNamingWhatAndN) {
  std::string msg = ErrorOf([] { LayoutPositions(Layout::kContiguous, 10, 0, 4, "q length"); });
  EXPECT_NE(msg.find("q length 10"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 ranks"), std::string::npos) << msg;
  // Zigzag needs 2N: 18 divides by 6 ranks but not by 12.
  msg = ErrorOf([] { LayoutPositions(Layout::kZigzag, 18, 0, 6, "kv length"); });
  EXPECT_NE(msg.find("kv length 18"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2N = 12"), std::string::npos) << msg;
  EXPECT_NO_THROW(LayoutPositions(Layout::kStriped, 18, 5, 6));
  EXPECT_FALSE(ErrorOf([] { LayoutPositions(Layout::kStriped, 12, 6, 6); }).empty());
  EXPECT_FALSE(ErrorOf([] { LayoutPositions(Layout::kStriped, 12, 0, 0); }).empty());
}

// A value cast into Layout that names none of the three is an Error, not
// positions left at 0 (a ring run on them returned NaN).
TEST(LayoutTest, ValueOutsideTheEnumIsAnError) {
  const std::string msg = ErrorOf([] { LayoutPositions(static_cast<Layout>(9), 8, 0, 2); });
  EXPECT_NE(msg.find("9 is not a Layout"), std::string::npos) << msg;
}

// Global [B, S, H, D] f32 stored as [B, H, S, D] (a strided view) and i32
// segments [B, S]: sharding and gathering back reproduces every element, and
// each shard row holds the token its position says.
TEST(LayoutTest, ShardGatherRoundTrip) {
  const int64_t b = 2, s = 48, h = 3, d = 5;
  Tensor bhsd(DType::kF32, {b, h, s, d});
  float* g = bhsd.data_as<float>();
  for (int64_t i = 0; i < bhsd.numel(); ++i) g[i] = static_cast<float>(i) * 0.5f;
  const TensorView global = bhsd.view().Transposed(1, 2);  // [B, S, H, D]
  Tensor seg(DType::kI32, {b, s});
  for (int64_t i = 0; i < seg.numel(); ++i) seg.data_as<int32_t>()[i] = static_cast<int32_t>(i);
  for (Layout l : kLayouts) {
    for (int n : {1, 2, 3, 4, 8}) {
      Tensor back(DType::kF32, {b, s, h, d});
      Tensor seg_back(DType::kI32, {b, s});
      for (int r = 0; r < n; ++r) {
        const std::vector<int64_t> pos = LayoutPositions(l, s, r, n);
        const int64_t ls = s / n;
        Tensor local(DType::kF32, {b, ls, h, d});
        ShardSequence(l, r, n, global, local.view());
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t i = 0; i < ls; ++i)
            for (int64_t hi = 0; hi < h; ++hi)
              for (int64_t di = 0; di < d; ++di) {
                ASSERT_EQ(local.data_as<float>()[local.view().Offset(bi, i, hi, di)],
                          g[bhsd.view().Offset(bi, hi, pos[i], di)]);
              }
        GatherSequence(l, r, n, local.view(), back.view());
        Tensor local_seg(DType::kI32, {b, ls});
        ShardSequence(l, r, n, seg.view(), local_seg.view());
        for (int64_t bi = 0; bi < b; ++bi)
          for (int64_t i = 0; i < ls; ++i)
            ASSERT_EQ(local_seg.data_as<int32_t>()[bi * ls + i], bi * s + pos[i]);
        GatherSequence(l, r, n, local_seg.view(), seg_back.view());
      }
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t i = 0; i < s; ++i)
          for (int64_t hi = 0; hi < h; ++hi)
            for (int64_t di = 0; di < d; ++di)
              ASSERT_EQ(back.data_as<float>()[back.view().Offset(bi, i, hi, di)],
                        g[bhsd.view().Offset(bi, hi, i, di)]);
      for (int64_t i = 0; i < seg.numel(); ++i)
        ASSERT_EQ(seg_back.data_as<int32_t>()[i], seg.data_as<int32_t>()[i]);
    }
  }
}

// lse is [B, H, S]: gathered along dim 2.
TEST(LayoutTest, GatherAlongAnotherDim) {
  const int64_t b = 1, h = 2, s = 12;
  for (Layout l : kLayouts) {
    const int n = 3;
    Tensor global(DType::kF32, {b, h, s});
    for (int r = 0; r < n; ++r) {
      const std::vector<int64_t> pos = LayoutPositions(l, s, r, n);
      Tensor local(DType::kF32, {b, h, s / n});
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t i = 0; i < s / n; ++i)
          local.data_as<float>()[hi * (s / n) + i] = static_cast<float>(hi * 100 + pos[i]);
      GatherSequence(l, r, n, local.view(), global.view(), 2);
    }
    for (int64_t hi = 0; hi < h; ++hi)
      for (int64_t i = 0; i < s; ++i)
        EXPECT_EQ(global.data_as<float>()[hi * s + i], static_cast<float>(hi * 100 + i));
  }
}

TEST(LayoutTest, ShardErrorsNameTheProblem) {
  Tensor global(DType::kF32, {1, 12, 2, 4});
  Tensor wrong_rows(DType::kF32, {1, 5, 2, 4});
  std::string msg =
      ErrorOf([&] { ShardSequence(Layout::kStriped, 0, 3, global.view(), wrong_rows.view()); });
  EXPECT_NE(msg.find("must hold 4 rows"), std::string::npos) << msg;
  Tensor wrong_heads(DType::kF32, {1, 4, 3, 4});
  msg = ErrorOf([&] { ShardSequence(Layout::kStriped, 0, 3, global.view(), wrong_heads.view()); });
  EXPECT_NE(msg.find("differ in dim 2"), std::string::npos) << msg;
  Tensor wrong_dtype(DType::kBF16, {1, 4, 2, 4});
  msg = ErrorOf([&] { ShardSequence(Layout::kStriped, 0, 3, global.view(), wrong_dtype.view()); });
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
  Tensor zig_local(DType::kF32, {1, 3, 2, 4});
  msg = ErrorOf([&] { ShardSequence(Layout::kZigzag, 0, 4, global.view(), zig_local.view()); });
  EXPECT_NE(msg.find("2N = 8"), std::string::npos) << msg;
}

}  // namespace
}  // namespace ringsplash

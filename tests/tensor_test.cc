// Tests of src/core/tensor.cc: bf16/f16 conversion (rounding, specials,
// exhaustive round trips), views (strides, Transposed, Describe), the owning
// Tensor, element load/store and CopyConvert.
#include "ringsplash/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash {
namespace {

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DTypeTest, SizesNamesAndParse) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kBool}) {
    EXPECT_EQ(ParseDType(DTypeName(d)), d);
  }
  try {
    ParseDType("f64", "--dtype");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--dtype"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
}

TEST(BF16Test, ExactValuesAndRoundToNearestEven) {
  for (float x : {0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, 1.5f}) {
    EXPECT_EQ(BF16ToF32(F32ToBF16(x)), x);
  }
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  // bf16 keeps 7 mantissa bits: ulp(1) = 2^-7.
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.0f + std::ldexp(1.0f, -8))), 1.0f);  // tie -> even (1.0)
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.0f + 3 * std::ldexp(1.0f, -8))),
            1.0f + std::ldexp(1.0f, -6));  // tie -> even (1 + 2 ulp)
  EXPECT_EQ(BF16ToF32(F32ToBF16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));  // just above the tie rounds up
  EXPECT_EQ(BF16ToF32(F32ToBF16(-1.0f - std::ldexp(1.0f, -8))), -1.0f);
}

TEST(BF16Test, Specials) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(BF16ToF32(F32ToBF16(inf)), inf);
  EXPECT_EQ(BF16ToF32(F32ToBF16(-inf)), -inf);
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(std::nanf("")))));
  // A NaN whose payload lives only in the low 16 bits must stay NaN, not inf.
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(Bits(0x7f800001u)))));
  // FLT_MAX is above the largest bf16 by more than half an ulp: rounds to inf.
  EXPECT_EQ(BF16ToF32(F32ToBF16(std::numeric_limits<float>::max())), inf);
  EXPECT_TRUE(std::signbit(BF16ToF32(F32ToBF16(-0.0f))));
}

TEST(BF16Test, ExhaustiveRoundTripAndNearest) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = BF16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToBF16(f), h) << std::hex << h;
  }
  // Random floats round to the nearer of their two bf16 neighbours (the
  // truncation and the next value up in magnitude).
  std::mt19937 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t u = rng() & 0x7effffffu;  // finite, below the overflow range
    const float x = Bits(u);
    const float lo = Bits(u & 0xffff0000u);
    const float hi = Bits((u & 0xffff0000u) + 0x10000u);
    const float r = BF16ToF32(F32ToBF16(x));
    ASSERT_TRUE(r == lo || r == hi) << x;
    ASSERT_LE(std::fabs(r - x), std::fabs((r == lo ? hi : lo) - x)) << x;
  }
}

TEST(F16Test, KnownValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);                   // largest finite
  EXPECT_EQ(F32ToF16(65519.0f), 0x7bff);                   // below the rounding boundary
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);                   // rounds to inf
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);      // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);      // tie -> even (0)
  EXPECT_EQ(F32ToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie -> even (2)
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);      // smallest normal
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));
  // ulp(1) = 2^-10.
  EXPECT_EQ(F16ToF32(F32ToF16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(F16ToF32(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(F16ToF32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToF32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToF32(F32ToF16(std::nanf("")))));
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(1e-10f), 0x0000);  // underflows to zero
}

TEST(F16Test, ExhaustiveRoundTripAndNearest) {
  std::vector<float> finite;  // every non-negative finite f16 value, ascending
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(F32ToF16(f), h) << std::hex << h;
    if (h < 0x7c00u) finite.push_back(f);
  }
  // Random values in f16 range round to a nearest representable value.
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> mag(-30.0f, 15.9f);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(mag(rng)) * (1.0f + (rng() % 1000) / 1000.0f);
    if (x >= 65504.0f) continue;
    const float r = F16ToF32(F32ToF16(x));
    auto it = std::lower_bound(finite.begin(), finite.end(), x);
    const float above = *it;
    const float below = it == finite.begin() ? 0.0f : *(it - 1);
    ASSERT_LE(std::fabs(r - x), std::min(above - x, x - below)) << x;
  }
}

TEST(TensorViewTest, ContiguousStridesAndNumel) {
  float buf[24];
  const TensorView t = TensorView::Contiguous(buf, DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.stride[0], 12);
  EXPECT_EQ(t.stride[1], 4);
  EXPECT_EQ(t.stride[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.Offset(1, 2, 3), 23);
  EXPECT_EQ(t.Describe(), "[2, 3, 4] f32");
  EXPECT_FALSE(TensorView().defined());
  EXPECT_TRUE(t.defined());
}

TEST(TensorViewTest, TransposedIsAStridedViewOfTheSameMemory) {
  // Memory [B=2, H=3, S=4, D=5]; the view [B, S, H, D] must address the same
  // element as the original index (b, h, s, d).
  std::vector<float> buf(2 * 3 * 4 * 5);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  const TensorView bhsd = TensorView::Contiguous(buf.data(), DType::kF32, {2, 3, 4, 5});
  const TensorView bshd = bhsd.Transposed(1, 2);
  EXPECT_EQ(bshd.shape[1], 4);
  EXPECT_EQ(bshd.shape[2], 3);
  EXPECT_FALSE(bshd.is_contiguous());
  EXPECT_EQ(bshd.Describe(), "[2, 4, 3, 5] f32");
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t s = 0; s < 4; ++s)
        for (int64_t d = 0; d < 5; ++d)
          ASSERT_EQ(buf[bshd.Offset(b, s, h, d)], buf[bhsd.Offset(b, h, s, d)]);
  EXPECT_TRUE(bshd.Transposed(1, 2).is_contiguous());
  EXPECT_THROW(bhsd.Transposed(0, 4), Error);
  EXPECT_THROW(bhsd.Transposed(-1, 0), Error);
}

TEST(TensorViewTest, SizeOneDimsIgnoreStrideForContiguity) {
  float buf[4];
  TensorView t = TensorView::Contiguous(buf, DType::kF32, {1, 4});
  t.stride[0] = 999;
  EXPECT_TRUE(t.is_contiguous());
}

TEST(TensorTest, ZeroFilledAlignedAndMovable) {
  Tensor t(DType::kBF16, {3, 5});
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.bytes(), 30u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.data_as<uint16_t>()[i], 0);
  void* p = t.data();
  Tensor u(std::move(t));
  EXPECT_EQ(u.data(), p);
  EXPECT_EQ(t.data(), nullptr);  // NOLINT(bugprone-use-after-move): documented moved-from state
  Tensor w;
  w = std::move(u);
  EXPECT_EQ(w.data(), p);
  EXPECT_EQ(w.view().Describe(), "[3, 5] bf16");
  Tensor empty(DType::kF32, {0, 4});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_THROW(Tensor(DType::kF32, {-1}), Error);
}

TEST(TensorTest, LoadStoreEveryDtype) {
  Tensor f(DType::kF32, {1}), b(DType::kBF16, {1}), h(DType::kF16, {1}), i(DType::kI32, {1}),
      m(DType::kBool, {1});
  for (const Tensor* t : {&f, &b, &h, &i, &m}) StoreFromF32(t->view(), 0, 3.0f);
  EXPECT_EQ(LoadAsF32(f.view(), 0), 3.0f);
  EXPECT_EQ(LoadAsF32(b.view(), 0), 3.0f);
  EXPECT_EQ(LoadAsF32(h.view(), 0), 3.0f);
  EXPECT_EQ(LoadAsF32(i.view(), 0), 3.0f);
  EXPECT_EQ(LoadAsF32(m.view(), 0), 1.0f);
  StoreFromF32(b.view(), 0, 1.0f + std::ldexp(1.0f, -9));  // rounds to 1 in bf16
  EXPECT_EQ(LoadAsF32(b.view(), 0), 1.0f);
  StoreFromF32(h.view(), 0, 1.0f + std::ldexp(1.0f, -9));  // exact in f16
  EXPECT_EQ(LoadAsF32(h.view(), 0), 1.0f + std::ldexp(1.0f, -9));
}

TEST(CopyConvertTest, ConvertsIntoStridedViews) {
  // src: contiguous f32 [2, 3, 4, 5]; dst: bf16 memory [2, 4, 3, 5] viewed as
  // [2, 3, 4, 5].
  Tensor src(DType::kF32, {2, 3, 4, 5});
  for (int64_t i = 0; i < src.numel(); ++i) src.data_as<float>()[i] = 0.01f * i - 0.3f;
  Tensor dst(DType::kBF16, {2, 4, 3, 5});
  const TensorView dv = dst.view().Transposed(1, 2);
  CopyConvert(src.view(), dv);
  const TensorView sv = src.view();
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 4; ++c)
        for (int64_t d = 0; d < 5; ++d) {
          const float x = LoadAsF32(sv, sv.Offset(a, b, c, d));
          ASSERT_EQ(LoadAsF32(dv, dv.Offset(a, b, c, d)), BF16ToF32(F32ToBF16(x)));
        }
  // And back to f32 through a strided source.
  Tensor back(DType::kF32, {2, 3, 4, 5});
  CopyConvert(dv, back.view());
  for (int64_t i = 0; i < back.numel(); ++i) {
    ASSERT_EQ(back.data_as<float>()[i], BF16ToF32(F32ToBF16(src.data_as<float>()[i])));
  }
}

TEST(CopyConvertTest, F32StridedFastPathAndLowerRank) {
  Tensor src(DType::kF32, {3, 4});
  for (int64_t i = 0; i < 12; ++i) src.data_as<float>()[i] = static_cast<float>(i);
  Tensor dst(DType::kF32, {4, 3});
  CopyConvert(src.view(), dst.view().Transposed(0, 1));
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(dst.data_as<float>()[c * 3 + r], r * 4 + c);
}

TEST(CopyConvertTest, MismatchedShapesThrow) {
  Tensor a(DType::kF32, {2, 3}), b(DType::kF32, {3, 2}), c(DType::kF32, {6});
  EXPECT_THROW(CopyConvert(a.view(), b.view()), Error);
  EXPECT_THROW(CopyConvert(a.view(), c.view()), Error);
}

TEST(CopyConvertTest, LargestFiniteIsTheIeeeValue) {
  // f16: (2 - 2^-10) * 2^15; bf16: (2 - 2^-7) * 2^127 — from the formats, not the code.
  EXPECT_EQ(LargestFinite(DType::kF16), 65504.0f);
  EXPECT_EQ(LargestFinite(DType::kBF16), std::ldexp(255.0f, 120));
  EXPECT_EQ(LargestFinite(DType::kF32), std::numeric_limits<float>::max());
}

// A finite f32 beyond the f16 range is an Error naming the argument, the
// value, its index (over the source shape, whatever dst's strides) and the
// dtype; a strided [1, 2, 2, 4] dst still receives the other values.
TEST(CopyConvertTest, CheckedF16OverflowNamesArgumentValueAndIndex) {
  Tensor src(DType::kF32, {1, 2, 2, 4});
  for (int64_t i = 0; i < src.numel(); ++i) src.data_as<float>()[i] = static_cast<float>(i);
  const TensorView sv = src.view();
  src.data_as<float>()[sv.Offset(0, 1, 0, 3)] = 128000.0f;
  src.data_as<float>()[sv.Offset(0, 1, 1, 2)] = -1e6f;  // later: not the one reported
  Tensor dst(DType::kF16, {1, 2, 2, 4});
  const TensorView dv = dst.view().Transposed(1, 2);  // memory [1, 2, 2, 4], dims 1 and 2 swapped
  try {
    CopyConvert(sv, dv, "dv");
    FAIL() << "no error for 128000 in f16";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("dv: ", 0), 0u) << m;
    EXPECT_NE(m.find("128000"), std::string::npos) << m;
    EXPECT_NE(m.find("[0, 1, 0, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("f16"), std::string::npos) << m;
    EXPECT_NE(m.find("65504"), std::string::npos) << m;
  }
  // Every element was converted; the unchecked overload keeps storing +-inf.
  EXPECT_EQ(LoadAsF32(dv, dv.Offset(0, 0, 1, 2)), 6.0f);
  EXPECT_EQ(CopyConvertFindOverflow(sv, dv), 1 * 8 + 0 * 4 + 3);
  EXPECT_NO_THROW(CopyConvert(sv, dv));
  EXPECT_EQ(LoadAsF32(dv, dv.Offset(0, 1, 0, 3)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(LoadAsF32(dv, dv.Offset(0, 1, 1, 2)), -std::numeric_limits<float>::infinity());
}

TEST(CopyConvertTest, CheckedBF16OverflowAndTheEdgesOfTheRange) {
  const float max = std::numeric_limits<float>::max();
  Tensor src(DType::kF32, {3});
  Tensor dst(DType::kBF16, {3});
  src.data_as<float>()[0] = 1.0f;
  src.data_as<float>()[2] = max;  // rounds up to inf in bf16
  try {
    CopyConvert(src.view(), dst.view(), "out");
    FAIL() << "no error for FLT_MAX in bf16";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("out: ", 0), 0u) << m;
    EXPECT_NE(m.find("[2]"), std::string::npos) << m;
    EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  }
  // The largest finite values, and one that rounds down to them, fit.
  Tensor edge(DType::kF32, {4});
  float* e = edge.data_as<float>();
  e[0] = 65504.0f;
  e[1] = -65519.0f;  // below the midpoint 65520: rounds to -65504
  e[2] = std::ldexp(255.0f, 120);
  e[3] = -std::ldexp(255.0f, 120);
  Tensor h(DType::kF16, {2});
  CopyConvert(TensorView::Contiguous(e, DType::kF32, {2}), h.view(), "out");
  EXPECT_EQ(LoadAsF32(h.view(), 0), 65504.0f);
  EXPECT_EQ(LoadAsF32(h.view(), 1), -65504.0f);
  Tensor b(DType::kBF16, {2});
  CopyConvert(TensorView::Contiguous(e + 2, DType::kF32, {2}), b.view(), "out");
  EXPECT_EQ(LoadAsF32(b.view(), 0), e[2]);
  EXPECT_EQ(LoadAsF32(b.view(), 1), e[3]);
  // 65520 is the f16 midpoint: round-to-even goes up to inf.
  e[1] = 65520.0f;
  EXPECT_THROW(CopyConvert(TensorView::Contiguous(e, DType::kF32, {2}), h.view(), "out"), Error);
}

// The NaN rule: NaN and infinities that the caller's data already holds are
// copied unchanged, not reported; f32 outputs never overflow.
TEST(CopyConvertTest, CheckedConversionPassesNaNAndInfThrough) {
  const float inf = std::numeric_limits<float>::infinity();
  Tensor src(DType::kF32, {4});
  float* s = src.data_as<float>();
  s[0] = std::numeric_limits<float>::quiet_NaN();
  s[1] = inf;
  s[2] = -inf;
  s[3] = 2.0f;
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    Tensor dst(dt, {4});
    ASSERT_NO_THROW(CopyConvert(src.view(), dst.view(), "out")) << DTypeName(dt);
    EXPECT_TRUE(std::isnan(LoadAsF32(dst.view(), 0))) << DTypeName(dt);
    EXPECT_EQ(LoadAsF32(dst.view(), 1), inf) << DTypeName(dt);
    EXPECT_EQ(LoadAsF32(dst.view(), 2), -inf) << DTypeName(dt);
    EXPECT_EQ(LoadAsF32(dst.view(), 3), 2.0f) << DTypeName(dt);
  }
  Tensor big(DType::kF32, {1}), big_out(DType::kF32, {1});
  big.data_as<float>()[0] = std::numeric_limits<float>::max();
  EXPECT_NO_THROW(CopyConvert(big.view(), big_out.view(), "out"));
  EXPECT_EQ(big_out.data_as<float>()[0], std::numeric_limits<float>::max());
}

}  // namespace
}  // namespace ringsplash

// Tests of src/core/tensor.cc: bf16/f16 conversion (rounding, specials,
// exhaustive round trips), views (strides, Transposed, Describe, the layout
// factories Bshd / Bhsd / KvCache / Narrowed, and attention through them), the
// owning Tensor, element load/store and CopyConvert.
#include "ringsplash/tensor.h"

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "src/core/huge_pages.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

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

// ---- Layout factories ------------------------------------------------------

// Expects `what` to throw an Error whose message holds every one of `parts`.
template <typename Fn>
void ExpectError(Fn what, std::initializer_list<const char*> parts) {
  try {
    what();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const char* part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << part << " in " << e.what();
    }
  }
}

TEST(TensorViewFactoryTest, BshdIsTheContiguousModelLayout) {
  std::vector<uint16_t> buf(2 * 3 * 4 * 5);
  const TensorView t = TensorView::Bshd(buf.data(), DType::kBF16, 2, 3, 4, 5);
  EXPECT_EQ(t.data, buf.data());
  EXPECT_EQ(t.dtype, DType::kBF16);
  EXPECT_EQ(t.ndim, 4);
  EXPECT_EQ(t.shape, (std::array<int64_t, kMaxDims>{2, 3, 4, 5}));
  EXPECT_EQ(t.stride, (std::array<int64_t, kMaxDims>{60, 20, 5, 1}));
  EXPECT_TRUE(t.is_contiguous());
}

TEST(TensorViewFactoryTest, BhsdViewsHeadMajorMemoryAsTheModelLayout) {
  // Memory [B=2, H=3, S=4, D=5] holding its own C-order index; element
  // (b, s, h, d) of the view must be memory element [b][h][s][d].
  const int64_t B = 2, H = 3, S = 4, D = 5;
  std::vector<float> buf(static_cast<size_t>(B * H * S * D));
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  const TensorView t = TensorView::Bhsd(buf.data(), DType::kF32, B, H, S, D);
  EXPECT_EQ(t.data, buf.data());
  EXPECT_EQ(t.ndim, 4);
  EXPECT_EQ(t.shape, (std::array<int64_t, kMaxDims>{B, S, H, D}));
  EXPECT_EQ(t.stride, (std::array<int64_t, kMaxDims>{H * S * D, D, S * D, 1}));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(buf[t.Offset(b, s, h, d)], static_cast<float>(((b * H + h) * S + s) * D + d));
}

TEST(TensorViewFactoryTest, KvCacheViewsTheFirstRowsWithTheCacheStrides) {
  const int64_t B = 2, kMax = 10, Hkv = 3, D = 4;
  std::vector<float> cache(static_cast<size_t>(B * kMax * Hkv * D));
  for (const int64_t len : {int64_t{0}, int64_t{1}, int64_t{7}, kMax}) {
    const TensorView t = TensorView::KvCache(cache.data(), DType::kF32, B, kMax, Hkv, D, len);
    EXPECT_EQ(t.data, cache.data());
    EXPECT_EQ(t.shape, (std::array<int64_t, kMaxDims>{B, len, Hkv, D}));
    EXPECT_EQ(t.stride, (std::array<int64_t, kMaxDims>{kMax * Hkv * D, Hkv * D, D, 1}));
    // Batch 1's rows start after batch 0's whole allocation, not after len rows.
    EXPECT_EQ(t.Offset(1, 0, 0, 0), kMax * Hkv * D);
    EXPECT_EQ(t.is_contiguous(), len == kMax);
  }
  ExpectError([&] { TensorView::KvCache(cache.data(), DType::kF32, B, kMax, Hkv, D, kMax + 1); },
              {"KvCache", "len", "expected 0 to max_len = 10", "got 11"});
  ExpectError([&] { TensorView::KvCache(cache.data(), DType::kF32, B, kMax, Hkv, D, -1); },
              {"len", "got -1"});
}

TEST(TensorViewFactoryTest, NarrowedMovesDataToTheFirstIndexAndKeepsStrides) {
  const int64_t B = 2, H = 3, S = 8, D = 4;
  std::vector<uint16_t> buf(static_cast<size_t>(B * H * S * D));
  const TensorView t = TensorView::Bhsd(buf.data(), DType::kF16, B, H, S, D);
  const TensorView row = t.Narrowed(1, 5, 2);  // sequence rows 5 and 6
  EXPECT_EQ(row.data, buf.data() + 5 * D);     // 2 bytes per element: pointer of uint16_t
  EXPECT_EQ(row.shape, (std::array<int64_t, kMaxDims>{B, 2, H, D}));
  EXPECT_EQ(row.stride, t.stride);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t h = 0; h < H; ++h)
        EXPECT_EQ(static_cast<uint16_t*>(row.data) + row.Offset(b, s, h, 3),
                  buf.data() + t.Offset(b, s + 5, h, 3));
  // The whole range, an empty range at the end, and a cache in [B, H, S, D].
  EXPECT_EQ(t.Narrowed(1, 0, S).data, t.data);
  EXPECT_EQ(t.Narrowed(1, S, 0).shape[1], 0);
  const TensorView head = t.Narrowed(2, 1, 1);
  EXPECT_EQ(head.data, buf.data() + S * D);
  EXPECT_EQ(head.shape, (std::array<int64_t, kMaxDims>{B, S, 1, D}));
  TensorView undefined = t;
  undefined.data = nullptr;
  EXPECT_FALSE(undefined.Narrowed(1, 2, 1).defined());
  ExpectError([&] { t.Narrowed(4, 0, 1); }, {"Narrowed", "dim", "expected 0 to 3", "got 4"});
  ExpectError([&] { t.Narrowed(1, 9, 0); }, {"start", "expected 0 to 8", "got 9"});
  ExpectError([&] { t.Narrowed(1, 5, 4); }, {"length", "expected 0 to 3", "got 4"});
  ExpectError([&] { t.Narrowed(1, -1, 1); }, {"start", "got -1"});
}

TEST(TensorViewFactoryTest, NegativeSizesAreErrorsNamingTheSize) {
  float x = 0;
  ExpectError([&] { TensorView::Bshd(&x, DType::kF32, 1, -2, 1, 1); },
              {"TensorView::Bshd", "S: expected a size >= 0, got -2"});
  ExpectError([&] { TensorView::Bhsd(&x, DType::kF32, 1, -3, 1, 1); },
              {"TensorView::Bhsd", "H: expected a size >= 0, got -3"});
  ExpectError([&] { TensorView::KvCache(&x, DType::kF32, 1, 4, 1, -1, 1); },
              {"TensorView::KvCache", "D: expected a size >= 0, got -1"});
}

// ---- Attention through the factories' views --------------------------------
//
// Each view must give exactly the results of a contiguous copy of what it
// shows (the kernels read the same values in the same order; only the
// addresses differ), bitwise, and the f32 results must match the f64
// reference within kF32Tol.

namespace rt = ::ringsplash::testing;

// Relative to each tensor's largest magnitude (rt::ErrorsOf). f32 has unit
// roundoff u = 6e-8 and every result here is a sum of at most D + Skv <= 61
// rounded terms, so the worst case is ~4e-6 and the typical error far less; a
// row read from the wrong place (a wrong stride, a cache row past len) moves
// results by O(0.1).
constexpr double kF32Tol = 1e-5;

// Outputs of one call, through whatever views the caller chose.
struct OutputViews {
  TensorView out, lse, dq, dk, dv;
};

// Forward, then (with dout) backward, writing through `o`; results as doubles
// in C order of the logical shapes.
rt::ApiResult RunThrough(const AttentionInputs& in, const AttentionOptions& opt,
                         const TensorView& dout, const OutputViews& o) {
  rt::ApiResult r;
  AttentionForward(in, opt, o.out, o.lse);
  r.out = rt::ToDoubles(o.out);
  r.lse = rt::ToDoubles(o.lse);
  if (!dout.defined()) return r;
  AttentionBackward(in, opt, o.out, o.lse, dout, o.dq, o.dk, o.dv, TensorView());
  r.dq = rt::ToDoubles(o.dq);
  r.dk = rt::ToDoubles(o.dk);
  r.dv = rt::ToDoubles(o.dv);
  return r;
}

// A contiguous [B, S, H, D] copy of the view `t` (same dtype).
Tensor ContiguousCopy(const TensorView& t) {
  Tensor c(t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
  CopyConvert(t, c.view());
  return c;
}

void ExpectF32MatchesReference(const rt::ApiResult& got, const rt::OwnedInputs& copy,
                               const AttentionOptions& opt, const Tensor* dout) {
  const rt::Errors e = rt::ErrorsOf(got, rt::RunReference(copy, opt, dout));
  EXPECT_LT(e.out, kF32Tol) << e.Describe();
  EXPECT_LT(e.lse, kF32Tol) << e.Describe();
  EXPECT_LT(e.dq, kF32Tol) << e.Describe();
  EXPECT_LT(e.dk, kF32Tol) << e.Describe();
  EXPECT_LT(e.dv, kF32Tol) << e.Describe();
}

// Every tensor of a forward and a backward in [B, H, S, D] memory (inputs,
// dout, out, dq, dk, dv), with GQA, Dv != D and ragged lengths.
TEST(TensorViewAttentionTest, BhsdViewsEqualContiguousCopiesForwardAndBackward) {
  const int64_t B = 2, H = 4, Hkv = 2, Sq = 29, Skv = 45, D = 16, Dv = 24;
  rt::Rng rng(41);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Tensor qm = rt::RandomTensor(rng, dtype, {B, H, Sq, D});
    const Tensor km = rt::RandomTensor(rng, dtype, {B, Hkv, Skv, D});
    const Tensor vm = rt::RandomTensor(rng, dtype, {B, Hkv, Skv, Dv});
    const Tensor doutm = rt::RandomTensor(rng, dtype, {B, H, Sq, Dv});
    AttentionInputs in;
    in.q = TensorView::Bhsd(qm.data(), dtype, B, H, Sq, D);
    in.k = TensorView::Bhsd(km.data(), dtype, B, Hkv, Skv, D);
    in.v = TensorView::Bhsd(vm.data(), dtype, B, Hkv, Skv, Dv);
    const TensorView dout = TensorView::Bhsd(doutm.data(), dtype, B, H, Sq, Dv);
    Tensor out_m(dtype, {B, H, Sq, Dv}), lse(DType::kF32, {B, H, Sq});
    Tensor dq_m(DType::kF32, {B, H, Sq, D}), dk_m(DType::kF32, {B, Hkv, Skv, D}),
        dv_m(DType::kF32, {B, Hkv, Skv, Dv});
    const OutputViews o = {TensorView::Bhsd(out_m.data(), dtype, B, H, Sq, Dv), lse.view(),
                           TensorView::Bhsd(dq_m.data(), DType::kF32, B, H, Sq, D),
                           TensorView::Bhsd(dk_m.data(), DType::kF32, B, Hkv, Skv, D),
                           TensorView::Bhsd(dv_m.data(), DType::kF32, B, Hkv, Skv, Dv)};
    rt::OwnedInputs copy;
    copy.q = ContiguousCopy(in.q);
    copy.k = ContiguousCopy(in.k);
    copy.v = ContiguousCopy(in.v);
    const Tensor dout_copy = ContiguousCopy(dout);
    for (const KernelPath path : SupportedKernelPaths()) {
      SCOPED_TRACE(KernelPathName(path));
      AttentionOptions opt;
      opt.mask = Mask::Causal();
      opt.kernel_path = path;
      const rt::ApiResult got = RunThrough(in, opt, dout, o);
      rt::ApiRun run;
      run.out_dtype = dtype;
      const rt::ApiResult want = rt::RunAttention(copy, opt, &dout_copy, run);
      EXPECT_EQ(got.out, want.out);
      EXPECT_EQ(got.lse, want.lse);
      EXPECT_EQ(got.dq, want.dq);
      EXPECT_EQ(got.dk, want.dk);
      EXPECT_EQ(got.dv, want.dv);
      if (dtype == DType::kF32) ExpectF32MatchesReference(got, copy, opt, &dout_copy);
    }
  }
}

// A decoding step (and a short prefill chunk) against the first len rows of
// K/V caches allocated for more, laid out [B, max_len, Hkv, D] (KvCache) and
// [B, Hkv, max_len, D] (Bhsd + Narrowed). The rows from len on hold NaN: a
// kernel reading one of them would turn its output NaN.
TEST(TensorViewAttentionTest, KvCacheViewsReadOnlyTheValidRows) {
  const int64_t B = 2, H = 4, Hkv = 2, kMax = 64, D = 16, Dv = 8;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  rt::Rng rng(42);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const bool head_major : {false, true}) {
      Tensor k_cache(dtype, head_major ? std::vector<int64_t>{B, Hkv, kMax, D}
                                       : std::vector<int64_t>{B, kMax, Hkv, D});
      Tensor v_cache(dtype, head_major ? std::vector<int64_t>{B, Hkv, kMax, Dv}
                                       : std::vector<int64_t>{B, kMax, Hkv, Dv});
      for (const int64_t len : {1, 17, 40}) {
        for (const int64_t sq : {int64_t{1}, int64_t{5}}) {
          if (sq > len) continue;
          SCOPED_TRACE(std::string(DTypeName(dtype)) +
                       (head_major ? " [B,Hkv,S,D]" : " [B,S,Hkv,D]") + " len " +
                       std::to_string(len) + " sq " + std::to_string(sq));
          AttentionInputs in;
          if (head_major) {
            in.k = TensorView::Bhsd(k_cache.data(), dtype, B, Hkv, kMax, D).Narrowed(1, 0, len);
            in.v = TensorView::Bhsd(v_cache.data(), dtype, B, Hkv, kMax, Dv).Narrowed(1, 0, len);
          } else {
            in.k = TensorView::KvCache(k_cache.data(), dtype, B, kMax, Hkv, D, len);
            in.v = TensorView::KvCache(v_cache.data(), dtype, B, kMax, Hkv, Dv, len);
          }
          // Valid rows random, the rest NaN.
          TensorView k_rest = in.k, v_rest = in.v;
          k_rest.shape[1] = v_rest.shape[1] = kMax;  // the whole allocation, same strides
          rt::FromDoubles(std::vector<double>(static_cast<size_t>(k_rest.numel()), nan), k_rest);
          rt::FromDoubles(std::vector<double>(static_cast<size_t>(v_rest.numel()), nan), v_rest);
          rt::FillRandom(rng, in.k);
          rt::FillRandom(rng, in.v);
          const Tensor q = rt::RandomTensor(rng, dtype, {B, sq, H, D});
          in.q = q.view();
          for (int64_t i = 0; i < sq; ++i) in.q_positions.push_back(len - sq + i);
          Tensor out(DType::kF32, {B, sq, H, Dv}), lse(DType::kF32, {B, H, sq});
          rt::OwnedInputs copy;
          copy.q = ContiguousCopy(in.q);
          copy.k = ContiguousCopy(in.k);
          copy.v = ContiguousCopy(in.v);
          copy.q_pos = in.q_positions;
          // Every path: the decoding kernels read K and V in place, 8 or 16
          // keys per vector.
          for (const KernelPath path : SupportedKernelPaths()) {
            SCOPED_TRACE(KernelPathName(path));
            AttentionOptions opt;
            opt.mask = Mask::Causal();
            opt.kernel_path = path;
            const rt::ApiResult got =
                RunThrough(in, opt, TensorView(), {out.view(), lse.view(), {}, {}, {}});
            EXPECT_FALSE(rt::HasNaN(got.out));
            const rt::ApiResult want = rt::RunAttention(copy, opt, nullptr);
            EXPECT_EQ(got.out, want.out);
            EXPECT_EQ(got.lse, want.lse);
            if (dtype == DType::kF32) {
              const rt::Errors e = rt::ErrorsOf(got, rt::RunReference(copy, opt, nullptr));
              EXPECT_LT(e.out, kF32Tol) << e.Describe();
              EXPECT_LT(e.lse, kF32Tol) << e.Describe();
            }
          }
        }
      }
    }
  }
}

// Inputs may repeat a slice with stride 0 (tensor.h): one K/V shared by
// every batch entry equals K/V copied into each.
TEST(TensorViewAttentionTest, StrideZeroInputsRepeatTheSlice) {
  const int64_t B = 3, H = 2, Hkv = 1, Sq = 20, Skv = 33, D = 16, Dv = 16;
  rt::Rng rng(43);
  const Tensor k1 = rt::RandomTensor(rng, DType::kF32, {1, Skv, Hkv, D});
  const Tensor v1 = rt::RandomTensor(rng, DType::kF32, {1, Skv, Hkv, Dv});
  const Tensor q = rt::RandomTensor(rng, DType::kF32, {B, Sq, H, D});
  const Tensor dout = rt::RandomTensor(rng, DType::kF32, {B, Sq, H, Dv});
  AttentionInputs in;
  in.q = q.view();
  in.k = k1.view();
  in.v = v1.view();
  in.k.shape[0] = in.v.shape[0] = B;
  in.k.stride[0] = in.v.stride[0] = 0;
  Tensor out(DType::kF32, {B, Sq, H, Dv}), lse(DType::kF32, {B, H, Sq});
  Tensor dq(DType::kF32, {B, Sq, H, D}), dk(DType::kF32, {B, Skv, Hkv, D}),
      dv(DType::kF32, {B, Skv, Hkv, Dv});
  AttentionOptions opt;
  opt.mask = Mask::Local(7, 2);
  const rt::ApiResult got =
      RunThrough(in, opt, dout.view(), {out.view(), lse.view(), dq.view(), dk.view(), dv.view()});

  rt::OwnedInputs copy;
  copy.q = ContiguousCopy(in.q);
  copy.k = ContiguousCopy(in.k);
  copy.v = ContiguousCopy(in.v);
  const rt::ApiResult want = rt::RunAttention(copy, opt, &dout);
  EXPECT_EQ(got.out, want.out);
  EXPECT_EQ(got.lse, want.lse);
  EXPECT_EQ(got.dq, want.dq);
  EXPECT_EQ(got.dk, want.dk);
  EXPECT_EQ(got.dv, want.dv);
  ExpectF32MatchesReference(got, copy, opt, &dout);
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

// Tensors of kHugeMinBytes and more start on a 2 MiB boundary (so
// transparent huge pages can back them, core/huge_pages.h) and are zero
// filled to their last byte like small ones; moving one keeps its memory.
TEST(TensorTest, LargeTensorsAreHugePageAlignedAndZeroFilled) {
  const int64_t rows = static_cast<int64_t>(kHugeMinBytes / (2 * 1000)) + 1;  // not whole blocks
  Tensor t(DType::kBF16, {rows, 1000});
  ASSERT_GE(t.bytes(), kHugeMinBytes);
  // Under AddressSanitizer every tensor comes from its allocator instead.
  const uintptr_t align = kMapHugePages ? kHugePageBytes : 64;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % align, 0u);
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  size_t nonzero = 0;
  for (size_t i = 0; i < t.bytes(); ++i) nonzero += bytes[i] != 0 ? 1 : 0;
  EXPECT_EQ(nonzero, 0u);
  t.data_as<uint16_t>()[t.numel() - 1] = 0x3F80;  // the last element is writable
  void* p = t.data();
  Tensor u(std::move(t));
  EXPECT_EQ(u.data(), p);
  EXPECT_EQ(u.data_as<uint16_t>()[u.numel() - 1], 0x3F80);
  Tensor just_below(DType::kBool, {static_cast<int64_t>(kHugeMinBytes) - 1});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(just_below.data()) % 64, 0u);
  // Move assignment frees the old memory by its own size (mapped or not).
  just_below = std::move(u);
  EXPECT_EQ(just_below.data(), p);
  u = Tensor(DType::kBool, {7});
  EXPECT_NE(u.data(), nullptr);
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

// Unit-stride f32 -> bf16 rows take a loop of their own (vectorised): it
// must round as F32ToBF16 does, element by element (ties to even, NaN kept
// and made quiet), and report the first overflow in row-major order past NaN
// and infinities already in the data, as the strided path does — also in
// the columns past the last full vector.
TEST(CopyConvertTest, ContiguousBF16RowsRoundAndReportTheFirstOverflow) {
  const float max = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  auto bits = [](uint32_t u) { return std::bit_cast<float>(u); };
  Tensor src(DType::kF32, {3, 37});
  float* s = src.data_as<float>();
  for (int64_t i = 0; i < src.numel(); ++i) {
    s[i] = std::ldexp(1.0f + 0.0078125f * static_cast<float>(i % 7), static_cast<int>(i % 40) - 20);
  }
  // Values whose bf16 is known from the format alone (the rows before the
  // first overflow hold every kind).
  const std::pair<int64_t, std::pair<float, uint16_t>> known[] = {
      {5, {std::numeric_limits<float>::quiet_NaN(), 0x7fc0}},
      {6, {-inf, 0xff80}},
      {37 + 10, {bits(0xffffffffu), 0xffff}},  // a NaN that plain rounding would wrap to +0
      {37 + 11, {bits(0x7f800001u), 0x7fc0}},  // signalling NaN: made quiet
      {37 + 12, {inf, 0x7f80}},
      {37 + 13, {bits(0x3f808000u), 0x3f80}},  // a tie: to the even neighbour below
      {37 + 14, {bits(0x3f818000u), 0x3f82}},  // a tie: to the even neighbour above
      {37 + 15, {bits(0x7f7f7fffu), 0x7f7f}},  // just below the overflow threshold
  };
  for (const auto& [at, v] : known) s[at] = v.first;
  s[37 + 30] = -max;  // the first overflow, row 1
  s[37 + 31] = max;
  s[2 * 37 + 2] = max;
  Tensor dst(DType::kBF16, {3, 37});
  EXPECT_EQ(CopyConvertFindOverflow(src.view(), dst.view()), 37 + 30);
  for (const auto& [at, v] : known) EXPECT_EQ(dst.data_as<uint16_t>()[at], v.second) << at;
  EXPECT_EQ(dst.data_as<uint16_t>()[37 + 30], 0xff80);
  // The same through a strided destination (the element-wise path).
  Tensor wide(DType::kBF16, {3, 74});
  TensorView strided = wide.view();
  strided.shape[1] = 37;
  strided.stride[1] = 2;
  EXPECT_EQ(CopyConvertFindOverflow(src.view(), strided), 37 + 30);
  for (int64_t i = 0; i < src.numel(); ++i) {
    EXPECT_EQ(dst.data_as<uint16_t>()[i], wide.data_as<uint16_t>()[(i / 37) * 74 + (i % 37) * 2])
        << i;
  }
  // An overflow only in the tail columns (32..36) of the last row.
  s[37 + 30] = s[37 + 31] = s[2 * 37 + 2] = 1.0f;
  EXPECT_EQ(CopyConvertFindOverflow(src.view(), dst.view()), -1);
  s[2 * 37 + 35] = bits(0x7f7f8000u);  // rounds up to +inf
  EXPECT_EQ(CopyConvertFindOverflow(src.view(), dst.view()), 2 * 37 + 35);
}

TEST(CopyConvertTest, Bf16OverflowedIsAFiniteValueRoundedToInfinity) {
  const float max = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  auto over = [](float f) { return Bf16Overflowed(f, F32ToBF16(f)); };
  EXPECT_TRUE(over(max));
  EXPECT_TRUE(over(-max));
  EXPECT_TRUE(over(std::bit_cast<float>(0x7f7f8000u)));
  EXPECT_FALSE(over(std::bit_cast<float>(0x7f7f7fffu)));
  EXPECT_FALSE(over(inf));
  EXPECT_FALSE(over(-inf));
  EXPECT_FALSE(over(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(over(1.0f));
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

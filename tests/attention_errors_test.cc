// Every argument check of the single-device API (attention.h), table-driven:
// each case breaks one thing in an otherwise valid call and expects an Error
// whose message names the argument, says what was expected and what was
// given. Input/option checks must read the same from ValidateAttentionInputs,
// AttentionForward and AttentionBackward (the ring and CLI rely on that).
// Then the aliasing rule, on the single-device and the ring entry points:
// every (output, input) and (output, output) pair is refused naming both,
// while views that interleave in one buffer without sharing memory pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/validate.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

// A valid call: B=2, Sq=8, Skv=16, H=4, Hkv=2, D=16, Dv=8, f32, with sinks
// and segments; every view can be replaced by a case.
struct Call {
  OwnedInputs owned;
  AttentionInputs in;
  AttentionOptions opt;
  Tensor out_t, lse_t, dout_t, dq_t, dk_t, dv_t, dsinks_t;
  TensorView out, lse, dout, dq, dk, dv, dsinks;
  std::vector<Tensor> keep;  // storage for replacement tensors

  Call() {
    Rng rng(1);
    ProblemSpec spec(2, 8, 16, 4, 2, 16, 8);
    spec.sinks = true;
    spec.segments = true;
    owned = RandomInputs(rng, spec);
    in = owned.inputs();
    opt.block_sizes = {16, 16};
    out_t = Tensor(DType::kF32, {2, 8, 4, 8});
    lse_t = Tensor(DType::kF32, {2, 4, 8});
    dout_t = RandomTensor(rng, DType::kF32, {2, 8, 4, 8});
    dq_t = Tensor(DType::kF32, {2, 8, 4, 16});
    dk_t = Tensor(DType::kF32, {2, 16, 2, 16});
    dv_t = Tensor(DType::kF32, {2, 16, 2, 8});
    dsinks_t = Tensor(DType::kF32, {4});
    out = out_t.view();
    lse = lse_t.view();
    dout = dout_t.view();
    dq = dq_t.view();
    dk = dk_t.view();
    dv = dv_t.view();
    dsinks = dsinks_t.view();
  }
  // Every tensor a call could write: the outputs and any replacement.
  std::vector<Tensor*> Writable() {
    std::vector<Tensor*> t = {&out_t, &lse_t, &dq_t, &dk_t, &dv_t, &dsinks_t};
    for (Tensor& k : keep) t.push_back(&k);
    return t;
  }
  // Fills them with a byte pattern no kernel result has (0x5A5A5A5A is a
  // float near 1.5e16), so any write shows.
  void FillSentinel() {
    for (Tensor* t : Writable()) std::memset(t->data(), 0x5A, t->bytes());
  }
  // Names (by index in Writable()) of those no longer holding the pattern.
  std::string Touched() {
    std::string touched;
    const std::vector<Tensor*> all = Writable();
    for (size_t i = 0; i < all.size(); ++i) {
      const auto* bytes = static_cast<const unsigned char*>(all[i]->data());
      if (std::any_of(bytes, bytes + all[i]->bytes(), [](unsigned char b) { return b != 0x5A; })) {
        touched += " #" + std::to_string(i);
      }
    }
    return touched;
  }
  // A zero tensor kept alive for the call's lifetime.
  TensorView Make(DType dtype, std::vector<int64_t> shape) {
    keep.emplace_back(dtype, std::move(shape));
    return keep.back().view();
  }
};

enum class Where { kInputs, kForwardOutputs, kBackwardOnly };

struct ErrorCase {
  std::string name;
  Where where;
  std::function<void(Call&)> breaker;
  std::vector<std::string> must_contain;  // the argument name comes first
};
void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

std::string MessageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("NOT A ringsplash::Error: ") + e.what();
  }
  return "NO ERROR";
}

std::vector<ErrorCase> Cases() {
  using W = Where;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<ErrorCase> c;
  auto add = [&c](std::string name, W w, std::function<void(Call&)> f, std::vector<std::string> m) {
    c.push_back({std::move(name), w, std::move(f), std::move(m)});
  };
  // q
  add("q_3d", W::kInputs,
      [](Call& x) {
        x.in.q = x.Make(DType::kF32, {2, 8, 64});
      },
      {"q:", "[2, 8, 64] f32"});
  add("q_null", W::kInputs, [](Call& x) { x.in.q.data = nullptr; }, {"q:", "null"});
  add("q_i32", W::kInputs, [](Call& x) { x.in.q.dtype = DType::kI32; }, {"q:", "i32"});
  add("q_head_dim_300", W::kInputs,
      [](Call& x) {
        x.in.q = x.Make(DType::kF32, {2, 8, 4, 300});
      },
      {"q:", "1..256", "300"});
  add("q_negative_stride", W::kInputs, [](Call& x) { x.in.q.stride[1] = -64; },
      {"q:", "stride", "-64"});
  add("q_zero_size", W::kInputs, [](Call& x) { x.in.q.shape[1] = 0; }, {"q:", "positive"});
  // k
  add("k_batch", W::kInputs,
      [](Call& x) {
        x.in.k = x.Make(DType::kF32, {3, 16, 2, 16});
      },
      {"k:", "B=2", "[3, 16, 2, 16]"});
  add("k_head_dim", W::kInputs,
      [](Call& x) {
        x.in.k = x.Make(DType::kF32, {2, 16, 2, 8});
      },
      {"k:", "D=16", "[2, 16, 2, 8]"});
  add("k_heads_not_dividing", W::kInputs,
      [](Call& x) {
        x.in.k = x.Make(DType::kF32, {2, 16, 3, 16});
      },
      {"k:", "Hkv dividing H=4", "[2, 16, 3, 16] f32"});
  add("k_dtype", W::kInputs, [](Call& x) { x.in.k.dtype = DType::kBF16; }, {"k:", "f32", "bf16"});
  add("k_4d_expected", W::kInputs,
      [](Call& x) {
        x.in.k = x.Make(DType::kF32, {2, 16, 32});
      },
      {"k:", "4 dims"});
  // v
  add("v_seq", W::kInputs,
      [](Call& x) {
        x.in.v = x.Make(DType::kF32, {2, 15, 2, 8});
      },
      {"v:", "Skv=16", "[2, 15, 2, 8]"});
  add("v_heads", W::kInputs,
      [](Call& x) {
        x.in.v = x.Make(DType::kF32, {2, 16, 1, 8});
      },
      {"v:", "Hkv=2"});
  add("v_dim_300", W::kInputs,
      [](Call& x) {
        x.in.v = x.Make(DType::kF32, {2, 16, 2, 300});
      },
      {"v:", "1..256", "300"});
  add("v_dtype", W::kInputs, [](Call& x) { x.in.v.dtype = DType::kF16; }, {"v:", "f16"});
  // sinks
  add("sinks_shape", W::kInputs, [](Call& x) { x.in.sinks = x.Make(DType::kF32, {3}); },
      {"sinks:", "[H=4] f32", "[3] f32"});
  add("sinks_nan", W::kInputs, [nan](Call& x) { x.owned.sinks.data_as<float>()[2] = nan; },
      {"sinks[2]:", "a finite value or -inf (no sink for this head)", "nan"});
  add("sinks_inf", W::kInputs, [inf](Call& x) { x.owned.sinks.data_as<float>()[0] = inf; },
      {"sinks[0]:", "a finite value or -inf", "got inf"});
  add("sinks_dtype", W::kInputs, [](Call& x) { x.in.sinks = x.Make(DType::kBF16, {4}); },
      {"sinks:", "bf16"});
  add("sinks_2d", W::kInputs,
      [](Call& x) {
        x.in.sinks = x.Make(DType::kF32, {4, 1});
      },
      {"sinks:"});
  // segments
  add("only_q_segments", W::kInputs, [](Call& x) { x.in.kv_segments = TensorView(); },
      {"kv_segments:", "both"});
  add("only_kv_segments", W::kInputs, [](Call& x) { x.in.q_segments = TensorView(); },
      {"q_segments:", "both"});
  add("q_segments_dtype", W::kInputs, [](Call& x) { x.in.q_segments.dtype = DType::kF32; },
      {"q_segments:", "i32", "f32"});
  add("q_segments_shape", W::kInputs,
      [](Call& x) {
        x.in.q_segments = x.Make(DType::kI32, {2, 9});
      },
      {"q_segments:", "Sq=8", "[2, 9]"});
  add("kv_segments_shape", W::kInputs,
      [](Call& x) {
        x.in.kv_segments = x.Make(DType::kI32, {1, 16});
      },
      {"kv_segments:", "B=2", "[1, 16]"});
  // positions
  add("q_positions_length", W::kInputs,
      [](Call& x) {
        x.in.q_positions = {0, 1, 2};
      },
      {"q_positions:", "8", "3"});
  add("q_positions_negative", W::kInputs,
      [](Call& x) { x.in.q_positions = {0, 1, 2, 3, 4, 5, 6, -7}; },
      {"q_positions:", "non-negative", "-7"});
  add("kv_positions_length", W::kInputs,
      [](Call& x) { x.in.kv_positions = std::vector<int64_t>(17, 0); },
      {"kv_positions:", "16", "17"});
  // mask
  add("mask_per_head_count", W::kInputs,
      [](Call& x) {
        x.opt.mask = Mask::PerHead({Mask::Causal(), Mask::Causal(), Mask::Full()});
      },
      {"mask:", "H=4", "3 heads"});
  add("mask_dense_heads", W::kInputs,
      [](Call& x) { x.opt.mask = Mask::Dense(std::vector<uint8_t>(2 * 8 * 16, 1), 2, 8, 16); },
      {"mask:", "H=4", "2 heads"});
  add("mask_dense_too_small", W::kInputs,
      [](Call& x) { x.opt.mask = Mask::Dense(std::vector<uint8_t>(8 * 10, 1), 0, 8, 10); },
      {"mask:", "dense", "15", "[8, 10]"});
  add("mask_dense_vs_positions", W::kInputs,
      [](Call& x) {
        x.opt.mask = Mask::Dense(std::vector<uint8_t>(16 * 16, 1), 0, 16, 16);
        x.in.q_positions = {10, 11, 12, 13, 14, 15, 16, 17};
      },
      {"mask:", "17", "[16, 16]"});
  // options
  add("softcap_zero", W::kInputs, [](Call& x) { x.opt.softcap = 0.0f; }, {"softcap:", "> 0"});
  add("softcap_negative", W::kInputs, [](Call& x) { x.opt.softcap = -1.0f; }, {"softcap:", "-1"});
  add("softcap_inf", W::kInputs, [inf](Call& x) { x.opt.softcap = inf; }, {"softcap:", "inf"});
  add("softcap_nan", W::kInputs, [nan](Call& x) { x.opt.softcap = nan; }, {"softcap:", "nan"});
  add("scale_inf", W::kInputs, [inf](Call& x) { x.opt.scale = -inf; }, {"scale:", "finite"});
  add("scale_nan", W::kInputs, [nan](Call& x) { x.opt.scale = nan; }, {"scale:", "nan"});
  add("block_q_zero", W::kInputs, [](Call& x) { x.opt.block_sizes.q = 0; },
      {"block_sizes.q:", "multiple of 16", "0"});
  add("block_q_24", W::kInputs, [](Call& x) { x.opt.block_sizes.q = 24; },
      {"block_sizes.q:", "24"});
  add("block_q_negative", W::kInputs, [](Call& x) { x.opt.block_sizes.q = -16; },
      {"block_sizes.q:", "-16"});
  add("block_kv_8", W::kInputs, [](Call& x) { x.opt.block_sizes.kv = 8; },
      {"block_sizes.kv:", "8"});
  add("num_threads_negative", W::kInputs, [](Call& x) { x.opt.num_threads = -2; },
      {"num_threads:", "-2"});
  add("num_threads_huge", W::kInputs, [](Call& x) { x.opt.num_threads = 100000; },
      {"num_threads: expected 0 (all hardware threads) to 1024, got 100000"});
  // forward outputs
  add("out_shape", W::kForwardOutputs,
      [](Call& x) {
        x.out = x.Make(DType::kF32, {2, 8, 4, 16});
      },
      {"out:", "Dv=8", "[2, 8, 4, 16]"});
  add("out_dtype", W::kForwardOutputs,
      [](Call& x) {
        x.out = x.Make(DType::kBF16, {2, 8, 4, 8});
      },
      {"out:", "f32", "bf16"});
  add("out_i32", W::kForwardOutputs, [](Call& x) { x.out.dtype = DType::kI32; }, {"out:", "i32"});
  add("out_null", W::kForwardOutputs, [](Call& x) { x.out.data = nullptr; }, {"out:", "null"});
  add("lse_shape", W::kForwardOutputs,
      [](Call& x) {
        x.lse = x.Make(DType::kF32, {2, 8, 4});
      },
      {"lse:", "[B=2, H=4, Sq=8] f32", "[2, 8, 4]"});
  add("lse_dtype", W::kForwardOutputs,
      [](Call& x) {
        x.lse = x.Make(DType::kBF16, {2, 4, 8});
      },
      {"lse:", "bf16"});
  add("lse_negative_stride", W::kForwardOutputs, [](Call& x) { x.lse.stride[2] = -1; },
      {"lse:", "stride"});
  add("out_zero_stride", W::kForwardOutputs, [](Call& x) { x.out.stride[2] = 0; },
      {"out:", "do not overlap", "stride 0 in dim 2 of size 4"});
  add("out_equal_strides", W::kForwardOutputs, [](Call& x) { x.out.stride[1] = x.out.stride[2]; },
      {"out:", "do not overlap", "same stride 8 in dims 1 and 2"});
  add("lse_zero_stride", W::kForwardOutputs, [](Call& x) { x.lse.stride[0] = 0; },
      {"lse:", "do not overlap", "stride 0 in dim 0 of size 2"});
  // backward-only arguments
  add("dout_shape", W::kBackwardOnly,
      [](Call& x) {
        x.dout = x.Make(DType::kF32, {2, 8, 4, 9});
      },
      {"dout:", "shape of out", "[2, 8, 4, 9]"});
  add("dout_dtype", W::kBackwardOnly, [](Call& x) { x.dout.dtype = DType::kBF16; },
      {"dout:", "bf16"});
  add("dq_shape", W::kBackwardOnly,
      [](Call& x) {
        x.dq = x.Make(DType::kF32, {2, 8, 4, 8});
      },
      {"dq:", "shape of q", "[2, 8, 4, 8]"});
  add("dk_shape", W::kBackwardOnly,
      [](Call& x) {
        x.dk = x.Make(DType::kF32, {2, 16, 4, 16});
      },
      {"dk:", "shape of k"});
  add("dv_shape", W::kBackwardOnly,
      [](Call& x) {
        x.dv = x.Make(DType::kF32, {2, 16, 2, 16});
      },
      {"dv:", "shape of v"});
  add("dq_dtype", W::kBackwardOnly, [](Call& x) { x.dq.dtype = DType::kI32; }, {"dq:", "i32"});
  add("dv_null", W::kBackwardOnly, [](Call& x) { x.dv.data = nullptr; }, {"dv:", "null"});
  add("dsinks_missing", W::kBackwardOnly, [](Call& x) { x.dsinks = TensorView(); },
      {"dsinks:", "[H=4] f32"});
  add("dsinks_shape", W::kBackwardOnly, [](Call& x) { x.dsinks = x.Make(DType::kF32, {2}); },
      {"dsinks:", "[2] f32"});
  add("dsinks_without_sinks", W::kBackwardOnly, [](Call& x) { x.in.sinks = TensorView(); },
      {"dsinks:", "no sinks"});
  add("dq_zero_stride", W::kBackwardOnly, [](Call& x) { x.dq.stride[1] = 0; },
      {"dq:", "do not overlap", "stride 0 in dim 1 of size 8"});
  add("dk_zero_stride", W::kBackwardOnly, [](Call& x) { x.dk.stride[3] = 0; },
      {"dk:", "do not overlap", "stride 0 in dim 3 of size 16"});
  add("dv_equal_strides", W::kBackwardOnly, [](Call& x) { x.dv.stride[0] = x.dv.stride[1]; },
      {"dv:", "do not overlap", "same stride 16 in dims 0 and 1"});
  add("dsinks_zero_stride", W::kBackwardOnly, [](Call& x) { x.dsinks.stride[0] = 0; },
      {"dsinks:", "do not overlap", "stride 0 in dim 0 of size 4"});
  return c;
}

class ErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(ErrorTest, NamesTheArgument) {
  const ErrorCase& ec = GetParam();
  Call call;
  ec.breaker(call);
  std::vector<std::pair<std::string, std::string>> messages;
  if (ec.where == Where::kInputs) {
    messages.emplace_back("ValidateAttentionInputs",
                          MessageOf([&] { ValidateAttentionInputs(call.in, call.opt); }));
  }
  // attention.h: argument checks run before anything is written, so after
  // such an Error every output is untouched (outputs numbered as in
  // Call::Writable: out, lse, dq, dk, dv, dsinks, then replacements).
  std::vector<std::string> touched;
  if (ec.where != Where::kBackwardOnly) {
    call.FillSentinel();
    messages.emplace_back("AttentionForward", MessageOf([&] {
                            AttentionForward(call.in, call.opt, call.out, call.lse);
                          }));
    touched.push_back(call.Touched());
  }
  call.FillSentinel();
  messages.emplace_back("AttentionBackward", MessageOf([&] {
                          AttentionBackward(call.in, call.opt, call.out, call.lse, call.dout,
                                            call.dq, call.dk, call.dv, call.dsinks);
                        }));
  touched.push_back(call.Touched());
  for (const std::string& t : touched) EXPECT_EQ(t, "") << "outputs written before the Error";
  for (const auto& [entry, msg] : messages) {
    SCOPED_TRACE(entry + ": " + msg);
    // The message starts with the argument's name.
    EXPECT_EQ(msg.rfind(ec.must_contain.front(), 0), 0u);
    for (const std::string& part : ec.must_contain) EXPECT_NE(msg.find(part), std::string::npos);
    EXPECT_NE(msg.find("expected"), std::string::npos);
    EXPECT_EQ(msg, messages.front().second);  // every entry point says the same
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ErrorTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ErrorTest, ValidCallPasses) {
  Call call;
  EXPECT_NO_THROW(ValidateAttentionInputs(call.in, call.opt));
  EXPECT_NO_THROW(AttentionForward(call.in, call.opt, call.out, call.lse));
  EXPECT_NO_THROW(AttentionBackward(call.in, call.opt, call.out, call.lse, call.dout, call.dq,
                                    call.dk, call.dv, call.dsinks));
}

// A sink of -inf is "no sink for this head" (SPEC §2.4): accepted by every
// entry point (its results: NumericsSinks, NumericsEmptyRows).
TEST(ErrorTest, MinusInfSinkPasses) {
  Call call;
  call.owned.sinks.data_as<float>()[3] = -std::numeric_limits<float>::infinity();
  EXPECT_NO_THROW(ValidateAttentionInputs(call.in, call.opt));
  EXPECT_NO_THROW(AttentionForward(call.in, call.opt, call.out, call.lse));
  EXPECT_NO_THROW(AttentionBackward(call.in, call.opt, call.out, call.lse, call.dout, call.dq,
                                    call.dk, call.dv, call.dsinks));
  EXPECT_EQ(call.dsinks_t.data_as<float>()[3], 0.0f);
}

// The largest thread count allowed passes validation.
TEST(ErrorTest, NumThreadsAtTheLimitPasses) {
  Call call;
  call.opt.num_threads = 1024;
  EXPECT_NO_THROW(ValidateAttentionInputs(call.in, call.opt));
}

// A stride of 0 on a dim of size 1 aliases nothing: such outputs are
// accepted and written like contiguous ones (against the f64 reference, the
// backward fed dout = out; f32 over 16 keys: 1e-5 of each tensor's largest
// magnitude, as elsewhere).
TEST(ErrorTest, ZeroStrideOnSizeOneOutputDimsPasses) {
  Rng rng(3);
  ProblemSpec spec(1, 8, 16, 1, 1, 16, 8);
  spec.sinks = true;
  const OwnedInputs owned = RandomInputs(rng, spec);
  const AttentionInputs in = owned.inputs();
  AttentionOptions opt;
  opt.block_sizes = {16, 16};
  Tensor out(DType::kF32, {1, 8, 1, 8}), lse(DType::kF32, {1, 1, 8});
  Tensor dq(DType::kF32, {1, 8, 1, 16}), dk(DType::kF32, {1, 16, 1, 16});
  Tensor dv(DType::kF32, {1, 16, 1, 8}), dsinks(DType::kF32, {1});
  TensorView o = out.view(), l = lse.view(), gq = dq.view(), gk = dk.view(), gv = dv.view();
  TensorView gs = dsinks.view();
  for (TensorView* t : {&o, &gq, &gk, &gv}) t->stride[0] = t->stride[2] = 0;
  l.stride[0] = l.stride[1] = 0;
  gs.stride[0] = 0;
  ASSERT_NO_THROW(AttentionForward(in, opt, o, l));
  const RefResult fwd = RunReference(owned, opt, nullptr);
  EXPECT_LE(Compare(ToDoubles(o), fwd.fwd.out).Relative(), 1e-5);
  EXPECT_LE(Compare(ToDoubles(l), fwd.fwd.lse).Relative(1.0), 1e-5);
  const Tensor dout = TensorFromDoubles(ToDoubles(o), DType::kF32, {1, 8, 1, 8});
  ASSERT_NO_THROW(AttentionBackward(in, opt, o, l, o, gq, gk, gv, gs));
  const RefResult bwd = RunReference(owned, opt, &dout);
  ApiResult api;
  api.out = ToDoubles(o);
  api.lse = ToDoubles(l);
  api.dq = ToDoubles(gq);
  api.dk = ToDoubles(gk);
  api.dv = ToDoubles(gv);
  api.dsinks = ToDoubles(gs);
  const Errors e = ErrorsOf(api, bwd);
  EXPECT_LE(std::max({e.dq, e.dk, e.dv, e.dsinks}), 1e-5) << e.Describe();
}

// Outputs may be f32 when the inputs are bf16 (and vice versa is refused).
TEST(ErrorTest, Bf16InputsAcceptF32OrBf16Outputs) {
  Call call;
  const OwnedInputs bf = ConvertInputs(call.owned, DType::kBF16);
  call.in = bf.inputs();
  EXPECT_NO_THROW(AttentionForward(call.in, call.opt, call.out, call.lse));
  Tensor out_bf(DType::kBF16, {2, 8, 4, 8});
  EXPECT_NO_THROW(AttentionForward(call.in, call.opt, out_bf.view(), call.lse));
  Tensor out_f16(DType::kF16, {2, 8, 4, 8});
  const std::string msg =
      MessageOf([&] { AttentionForward(call.in, call.opt, out_f16.view(), call.lse); });
  EXPECT_NE(msg.find("out: expected dtype bf16 (the dtype of q) or f32"), std::string::npos) << msg;
}

// Forcing a kernel path through the environment: an unknown name is an Error
// naming the variable (kAuto reads RINGSPLASH_KERNEL).
TEST(ErrorTest, BadKernelEnvironmentIsAnError) {
  Call call;
  ASSERT_EQ(setenv("RINGSPLASH_KERNEL", "sse2", 1), 0);
  const std::string msg = MessageOf([&] { ValidateAttentionInputs(call.in, call.opt); });
  unsetenv("RINGSPLASH_KERNEL");
  EXPECT_NE(msg.find("RINGSPLASH_KERNEL"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sse2"), std::string::npos) << msg;
}

// A path this CPU lacks is refused by name (only testable where one is missing).
// On a CPU without a path's instruction set (here: every set hidden, so the
// test runs the same on any CPU), asking for that path is an Error naming
// kernel_path, the path and what the CPU supports.
TEST(ErrorTest, UnsupportedKernelPathIsAnError) {
  const kernels::ScopedCpuFeaturesForTesting portable_only{kernels::CpuFeatures{}};
  EXPECT_EQ(SupportedKernelPaths(), std::vector<KernelPath>{KernelPath::kPortable});
  for (KernelPath p :
       {KernelPath::kAvx2, KernelPath::kAvx512, KernelPath::kAvx512Bf16, KernelPath::kAmx}) {
    Call call;
    call.opt.kernel_path = p;
    const std::string msg = MessageOf([&] { ValidateAttentionInputs(call.in, call.opt); });
    EXPECT_EQ(msg, std::string("kernel_path: '") + KernelPathName(p) +
                       "' is not supported by this CPU (supported: portable)");
  }
}

// ---- Outputs sharing memory with inputs or other outputs ------------------
//
// The aliasing rule (attention.h, ring.h): no output may share memory with
// an input or with another output; such a call throws, before anything is
// written, an Error naming the output and what it overlaps. Every pair is
// tried on every entry point that takes it: the output's view is moved into
// one buffer with the other argument so that they share their last / first
// few bytes (a partial overlap, not just one start address).

// The argument of `x` named `name`.
TensorView* Arg(Call& x, const std::string& name) {
  const std::pair<const char*, TensorView*> args[] = {{"q", &x.in.q},
                                                      {"k", &x.in.k},
                                                      {"v", &x.in.v},
                                                      {"sinks", &x.in.sinks},
                                                      {"q_segments", &x.in.q_segments},
                                                      {"kv_segments", &x.in.kv_segments},
                                                      {"out", &x.out},
                                                      {"lse", &x.lse},
                                                      {"dout", &x.dout},
                                                      {"dq", &x.dq},
                                                      {"dk", &x.dk},
                                                      {"dv", &x.dv},
                                                      {"dsinks", &x.dsinks}};
  for (const auto& [n, view] : args) {
    if (name == n) return view;
  }
  ADD_FAILURE() << "no argument " << name;
  return nullptr;
}

// Moves `other` (a contiguous view of `x`) to the start of a new buffer,
// its contents kept, and `output` to overlap its last 8 bytes (or half of
// it, if smaller).
void Overlap(Call& x, const std::string& output, const std::string& other) {
  TensorView* o = Arg(x, output);
  TensorView* t = Arg(x, other);
  const auto o_bytes = static_cast<int64_t>(o->numel() * DTypeSize(o->dtype));
  const auto t_bytes = static_cast<int64_t>(t->numel() * DTypeSize(t->dtype));
  const int64_t shared = std::min<int64_t>(8, t_bytes / 2);
  TensorView buf = x.Make(DType::kF32, {(t_bytes + o_bytes) / 4 + 1});
  std::memcpy(buf.data, t->data, static_cast<size_t>(t_bytes));
  t->data = buf.data;
  o->data = static_cast<char*>(buf.data) + (t_bytes - shared);
}

enum class Pass { kForward, kBackward, kRingThreadsOnly };

struct AliasCase {
  std::string output, other;  // the message names `output` first
  Pass pass;
};
void PrintTo(const AliasCase& c, std::ostream* os) { *os << c.output << "_" << c.other; }

std::vector<AliasCase> AliasCases() {
  const std::vector<std::string> inputs = {"q", "k", "v", "sinks", "q_segments", "kv_segments"};
  std::vector<AliasCase> c;
  for (const std::string out : {"out", "lse"}) {
    for (const std::string& in : inputs) c.push_back({out, in, Pass::kForward});
  }
  c.push_back({"lse", "out", Pass::kForward});
  const std::vector<std::string> grads = {"dq", "dk", "dv", "dsinks"};
  for (size_t g = 0; g < grads.size(); ++g) {
    for (const std::string& in : inputs) c.push_back({grads[g], in, Pass::kBackward});
    for (const std::string in : {"out", "lse", "dout"}) {
      c.push_back({grads[g], in, Pass::kBackward});
    }
    for (size_t e = 0; e < g; ++e) c.push_back({grads[g], grads[e], Pass::kBackward});
  }
  // RingAttentionThreads runs both passes in one call: its forward writes
  // out and lse while other ranks may still read dout.
  c.push_back({"out", "dout", Pass::kRingThreadsOnly});
  c.push_back({"lse", "dout", Pass::kRingThreadsOnly});
  return c;
}

// What a one-rank ring call on the threads backend threw ("NO ERROR" if
// nothing). The failing rank aborts its communicator, so RunThreadRanks
// throws too: that second report is not the one checked.
std::string RankMessage(const std::function<void(Communicator&)>& fn) {
  std::string msg = "NO ERROR";
  try {
    RunThreadRanks(1, CommOptions{},
                   [&](Communicator& comm) { msg = MessageOf([&] { fn(comm); }); });
  } catch (const Error&) {
  }
  return msg;
}

class AliasTest : public ::testing::TestWithParam<AliasCase> {};

TEST_P(AliasTest, NamesBothArguments) {
  const AliasCase& ac = GetParam();
  Call x;
  Overlap(x, ac.output, ac.other);
  RingRun run;
  run.num_ranks = 2;
  run.options.attention = x.opt;
  std::vector<std::pair<std::string, std::string>> messages;
  if (ac.pass == Pass::kForward) {
    messages.emplace_back("AttentionForward",
                          MessageOf([&] { AttentionForward(x.in, x.opt, x.out, x.lse); }));
    messages.emplace_back("RingAttentionForward", RankMessage([&](Communicator& comm) {
                            RingAttentionForward(comm, x.in, run.options, x.out, x.lse);
                          }));
    messages.emplace_back("RingAttentionThreads forward",
                          MessageOf([&] { RingAttentionThreads(run, x.in, x.out, x.lse); }));
  }
  if (ac.pass == Pass::kBackward) {
    messages.emplace_back("AttentionBackward", MessageOf([&] {
                            AttentionBackward(x.in, x.opt, x.out, x.lse, x.dout, x.dq, x.dk, x.dv,
                                              x.dsinks);
                          }));
    messages.emplace_back("RingAttentionBackward", RankMessage([&](Communicator& comm) {
                            RingAttentionBackward(comm, x.in, run.options, x.out, x.lse, x.dout,
                                                  x.dq, x.dk, x.dv, x.dsinks);
                          }));
  }
  messages.emplace_back("RingAttentionThreads", MessageOf([&] {
                          RingAttentionThreads(run, x.in, x.out, x.lse, x.dout, x.dq, x.dk, x.dv,
                                               x.dsinks);
                        }));
  const std::string start = ac.output +
                            ": expected memory shared with no input or other output, got a view "
                            "overlapping " +
                            ac.other + " (" + ac.output + " [";
  for (const auto& [entry, msg] : messages) {
    EXPECT_EQ(msg.rfind(start, 0), 0u) << entry << ": " << msg;
  }
  // The rule is checked before anything is written: the other argument
  // still holds what a fresh call's does.
  Call fresh;
  EXPECT_EQ(ToDoubles(*Arg(x, ac.other)), ToDoubles(*Arg(fresh, ac.other)));
}

INSTANTIATE_TEST_SUITE_P(Pairs, AliasTest, ::testing::ValuesIn(AliasCases()), [](const auto& info) {
  return info.param.output + "_" + info.param.other;
});

// ViewsOverlap decides on bytes, exactly: partial elements, interleaved and
// permuted views, mixed dtypes.
TEST(ViewsOverlapTest, SharedBytesOnly) {
  Tensor buf(DType::kF32, {96});
  char* base = static_cast<char*>(buf.data());
  auto view = [base](int64_t byte, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride) {
    TensorView t = TensorView::Contiguous(base + byte, dtype, shape);
    std::copy(stride.begin(), stride.end(), t.stride.begin());
    return t;
  };
  const TensorView four = view(0, DType::kF32, {4}, {1});  // bytes [0, 16)
  EXPECT_TRUE(kernels::ViewsOverlap(four, four));
  EXPECT_FALSE(kernels::ViewsOverlap(four, view(16, DType::kF32, {4}, {1})));  // adjacent
  EXPECT_TRUE(kernels::ViewsOverlap(four, view(14, DType::kBF16, {4}, {1})));  // 2 bytes
  EXPECT_FALSE(kernels::ViewsOverlap(view(16, DType::kBF16, {4}, {1}), four));
  EXPECT_FALSE(kernels::ViewsOverlap(four, TensorView()));
  const TensorView backwards = view(12, DType::kF32, {4}, {-1});  // bytes [0, 16) again
  EXPECT_TRUE(kernels::ViewsOverlap(backwards, four));
  EXPECT_FALSE(kernels::ViewsOverlap(backwards, view(16, DType::kF32, {4}, {1})));
  // Even and odd elements of one buffer: interleaved, disjoint.
  const TensorView even = view(0, DType::kF32, {2, 8}, {16, 2});
  EXPECT_FALSE(kernels::ViewsOverlap(even, view(4, DType::kF32, {2, 8}, {16, 2})));
  EXPECT_TRUE(kernels::ViewsOverlap(even, view(8, DType::kF32, {2, 8}, {16, 2})));
  EXPECT_TRUE(kernels::ViewsOverlap(even, view(4, DType::kF32, {2, 8}, {16, 1})));
  // q, k, v of a packed [B=2, S=2, 3, H=2, D=4] buffer (96 floats); q's
  // memory seen as [B, H, S, D] overlaps q.
  auto packed = [&](int which) {
    return view(which * 8 * 4, DType::kF32, {2, 2, 2, 4}, {48, 24, 4, 1});
  };
  EXPECT_FALSE(kernels::ViewsOverlap(packed(0), packed(1)));
  EXPECT_FALSE(kernels::ViewsOverlap(packed(2), packed(1)));
  EXPECT_TRUE(kernels::ViewsOverlap(packed(1), packed(1)));
  EXPECT_TRUE(kernels::ViewsOverlap(packed(0), view(0, DType::kF32, {2, 2, 2, 4}, {48, 4, 24, 1})));
}

// Outputs and inputs interleaved in one buffer, sharing no element, pass and
// give bitwise what separate buffers give: the forward's out beside q in one
// [B, S, 2, H, D] buffer; the backward's dq, dk, dv as slices of one packed
// [B, S, 3, H, D] dqkv (and q, k, v read from a packed qkv); on the single
// device and the threads ring.
TEST(AliasTest, InterleavedButDisjointViewsPass) {
  constexpr int64_t kB = 2, kS = 32, kH = 2, kD = 16;
  Rng rng(9);
  // Packed buffers [B, S, n, H, D], flat (views have at most 4 dims).
  Tensor qkv = RandomTensor(rng, DType::kF32, {kB * kS * 3 * kH * kD});
  const Tensor dout = RandomTensor(rng, DType::kF32, {kB, kS, kH, kD});
  auto slice = [](const Tensor& t, int64_t which) {  // the [B, S, H, D] view `which`
    const int64_t n = t.numel() / (kB * kS * kH * kD);
    TensorView s = TensorView::Contiguous(static_cast<float*>(t.view().data) + which * kH * kD,
                                          DType::kF32, {kB, kS, kH, kD});
    s.stride = {kS * n * kH * kD, n * kH * kD, kD, 1};
    return s;
  };
  AttentionInputs in;
  in.q = slice(qkv, 0);
  in.k = slice(qkv, 1);
  in.v = slice(qkv, 2);
  AttentionOptions opt;
  opt.mask = Mask::Causal();
  opt.block_sizes = {16, 16};
  struct Result {
    std::vector<double> out, lse, dq, dk, dv;
  };
  auto run = [&](bool packed, bool ring) {
    Tensor q_out(DType::kF32, {kB * kS * 2 * kH * kD}), dqkv(DType::kF32, {kB * kS * 3 * kH * kD});
    Tensor out_t(DType::kF32, {kB, kS, kH, kD}), lse(DType::kF32, {kB, kH, kS});
    Tensor dq_t(DType::kF32, {kB, kS, kH, kD}), dk_t(DType::kF32, {kB, kS, kH, kD});
    Tensor dv_t(DType::kF32, {kB, kS, kH, kD});
    AttentionInputs call = in;
    TensorView out = out_t.view(), dq = dq_t.view(), dk = dk_t.view(), dv = dv_t.view();
    if (packed) {
      CopyConvert(in.q, slice(q_out, 0));
      call.q = slice(q_out, 0);
      out = slice(q_out, 1);
      dq = slice(dqkv, 0);
      dk = slice(dqkv, 1);
      dv = slice(dqkv, 2);
    }
    if (ring) {
      RingRun r;
      r.num_ranks = 2;
      r.options.attention = opt;
      RingAttentionThreads(r, call, out, lse.view(), dout.view(), dq, dk, dv);
    } else {
      AttentionForward(call, opt, out, lse.view());
      AttentionBackward(call, opt, out, lse.view(), dout.view(), dq, dk, dv, TensorView());
    }
    return Result{ToDoubles(out), ToDoubles(lse.view()), ToDoubles(dq), ToDoubles(dk),
                  ToDoubles(dv)};
  };
  for (bool ring : {false, true}) {
    SCOPED_TRACE(ring ? "ring of 2" : "single device");
    Result separate, packed;
    ASSERT_NO_THROW(separate = run(false, ring));
    ASSERT_NO_THROW(packed = run(true, ring));
    EXPECT_EQ(packed.out, separate.out);
    EXPECT_EQ(packed.lse, separate.lse);
    EXPECT_EQ(packed.dq, separate.dq);
    EXPECT_EQ(packed.dk, separate.dk);
    EXPECT_EQ(packed.dv, separate.dv);
  }
}

}  // namespace
}  // namespace ringsplash::testing

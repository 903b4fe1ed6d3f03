#include "python/src/ffi_handlers.h"

#ifdef RINGSPLASH_HAVE_XLA_FFI

#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "python/src/mask_registry.h"
#include "ringsplash/ringsplash.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ringsplash::python {
namespace {

DType DTypeOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F16:
      return DType::kF16;
    case ffi::DataType::S32:
      return DType::kI32;
    default:
      Fail("unsupported XLA element type ", static_cast<int>(t),
           "; expected float32, bfloat16, float16 or int32");
  }
}

// A row-major view of an XLA buffer; absent (empty view) when it has no elements.
template <typename Buffer>
TensorView View(const Buffer& b, DType dtype) {
  const auto dims = b.dimensions();
  if (b.element_count() == 0) return TensorView{};
  std::vector<int64_t> shape(dims.begin(), dims.end());
  return TensorView::Contiguous(b.untyped_data(), dtype, shape);
}

TensorView AnyView(const ffi::AnyBuffer& b) { return View(b, DTypeOf(b.element_type())); }

std::vector<int64_t> Positions(const ffi::Buffer<ffi::S32>& p) {
  const int32_t* data = p.typed_data();
  return std::vector<int64_t>(data, data + p.element_count());
}

struct Attrs {
  int64_t mask_id;
  float scale;
  float softcap;
  int64_t block_q;
  int64_t block_kv;
  int64_t num_threads;
};

AttentionOptions Options(const Attrs& a) {
  AttentionOptions opt;
  opt.mask = LookupMask(a.mask_id);
  opt.scale = a.scale;
  if (a.softcap > 0) opt.softcap = a.softcap;
  opt.block_sizes = BlockSizes{a.block_q, a.block_kv};
  opt.num_threads = static_cast<int>(a.num_threads);
  return opt;
}

AttentionInputs Inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::Buffer<ffi::F32>& sinks, const ffi::Buffer<ffi::S32>& q_segments,
                       const ffi::Buffer<ffi::S32>& kv_segments,
                       const ffi::Buffer<ffi::S32>& q_positions,
                       const ffi::Buffer<ffi::S32>& kv_positions) {
  AttentionInputs in;
  in.q = AnyView(q);
  in.k = AnyView(k);
  in.v = AnyView(v);
  in.sinks = View(sinks, DType::kF32);
  in.q_segments = View(q_segments, DType::kI32);
  in.kv_segments = View(kv_segments, DType::kI32);
  in.q_positions = Positions(q_positions);
  in.kv_positions = Positions(kv_positions);
  return in;
}

// Runs `body`, turning exceptions into FFI errors (nothing may unwind into XLA).
template <typename Body>
ffi::Error Guarded(Body body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const Error& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("ringsplash: ") + e.what());
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "ringsplash: out of memory");
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("ringsplash: ") + e.what());
  }
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_segments,
                       ffi::Buffer<ffi::S32> kv_segments, ffi::Buffer<ffi::S32> q_positions,
                       ffi::Buffer<ffi::S32> kv_positions, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse, int64_t mask_id, float scale,
                       float softcap, int64_t block_q, int64_t block_kv, int64_t num_threads) {
  return Guarded([&] {
    const Attrs attrs{mask_id, scale, softcap, block_q, block_kv, num_threads};
    AttentionForward(Inputs(q, k, v, sinks, q_segments, kv_segments, q_positions, kv_positions),
                     Options(attrs), AnyView(*out), View(*lse, DType::kF32));
  });
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_segments,
                        ffi::Buffer<ffi::S32> kv_segments, ffi::Buffer<ffi::S32> q_positions,
                        ffi::Buffer<ffi::S32> kv_positions, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dsinks,
                        int64_t mask_id, float scale, float softcap, int64_t block_q,
                        int64_t block_kv, int64_t num_threads) {
  return Guarded([&] {
    const Attrs attrs{mask_id, scale, softcap, block_q, block_kv, num_threads};
    AttentionBackward(Inputs(q, k, v, sinks, q_segments, kv_segments, q_positions, kv_positions),
                      Options(attrs), AnyView(out), View(lse, DType::kF32), AnyView(dout),
                      AnyView(*dq), AnyView(*dk), AnyView(*dv), View(*dsinks, DType::kF32));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RingsplashForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_segments
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_segments
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_positions
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<int64_t>("mask_id")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RingsplashBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_segments
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_segments
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_positions
                                  .Arg<ffi::AnyBuffer>()         // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::AnyBuffer>()         // dout
                                  .Ret<ffi::AnyBuffer>()         // dq
                                  .Ret<ffi::AnyBuffer>()         // dk
                                  .Ret<ffi::AnyBuffer>()         // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dsinks
                                  .Attr<int64_t>("mask_id")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_kv")
                                  .Attr<int64_t>("num_threads"));

nanobind::dict FfiTargets() {
  nanobind::dict targets;
  targets["ringsplash_forward"] = nanobind::capsule(reinterpret_cast<void*>(RingsplashForward));
  targets["ringsplash_backward"] = nanobind::capsule(reinterpret_cast<void*>(RingsplashBackward));
  return targets;
}

}  // namespace ringsplash::python

#else  // !RINGSPLASH_HAVE_XLA_FFI

namespace ringsplash::python {
nanobind::dict FfiTargets() { return nanobind::dict(); }
}  // namespace ringsplash::python

#endif

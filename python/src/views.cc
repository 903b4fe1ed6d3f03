#include "python/src/views.h"

#include "ringsplash/error.h"

namespace ringsplash::python {
namespace {

DType DTypeOf(nb::dlpack::dtype t, const char* what) {
  if (t == nb::dtype<float>()) return DType::kF32;
  if (t == nb::dtype<uint16_t>()) return DType::kBF16;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 &&
      t.lanes == 1) {
    return DType::kBF16;  // a DLPack bfloat16 (PyTorch's torch.bfloat16)
  }
  if (t == nb::dtype<int32_t>()) return DType::kI32;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16 &&
      t.lanes == 1) {
    return DType::kF16;
  }
  Fail(what, ": unsupported element type (DLPack code ", static_cast<int>(t.code), ", ",
       static_cast<int>(t.bits), " bits); expected float32, bfloat16, float16 or int32");
}

template <typename Array>
TensorView View(const Array& a, const char* what) {
  Check(a.ndim() <= static_cast<size_t>(kMaxDims), what, ": expected at most ", kMaxDims,
        " dims, got ", a.ndim());
  TensorView t;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = DTypeOf(a.dtype(), what);
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.stride[i] = a.stride(i);
  }
  // A NumPy array with no elements may have a null data pointer; the library
  // reads a null pointer as "not given", so give it a harmless address.
  static char empty;
  if (t.data == nullptr && t.numel() == 0) t.data = &empty;
  return t;
}

}  // namespace

TensorView ViewOf(const InArray& a, const char* what) { return View(a, what); }
TensorView ViewOf(const OutArray& a, const char* what) { return View(a, what); }

TensorView ViewOf(const std::optional<InArray>& a, const char* what) {
  return a ? View(*a, what) : TensorView{};
}

std::vector<int64_t> PositionsOf(const std::optional<Positions>& p) {
  if (!p) return {};
  std::vector<int64_t> v(p->shape(0));
  for (size_t i = 0; i < v.size(); ++i) v[i] = (*p)(i);
  return v;
}

}  // namespace ringsplash::python

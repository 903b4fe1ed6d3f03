// Tensor views, dtype helpers and the owning Tensor.
#include "ringsplash/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include "ringsplash/error.h"
#include "src/core/huge_pages.h"

namespace ringsplash {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kBool:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kI32:
      return "i32";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

DType ParseDType(const std::string& text, const char* what) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kBool}) {
    if (text == DTypeName(d)) return d;
  }
  Fail(what, ": expected one of f32, bf16, f16, i32, bool; got '", text, "'");
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: value = man * 2^-24
      float f = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                        // subnormal or zero in f16
    float a;
    std::memcpy(&a, &abs, 4);
    // Round to nearest even multiple of 2^-24.
    const float scaled = a * 16777216.0f;  // exact: power of two
    const float r = std::nearbyint(scaled);
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: rebias exponent, round mantissa to 10 bits (nearest even).
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((m - 0x38000000u) >> 13);
}

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return Contiguous(data, dtype, std::vector<int64_t>(shape));
}

TensorView TensorView::Contiguous(void* data, DType dtype, const std::vector<int64_t>& shape) {
  Check(shape.size() <= kMaxDims, "tensor: at most ", kMaxDims, " dims supported, got ",
        shape.size());
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int64_t s = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = s;
    s *= shape[i];
  }
  return t;
}

namespace {

void CheckSize(const char* factory, const char* name, int64_t value) {
  Check(value >= 0, "TensorView::", factory, ": ", name, ": expected a size >= 0, got ", value);
}

}  // namespace

TensorView TensorView::Bshd(void* data, DType dtype, int64_t b, int64_t s, int64_t h, int64_t d) {
  CheckSize("Bshd", "B", b);
  CheckSize("Bshd", "S", s);
  CheckSize("Bshd", "H", h);
  CheckSize("Bshd", "D", d);
  return Contiguous(data, dtype, {b, s, h, d});
}

TensorView TensorView::Bhsd(void* data, DType dtype, int64_t b, int64_t h, int64_t s, int64_t d) {
  CheckSize("Bhsd", "B", b);
  CheckSize("Bhsd", "H", h);
  CheckSize("Bhsd", "S", s);
  CheckSize("Bhsd", "D", d);
  return Contiguous(data, dtype, {b, h, s, d}).Transposed(1, 2);
}

TensorView TensorView::KvCache(void* data, DType dtype, int64_t b, int64_t max_len, int64_t hkv,
                               int64_t d, int64_t len) {
  CheckSize("KvCache", "B", b);
  CheckSize("KvCache", "max_len", max_len);
  CheckSize("KvCache", "Hkv", hkv);
  CheckSize("KvCache", "D", d);
  Check(len >= 0 && len <= max_len, "TensorView::KvCache: len: expected 0 to max_len = ", max_len,
        " valid rows, got ", len);
  TensorView t = Contiguous(data, dtype, {b, max_len, hkv, d});
  t.shape[1] = len;
  return t;
}

TensorView TensorView::Narrowed(int dim, int64_t start, int64_t length) const {
  Check(dim >= 0 && dim < ndim, "Narrowed: dim: expected 0 to ", ndim - 1, " for a ", ndim,
        "-d view, got ", dim);
  Check(start >= 0 && start <= shape[dim], "Narrowed: start: expected 0 to ", shape[dim],
        " (the size of dim ", dim, " of ", *this, "), got ", start);
  Check(length >= 0 && length <= shape[dim] - start, "Narrowed: length: expected 0 to ",
        shape[dim] - start, " (dim ", dim, " of ", *this, " from ", start, "), got ", length);
  TensorView t = *this;
  if (data != nullptr) {  // an undefined view stays undefined (no arithmetic on null)
    t.data =
        static_cast<char*>(data) + start * stride[dim] * static_cast<int64_t>(DTypeSize(dtype));
  }
  t.shape[dim] = length;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

TensorView TensorView::Transposed(int a, int b) const {
  Check(a >= 0 && a < ndim && b >= 0 && b < ndim, "Transposed: dims ", a, ", ", b,
        " out of range for a ", ndim, "-d view");
  TensorView t = *this;
  std::swap(t.shape[a], t.shape[b]);
  std::swap(t.stride[a], t.stride[b]);
  return t;
}

std::string TensorView::Describe() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << DTypeName(dtype);
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const TensorView& t) { return os << t.Describe(); }

Tensor::Tensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t d : shape_) Check(d >= 0, "Tensor: negative dimension ", d);
  const size_t n = bytes();
  // Large tensors on transparent huge pages (core/huge_pages.h): the
  // kernels read their rows far apart. Mapped memory comes zero filled.
  if (Mapped(n)) {
    data_ = MapHugePages(n);
    if (data_ == nullptr) Fail("Tensor: out of memory allocating ", n, " bytes");
    return;
  }
  const size_t size = std::max<size_t>(64, (n + 63) / 64 * 64);
  data_ = std::aligned_alloc(64, size);
  if (data_ == nullptr) Fail("Tensor: out of memory allocating ", n, " bytes");
  std::memset(data_, 0, size);
}

bool Tensor::Mapped(size_t bytes) { return kMapHugePages && bytes >= kHugeMinBytes; }

void Tensor::Release() noexcept {
  if (data_ == nullptr) return;
  if (Mapped(bytes())) {
    UnmapHugePages(data_, bytes());
  } else {
    std::free(data_);
  }
  data_ = nullptr;
}

Tensor::Tensor(Tensor&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), dtype_(o.dtype_), shape_(std::move(o.shape_)) {}

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = std::exchange(o.data_, nullptr);
    dtype_ = o.dtype_;
    shape_ = std::move(o.shape_);
  }
  return *this;
}

Tensor::~Tensor() { Release(); }

TensorView Tensor::view() const { return TensorView::Contiguous(data_, dtype_, shape_); }

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

float LoadAsF32(const TensorView& t, int64_t offset) {
  switch (t.dtype) {
    case DType::kF32:
      return static_cast<const float*>(t.data)[offset];
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(t.data)[offset]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(t.data)[offset]);
    case DType::kI32:
      return static_cast<float>(static_cast<const int32_t*>(t.data)[offset]);
    case DType::kBool:
      return static_cast<const uint8_t*>(t.data)[offset] ? 1.0f : 0.0f;
  }
  return 0.0f;
}

void StoreFromF32(const TensorView& t, int64_t offset, float value) {
  switch (t.dtype) {
    case DType::kF32:
      static_cast<float*>(t.data)[offset] = value;
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(t.data)[offset] = F32ToBF16(value);
      return;
    case DType::kF16:
      static_cast<uint16_t*>(t.data)[offset] = F32ToF16(value);
      return;
    case DType::kI32:
      static_cast<int32_t*>(t.data)[offset] = static_cast<int32_t>(value);
      return;
    case DType::kBool:
      static_cast<uint8_t*>(t.data)[offset] = value != 0.0f;
      return;
  }
}

namespace {

// Converts one row of `n` f32 values into an f16/bf16 row (strides in
// elements); returns the index of the first finite value that rounded to
// +-inf, or -1. The exponent test on the result is one AND per element; the
// source is examined only on the rare path.
template <uint16_t (*kConvert)(float), uint16_t kExpMask>
int64_t ConvertRow16(const TensorView& src, int64_t so, int64_t ss, uint16_t* d, int64_t ds,
                     int64_t n) {
  int64_t first = -1;
  for (int64_t e = 0; e < n; ++e) {
    const float x = LoadAsF32(src, so + e * ss);
    const uint16_t h = kConvert(x);
    d[e * ds] = h;
    if ((h & kExpMask) == kExpMask && first < 0 && std::isfinite(x)) first = e;
  }
  return first;
}

// ConvertRow16 for unit-stride f32 to bf16, the common case (gradients and
// outputs of bf16 calls): no branch or dtype dispatch per element, so the
// loop vectorises (~3 ns per element before); the first overflow is looked
// for only if there is one.
int64_t ConvertRowF32ToBf16(const float* s, uint16_t* d, int64_t n) {
  if (!F32ToBF16Row(s, d, n)) return -1;
  for (int64_t e = 0; e < n; ++e) {
    if (Bf16Overflowed(s[e], d[e])) return e;
  }
  return -1;
}

}  // namespace

int64_t CopyConvertFindOverflow(const TensorView& src, const TensorView& dst) {
  Check(src.ndim == dst.ndim, "CopyConvert: source has ", src.ndim, " dims, destination ",
        dst.ndim);
  for (int i = 0; i < src.ndim; ++i) {
    Check(src.shape[i] == dst.shape[i], "CopyConvert: shapes differ: ", src, " vs ", dst);
  }
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1};
  std::array<int64_t, kMaxDims> ss{}, ds{};
  for (int i = 0; i < src.ndim; ++i) {
    shape[kMaxDims - src.ndim + i] = src.shape[i];
    ss[kMaxDims - src.ndim + i] = src.stride[i];
    ds[kMaxDims - src.ndim + i] = dst.stride[i];
  }
  const bool same_f32 = src.dtype == DType::kF32 && dst.dtype == DType::kF32;
  int64_t first = -1;
  int64_t row = 0;  // row-major number of the row (a, b, c)
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c, ++row) {
        const int64_t so = a * ss[0] + b * ss[1] + c * ss[2];
        const int64_t d0 = a * ds[0] + b * ds[1] + c * ds[2];
        int64_t bad = -1;
        if (same_f32) {
          const float* s = static_cast<const float*>(src.data) + so;
          float* d = static_cast<float*>(dst.data) + d0;
          for (int64_t e = 0; e < shape[3]; ++e) d[e * ds[3]] = s[e * ss[3]];
        } else if (dst.dtype == DType::kF16) {
          bad = ConvertRow16<F32ToF16, 0x7c00u>(
              src, so, ss[3], static_cast<uint16_t*>(dst.data) + d0, ds[3], shape[3]);
        } else if (dst.dtype == DType::kBF16 && src.dtype == DType::kF32 && ss[3] == 1 &&
                   ds[3] == 1) {
          bad = ConvertRowF32ToBf16(static_cast<const float*>(src.data) + so,
                                    static_cast<uint16_t*>(dst.data) + d0, shape[3]);
        } else if (dst.dtype == DType::kBF16) {
          bad = ConvertRow16<F32ToBF16, 0x7f80u>(
              src, so, ss[3], static_cast<uint16_t*>(dst.data) + d0, ds[3], shape[3]);
        } else {  // f32 from f16/bf16 widens exactly; i32/bool are not float-like
          for (int64_t e = 0; e < shape[3]; ++e)
            StoreFromF32(dst, d0 + e * ds[3], LoadAsF32(src, so + e * ss[3]));
        }
        if (bad >= 0 && first < 0) first = row * shape[3] + bad;
      }
  return first;
}

void CopyConvert(const TensorView& src, const TensorView& dst) {
  CopyConvertFindOverflow(src, dst);
}

void CopyConvert(const TensorView& src, const TensorView& dst, const char* what) {
  int64_t linear = CopyConvertFindOverflow(src, dst);
  if (linear < 0) return;
  // Unravel over src's shape for the message, and re-read the source value.
  std::array<int64_t, kMaxDims> index{};
  for (int i = src.ndim - 1; i >= 0; --i) {
    index[i] = linear % src.shape[i];
    linear /= src.shape[i];
  }
  std::ostringstream at;
  at << '[';
  for (int i = 0; i < src.ndim; ++i) at << (i ? ", " : "") << index[i];
  at << ']';
  const float value = LoadAsF32(src, src.Offset(index[0], index[1], index[2], index[3]));
  Fail(what, ": value ", value, " at ", at.str(), " does not fit in ", DTypeName(dst.dtype),
       " (out of range; largest finite ", LargestFinite(dst.dtype), "); pass an f32 output");
}

float LargestFinite(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return std::numeric_limits<float>::max();
    case DType::kBF16:
      return BF16ToF32(0x7f7fu);
    case DType::kF16:
      return F16ToF32(0x7bffu);
    case DType::kI32:
      return static_cast<float>(std::numeric_limits<int32_t>::max());
    case DType::kBool:
      return 1.0f;
  }
  return 0.0f;
}

}  // namespace ringsplash

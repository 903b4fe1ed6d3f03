// Non-owning strided tensor views and a small owning tensor.
//
// Attention tensors are 4-D ([B, S, H, D] in model layout). A view carries
// per-dimension strides in elements, so memory laid out as [B, H, S, D] is
// passed as a [B, S, H, D] view with permuted strides — no copy. The factories
// below build the views of the common layouts (TensorView::Bshd, Bhsd, a K/V
// cache's first rows: KvCache, and any row range: Narrowed), so shape and
// stride arrays need no editing by hand.
//
// Strides the API accepts (every entry point: attention.h, ring.h):
//  - Strides are in elements, one per dim, and must be >= 0 (a negative stride
//    is an Error naming the argument). Sizes must be > 0 (views of size 0,
//    which the factories allow, are refused there). The stride of a dim of
//    size 1 is never used.
//  - Inputs (q, k, v, sinks, segment ids; out, lse and dout where the backward
//    reads them) may have any such strides, each dim independently:
//    permuted ([B, H, S, D] memory), padded (rows of a larger buffer: a K/V
//    cache with room for more tokens), 0 to repeat one slice (e.g. k/v shared
//    by every batch entry), even overlapping. Nothing is written through them.
//    Rows of unit stride (stride 1 on the last dim) are read in place; other
//    rows are gathered per tile first, which is slower.
//  - Outputs (out, lse, dq, dk, dv, dsinks) are written element by element in
//    parallel, so no two indices may reach the same element. The API refuses
//    the certain cases (stride 0 on a dim of size > 1, two dims of size > 1
//    with equal strides); other self-overlapping strides are not detected and
//    leave the output undefined. Views whose dims nest never overlap: sorted
//    by stride, each dim's stride is at least the extent spanned by the dims
//    before it — true of every permutation of a C-order buffer (Bshd, Bhsd)
//    and of every row range of one (KvCache, Narrowed).
//  - Whether an output may share memory with an input is each entry point's
//    rule, stated with it (attention.h, ring.h).
#ifndef RINGSPLASH_TENSOR_H_
#define RINGSPLASH_TENSOR_H_

#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iosfwd>
#include <string>
#include <vector>

namespace ringsplash {

enum class DType : uint8_t { kF32, kBF16, kF16, kI32, kBool };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "f32", "bf16", "f16", "i32", "bool".
const char* DTypeName(DType dtype);
// Parses a DTypeName; throws Error naming `what` for anything else.
DType ParseDType(const std::string& text, const char* what = "dtype");

// bf16 <-> f32: round-to-nearest-even, NaN stays NaN (made quiet). Written
// as a select, not a branch, so that loops over it vectorise.
inline uint16_t F32ToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}
// Whether h = F32ToBF16(f) overflowed: f is finite and h is an infinity
// (also a select, for vectorised loops).
inline bool Bf16Overflowed(float f, uint16_t h) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<bool>(static_cast<uint32_t>((u & 0x7fffffffu) < 0x7f800000u) &
                           static_cast<uint32_t>((h & 0x7fffu) == 0x7f80u));
}
// dst[0, n) = F32ToBF16(src[0, n)) (no overlap); whether a value overflowed
// (Bf16Overflowed). One loop without branches: it vectorises.
inline bool F32ToBF16Row(const float* src, uint16_t* dst, int64_t n) {
  uint32_t over = 0;
  for (int64_t e = 0; e < n; ++e) {
    const uint16_t h = F32ToBF16(src[e]);
    dst[e] = h;
    over |= static_cast<uint32_t>(Bf16Overflowed(src[e], h));
  }
  return over != 0;
}
inline float BF16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// IEEE half <-> f32 (round-to-nearest-even; overflow goes to +-inf).
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

constexpr int kMaxDims = 4;

// A view of `ndim` dimensions; shape[i] and stride[i] (in elements) for
// i < ndim. Does not own `data`. Inputs are never written through a view the
// API documents as an input.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  // Row-major (C order) view of `shape`.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
  static TensorView Contiguous(void* data, DType dtype, const std::vector<int64_t>& shape);

  // Views in model layout [B, S, H, D] of the buffers attention meets. Sizes
  // are given in the buffer's own order and must be >= 0 (else an Error
  // naming the size); `data` points at element [0, 0, 0, 0].
  //
  // A C-order [B, S, H, D] buffer (the model layout itself): strides
  // {S*H*D, H*D, D, 1}, as Contiguous.
  static TensorView Bshd(void* data, DType dtype, int64_t b, int64_t s, int64_t h, int64_t d);
  // A C-order [B, H, S, D] buffer (each head's rows together, as PyTorch's
  // scaled_dot_product_attention and most K/V caches hold them), viewed as
  // [B, S, H, D]: strides {H*S*D, D, S*D, 1}. No copy.
  static TensorView Bhsd(void* data, DType dtype, int64_t b, int64_t h, int64_t s, int64_t d);
  // The first `len` rows of a K/V cache allocated as a C-order
  // [B, max_len, Hkv, D] buffer: a [B, len, Hkv, D] view with the cache's
  // strides {max_len*Hkv*D, Hkv*D, D, 1}; 0 <= len <= max_len (else an Error
  // naming len). Rows from len on are never read through it. A cache laid out
  // [B, Hkv, max_len, D] is Bhsd(data, dtype, B, Hkv, max_len, D).Narrowed(1, 0, len).
  static TensorView KvCache(void* data, DType dtype, int64_t b, int64_t max_len, int64_t hkv,
                            int64_t d, int64_t len);

  // Indices [start, start + length) of dim `dim` (torch's narrow): the same
  // strides, `data` moved to index `start`, shape[dim] = length. E.g. the
  // query row of the token at position p: q.Narrowed(1, p, 1). Throws Error
  // unless 0 <= dim < ndim and 0 <= start <= start + length <= shape[dim].
  TensorView Narrowed(int dim, int64_t start, int64_t length) const;

  bool defined() const { return data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;
  // Swaps dims a and b (strides follow), e.g. [B,H,S,D] -> [B,S,H,D].
  TensorView Transposed(int a, int b) const;
  // "[2, 128, 8, 64] bf16" for messages. A view streams as its description
  // (operator<< below), so Check(cond, "got ", view) formats it only when
  // the check fails rather than on every call.
  std::string Describe() const;
  // Element offset of a 4-D index (unused trailing indices are 0).
  int64_t Offset(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }
};

// Streams t.Describe().
std::ostream& operator<<(std::ostream& os, const TensorView& t);

// Owning, C-order tensor, zero filled: 64-byte aligned; from 4 MiB on,
// mapped for it, 2 MiB aligned and (Linux) advised onto transparent huge
// pages (not under AddressSanitizer), because the kernels read one head's
// rows far apart (one 4 KiB page per K/V row and head otherwise). Used by
// the CLI, tests and the ring's scratch buffers. Arrays from other
// allocators (NumPy, PyTorch) get the pages their allocator gives; see
// docs/perf/DESIGN_MEASUREMENTS.md: huge pages for tensors.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape);  // zero-filled
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&&) noexcept;
  Tensor& operator=(Tensor&&) noexcept;
  ~Tensor();

  TensorView view() const;
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }

 private:
  // Whether a tensor of `bytes` is mapped (core/huge_pages.h) rather than
  // on the C heap: a function of the size, so the destructor knows which
  // without storing it.
  static bool Mapped(size_t bytes);
  void Release() noexcept;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
};

// Reads element `offset` of a float-like view (f32/bf16/f16) as f32.
float LoadAsF32(const TensorView& t, int64_t offset);
// Writes f32 `value` into element `offset`, rounding to the view's dtype.
void StoreFromF32(const TensorView& t, int64_t offset, float value);
// Copies/converts src into dst elementwise (same shape, any strides, float-like dtypes).
// Unchecked: a finite value beyond the range of an f16/bf16 dst becomes +-inf.
void CopyConvert(const TensorView& src, const TensorView& dst);
// As CopyConvert, but a finite src value that is not finite in dst (beyond the
// range of an f16/bf16 dst) throws Error naming `what`:
//   "dv: value 128000 at [0, 0, 0, 3] does not fit in f16 (out of range; largest
//   finite 65504); pass an f32 output".
// NaN and +-inf in src are copied as they are (they are the caller's, not a
// rounding artefact). dst may be partly written when it throws.
void CopyConvert(const TensorView& src, const TensorView& dst, const char* what);
// The primitive under the checked CopyConvert: converts every element like
// CopyConvert and returns the row-major number (over src's shape) of the first
// finite src value that became non-finite in dst, or -1 if there is none.
int64_t CopyConvertFindOverflow(const TensorView& src, const TensorView& dst);
// Largest finite value of a float-like dtype (65504 for f16).
float LargestFinite(DType dtype);

}  // namespace ringsplash

#endif  // RINGSPLASH_TENSOR_H_

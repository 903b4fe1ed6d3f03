// Packing of strided input tiles into the micro-kernels' tile formats
// (micro.h), converting any float dtype (f32, bf16, f16) on the way.
//
// A "slab" is rows [r0, r0 + nr) of head `head` of batch `b` of a 4-D view
// [B, S, Heads, C]; element (r, c) is t[b, r0 + r, head, c] for c < nc.
// Every packer zero-fills the padding it is asked for, so padded lanes never
// carry garbage (or NaN) into a product.
#ifndef RINGSPLASH_KERNELS_TILING_PACK_H_
#define RINGSPLASH_KERNELS_TILING_PACK_H_

#include <cstddef>
#include <cstdint>
#include <new>

#include "ringsplash/tensor.h"
#include "src/core/huge_pages.h"

namespace ringsplash::kernels {

struct Slab {
  const TensorView* t = nullptr;
  int64_t b = 0, head = 0, r0 = 0, nr = 0, nc = 0;
};

// f32 row-major: dst[r * ld + c] for r < nr_pad, c < ld; zero outside (nr, nc).
void PackRowsF32(const Slab& s, float* dst, int64_t ld, int64_t nr_pad);
// f32 transposed: dst[c * ld + r] for c < nc, r < ld; zero for r >= nr.
void PackTransposedF32(const Slab& s, float* dst, int64_t ld);
// bf16 row-major (the A operand of GemmBf16): dst[r * ld + c], zero for
// c >= nc up to ld (ld even), rows r < nr only.
void PackRowsBf16(const Slab& s, uint16_t* dst, int64_t ld);
// bf16 pair-interleaved B operand with p = column c of the slab and j = row r
// (K^T for QK^T): B(c, r) for c < RoundUp(nc, 2), r < ld; zero padded.
void PackTransposedBf16Pairs(const Slab& s, uint16_t* dst, int64_t ld);
// bf16 pair-interleaved B operand with p = row r and j = column c (V for PV):
// B(r, c) for r < nr_pad (even), c < ld; zero padded.
void PackRowsBf16Pairs(const Slab& s, uint16_t* dst, int64_t ld, int64_t nr_pad);

// Memory for an AlignedBuffer of `bytes` bytes: 64-byte aligned; from
// kHugeBytes on, whole 2 MiB blocks, 2 MiB aligned and (Linux) marked for
// transparent huge pages. ReleaseBufferMemory takes the same `bytes`.
// Blocks released are kept for a later request of the same size (at most
// 32 of them, the least recently kept freed beyond kMaxKeptBytes in all):
// calls in a loop (training steps, forward and backward, the ring's steps)
// reuse the memory of their per-call copies of K and V and of the
// backward's packed q side instead of having the kernel fault in and zero
// fresh pages every call — 5-7 % of a full-mask backward
// (docs/perf/PHASES.md). The price is memory held between calls: up to
// kMaxKeptBytes of blocks of the sizes recent calls used, which
// ReleaseCachedThreads gives back (and a failed allocation frees before it
// tries again). Not under AddressSanitizer (KeepsBuffers()), so that a use
// after free still reaches the allocator.
inline constexpr size_t kHugeBytes = kHugeMinBytes;
inline constexpr size_t kMaxKeptBytes = size_t{1} << 30;
void* AllocateBufferMemory(size_t bytes);
void ReleaseBufferMemory(void* p, size_t bytes);
// Frees the kept blocks (ReleaseCachedThreads calls it); how many bytes
// are kept; whether blocks are kept at all.
void ReleaseCachedBuffers();
size_t CachedBufferBytes();
bool KeepsBuffers();

// A 64-byte aligned array (scratch tiles, packed operands), zero-initialised
// unless asked otherwise.
template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t n) { Resize(n); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      Free();
      data_ = o.data_;
      size_ = o.size_;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  ~AlignedBuffer() { Free(); }

  // zero = false leaves the contents undefined: for buffers a packer fills
  // completely anyway (saves a pass over memory that is then written again).
  void Resize(size_t n, bool zero = true) {
    Free();
    if (n == 0) return;
    data_ = static_cast<T*>(AllocateBufferMemory(n * sizeof(T)));
    size_ = n;
    if (zero) {
      for (size_t i = 0; i < n; ++i) data_[i] = T{};
    }
  }
  T* data() const { return data_; }
  size_t size() const { return size_; }
  T& operator[](size_t i) const { return data_[i]; }

 private:
  void Free() {
    if (data_ != nullptr) ReleaseBufferMemory(data_, size_ * sizeof(T));
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ringsplash::kernels

#endif  // RINGSPLASH_KERNELS_TILING_PACK_H_

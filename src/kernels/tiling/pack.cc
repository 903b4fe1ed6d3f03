// Tile packers (see tiling/pack.h). Scalar loops over strided views: packing is
// O(tile) once per tile and call, small next to the O(tile * D) products.
#include "src/kernels/tiling/pack.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "src/core/huge_pages.h"

namespace ringsplash::kernels {

namespace {

// Under AddressSanitizer blocks are never kept: a use after free of a
// large buffer must reach the allocator to be reported.
constexpr bool kKeepBlocks = !kAddressSanitizer;

// Large blocks released by one call, kept for the next (pack.h). A fixed
// array, so that keeping a block (from a destructor) never allocates or
// throws.
class BlockCache {
 public:
  static constexpr int kMaxBlocks = 32;

  static BlockCache& Get() {
    static BlockCache* cache = new BlockCache;  // never destroyed: buffers may outlive statics
    return *cache;
  }

  // The most recently kept block of exactly `bytes` (a multiple of
  // kHugePageBytes), or null.
  void* Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = count_; i-- > 0;) {
      if (kept_[i].bytes != bytes) continue;
      void* p = kept_[i].p;
      kept_bytes_ -= bytes;
      std::copy(kept_ + i + 1, kept_ + count_, kept_ + i);
      --count_;
      return p;
    }
    return nullptr;
  }

  // Keeps p (a block of `bytes`), freeing the least recently kept blocks
  // beyond kMaxKeptBytes or kMaxBlocks; a block larger than kMaxKeptBytes
  // itself is freed at once.
  void Give(void* p, size_t bytes) noexcept {
    if (!kKeepBlocks || bytes > kMaxKeptBytes) {
      Free(p);
      return;
    }
    Block release[kMaxBlocks];
    int drop = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (count_ == kMaxBlocks) {
        release[drop++] = kept_[0];
        kept_bytes_ -= kept_[0].bytes;
        std::copy(kept_ + 1, kept_ + count_, kept_);
        --count_;
      }
      kept_[count_++] = {p, bytes};
      kept_bytes_ += bytes;
      int evict = 0;
      while (kept_bytes_ > kMaxKeptBytes) {
        kept_bytes_ -= kept_[evict].bytes;
        release[drop++] = kept_[evict++];
      }
      std::copy(kept_ + evict, kept_ + count_, kept_);
      count_ -= evict;
    }
    for (int i = 0; i < drop; ++i) Free(release[i].p);
  }

  void Clear() noexcept {
    Block release[kMaxBlocks];
    int drop = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::copy(kept_, kept_ + count_, release);
      drop = count_;
      count_ = 0;
      kept_bytes_ = 0;
    }
    for (int i = 0; i < drop; ++i) Free(release[i].p);
  }

  size_t KeptBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return kept_bytes_;
  }

  static void Free(void* p) noexcept { ::operator delete (p, std::align_val_t{kHugePageBytes}); }

 private:
  struct Block {
    void* p = nullptr;
    size_t bytes = 0;
  };
  std::mutex mu_;
  Block kept_[kMaxBlocks];  // least recently kept first
  int count_ = 0;
  size_t kept_bytes_ = 0;
};

}  // namespace

void* AllocateBufferMemory(size_t bytes) {
  if (bytes < kHugeBytes) return ::operator new (bytes, std::align_val_t{64});
  const size_t block = HugeBlockBytes(bytes);
  if (void* kept = BlockCache::Get().Take(block)) return kept;
  void* p = nullptr;
  try {
    p = ::operator new (block, std::align_val_t{kHugePageBytes});
  } catch (const std::bad_alloc&) {
    // Kept blocks of other sizes are what the memory went to: free them and
    // try once more.
    BlockCache::Get().Clear();
    p = ::operator new (block, std::align_val_t{kHugePageBytes});
  }
  AdviseHugePages(p, block);
  return p;
}

void ReleaseBufferMemory(void* p, size_t bytes) {
  if (bytes < kHugeBytes) {
    ::operator delete (p, std::align_val_t{64});
    return;
  }
  BlockCache::Get().Give(p, HugeBlockBytes(bytes));
}

bool KeepsBuffers() { return kKeepBlocks; }

void ReleaseCachedBuffers() { BlockCache::Get().Clear(); }

size_t CachedBufferBytes() { return BlockCache::Get().KeptBytes(); }

namespace {

// Reads row r of a slab into f32 (nc values).
void ReadRowF32(const Slab& s, int64_t r, float* out) {
  const TensorView& t = *s.t;
  const int64_t off = t.Offset(s.b, s.r0 + r, s.head, 0);
  const int64_t cs = t.stride[3];
  switch (t.dtype) {
    case DType::kF32: {
      const float* src = static_cast<const float*>(t.data) + off;
      if (cs == 1) {
        std::memcpy(out, src, static_cast<size_t>(s.nc) * sizeof(float));
      } else {
        for (int64_t c = 0; c < s.nc; ++c) out[c] = src[c * cs];
      }
      return;
    }
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(t.data) + off;
      if (cs == 1) {
        // bf16 is the top half of an f32: a shift, which this loop vectorises.
        for (int64_t c = 0; c < s.nc; ++c) {
          out[c] = std::bit_cast<float>(static_cast<uint32_t>(src[c]) << 16);
        }
      } else {
        for (int64_t c = 0; c < s.nc; ++c) out[c] = BF16ToF32(src[c * cs]);
      }
      return;
    }
    case DType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(t.data) + off;
      for (int64_t c = 0; c < s.nc; ++c) out[c] = F16ToF32(src[c * cs]);
      return;
    }
    default:
      for (int64_t c = 0; c < s.nc; ++c) out[c] = LoadAsF32(t, off + c * cs);
      return;
  }
}

// Reads row r of a slab as bf16 bits. Only the bf16 path calls this, and only
// for bf16 views, so no rounding happens here for those; other dtypes round.
void ReadRowBf16(const Slab& s, int64_t r, uint16_t* out) {
  const TensorView& t = *s.t;
  const int64_t off = t.Offset(s.b, s.r0 + r, s.head, 0);
  const int64_t cs = t.stride[3];
  if (t.dtype == DType::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(t.data) + off;
    for (int64_t c = 0; c < s.nc; ++c) out[c] = src[c * cs];
  } else {
    for (int64_t c = 0; c < s.nc; ++c) out[c] = F32ToBF16(LoadAsF32(t, off + c * cs));
  }
}

}  // namespace

void PackRowsF32(const Slab& s, float* dst, int64_t ld, int64_t nr_pad) {
  for (int64_t r = 0; r < nr_pad; ++r) {
    float* row = dst + r * ld;
    if (r < s.nr) {
      ReadRowF32(s, r, row);
      std::fill(row + s.nc, row + ld, 0.0f);
    } else {
      std::fill(row, row + ld, 0.0f);
    }
  }
}

void PackTransposedF32(const Slab& s, float* dst, int64_t ld) {
  std::vector<float> buf(static_cast<size_t>(s.nc));
  float* row = buf.data();
  for (int64_t r = 0; r < s.nr; ++r) {
    ReadRowF32(s, r, row);
    for (int64_t c = 0; c < s.nc; ++c) dst[c * ld + r] = row[c];
  }
  for (int64_t c = 0; c < s.nc; ++c) std::fill(dst + c * ld + s.nr, dst + (c + 1) * ld, 0.0f);
}

void PackRowsBf16(const Slab& s, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < s.nr; ++r) {
    uint16_t* row = dst + r * ld;
    ReadRowBf16(s, r, row);
    std::fill(row + s.nc, row + ld, uint16_t{0});
  }
}

void PackTransposedBf16Pairs(const Slab& s, uint16_t* dst, int64_t ld) {
  const int64_t nc2 = (s.nc + 1) / 2 * 2;
  std::fill(dst, dst + nc2 * ld, uint16_t{0});
  std::vector<uint16_t> buf(static_cast<size_t>(s.nc));
  uint16_t* row = buf.data();
  for (int64_t r = 0; r < s.nr; ++r) {
    ReadRowBf16(s, r, row);
    for (int64_t c = 0; c < s.nc; ++c) dst[((c / 2) * ld + r) * 2 + c % 2] = row[c];
  }
}

void PackRowsBf16Pairs(const Slab& s, uint16_t* dst, int64_t ld, int64_t nr_pad) {
  std::fill(dst, dst + nr_pad * ld, uint16_t{0});
  std::vector<uint16_t> buf(static_cast<size_t>(s.nc));
  uint16_t* row = buf.data();
  for (int64_t r = 0; r < s.nr; ++r) {
    ReadRowBf16(s, r, row);
    for (int64_t c = 0; c < s.nc; ++c) dst[((r / 2) * ld + c) * 2 + r % 2] = row[c];
  }
}

}  // namespace ringsplash::kernels

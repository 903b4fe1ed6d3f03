// Large buffers on transparent huge pages (core/huge_pages.h).
#include "src/core/huge_pages.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace ringsplash {

void AdviseHugePages(void* p, size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

#if defined(__linux__)

namespace {

// `bytes` rounded up to the system's page (4 KiB on x86-64; 16 or 64 KiB
// on some aarch64 and ppc64le kernels, where munmap needs their multiples).
size_t MappedSize(size_t bytes) {
  static const size_t page = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return (bytes + page - 1) / page * page;
}

}  // namespace

void* MapHugePages(size_t bytes) noexcept {
  // Sizes this close to the address space cannot be mapped, and the
  // rounding below would wrap.
  if (bytes > SIZE_MAX / 2) return nullptr;
  // One block more than asked, then the unaligned head and the tail given
  // back.
  const size_t size = MappedSize(bytes), span = size + kHugePageBytes;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) (void)munmap(raw, aligned - start);
  const uintptr_t end = aligned + size;
  if (start + span > end) (void)munmap(reinterpret_cast<void*>(end), start + span - end);
  void* p = reinterpret_cast<void*>(aligned);
  AdviseHugePages(p, size);
  return p;
}

void UnmapHugePages(void* p, size_t bytes) noexcept { (void)munmap(p, MappedSize(bytes)); }

#else

void* MapHugePages(size_t bytes) noexcept {
  const size_t size = HugeBlockBytes(bytes);
  void* p = std::aligned_alloc(kHugePageBytes, size);
  if (p != nullptr) std::memset(p, 0, size);
  return p;
}

void UnmapHugePages(void* p, size_t) noexcept { std::free(p); }

#endif

}  // namespace ringsplash

// Large allocations on transparent huge pages: the one rule the library's
// own buffers follow (Tensor's storage, the kernels' per-call scratch in
// tiling/pack.h), so that kernels reading rows far apart do not pay a page
// walk per row.
//
// Why: a K or V row of one head is D elements of every H_kv * D, e.g. 256
// bytes of every 2 KiB for bf16 with 8 kv heads, so a tile of 128 rows
// touches 64 distinct 4 KiB pages and a pass over one head touches every
// page of the tensor. On 4 KiB pages the kernels' row prefetches then stall
// on page walks (a sliding-window forward's K/V tile copies spent most of
// their time there); one 2 MiB page covers 1024 such rows
// (docs/perf/DESIGN_MEASUREMENTS.md: huge pages for tensors).
#ifndef RINGSPLASH_CORE_HUGE_PAGES_H_
#define RINGSPLASH_CORE_HUGE_PAGES_H_

#include <cstddef>

namespace ringsplash {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;
// From this size on, buffers go on huge pages.
inline constexpr size_t kHugeMinBytes = size_t{4} << 20;

// `bytes` rounded up to whole 2 MiB blocks.
inline size_t HugeBlockBytes(size_t bytes) {
  return (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
}

// Whether this build runs under AddressSanitizer, whose allocator must
// see every large buffer to catch overflows and uses after free: large
// buffers are then neither mapped here (kMapHugePages) nor kept between
// calls (tiling/pack.h).
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

// Whether large buffers are mapped (MapHugePages).
inline constexpr bool kMapHugePages = !kAddressSanitizer;

// `bytes` of zero-filled memory starting on a 2 MiB boundary and advised
// onto huge pages (AdviseHugePages), or null if the system has none to
// give. Mapped straight from the kernel (Linux mmap), `bytes` rounded up to
// the system page: its whole 2 MiB blocks can become huge pages while a partial last
// block stays on small pages, so the alignment costs no memory (an
// allocator's 2 MiB-aligned block would also keep its header just below
// the boundary, where THP may fault in a whole 2 MiB page for it). Free it
// with UnmapHugePages and the same `bytes`. Elsewhere, std::aligned_alloc
// of whole blocks, zeroed.
void* MapHugePages(size_t bytes) noexcept;
void UnmapHugePages(void* p, size_t bytes) noexcept;

// Marks [p, p + bytes) (p 2 MiB aligned) for transparent huge pages (Linux
// madvise MADV_HUGEPAGE). Advice only: where THP is off, or the kernel has
// no huge page to give, the range stays on 4 KiB pages and works the same.
// Never throws.
void AdviseHugePages(void* p, size_t bytes) noexcept;

}  // namespace ringsplash

#endif  // RINGSPLASH_CORE_HUGE_PAGES_H_

// Read-bandwidth measurement: the buffer, the threads, runtime dispatch and
// the portable loop.
#include "tools/bandwidth.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "ringsplash/attention.h"
#include "tools/peak.h"

namespace ringsplash::cli {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kPageBytes = 4096;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#if defined(__x86_64__)
bool Supports(KernelPath path) {
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  return std::find(paths.begin(), paths.end(), path) != paths.end();
}
#endif

// "32768K", "260M", "1024" (bytes) as in /sys/.../cache/index*/size; 0 if
// unreadable.
int64_t ParseCacheSize(const std::string& text) {
  char* end = nullptr;
  const long long n = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || n <= 0) return 0;
  switch (*end) {
    case 'K':
      return n * 1024;
    case 'M':
      return n * kMiB;
    case 'G':
      return n * 1024 * kMiB;
    default:
      return n;
  }
}

// The size of the highest-level data or unified cache CPU 0 reports, 0 when
// none is known.
int64_t LargestCacheBytes() {
  int best_level = 0;
  int64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size"), type_file(dir + "type");
    int level = 0;
    std::string size, type;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    type_file >> type;
    if (type == "Instruction") continue;
    const int64_t bytes = ParseCacheSize(size);
    if (level > best_level || (level == best_level && bytes > best)) {
      best_level = level;
      best = bytes;
    }
  }
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (best == 0) best = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  return best;
}

// Runs body(t) on `threads` threads started together; the wall time from the
// start until the last one is done.
template <typename Body>
double RunTogether(int threads, const Body& body) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1, std::memory_order_acq_rel);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t);
    });
  }
  while (ready.load(std::memory_order_acquire) < threads) std::this_thread::yield();
  const double start = Now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  return Now() - start;
}

struct FreeDeleter {
  void operator()(uint64_t* p) const { std::free(p); }
};

}  // namespace

int64_t ProbeBytes() {
  int64_t bytes = std::clamp<int64_t>(2 * LargestCacheBytes(), 256 * kMiB, 1024 * kMiB);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) bytes = std::min<int64_t>(bytes, int64_t{pages} * page / 8);
  return std::max<int64_t>(bytes, kPageBytes);
}

bool DecodingShaped(bool forward_only, int64_t q_seq, int64_t heads, int64_t kv_heads) {
  return forward_only && kv_heads > 0 && q_seq >= 1 &&
         q_seq * (heads / kv_heads) <= kMaxDecodingRows;
}

namespace bandwidth_detail {

uint64_t ReadPortable(const uint64_t* words, size_t n) {
  // Eight independent lanes per 64-byte line: a loop with no calls or
  // branches inside, which the vectoriser turns into 16-byte loads and adds
  // (SSE2, NEON) with several chains in flight. Integer sums: exact in any
  // order, so nothing stops the vectoriser (a float sum would need
  // -ffast-math to be reordered).
  uint64_t acc[8] = {};
  for (size_t i = 0; i < n; i += 8) {
    for (size_t j = 0; j < 8; ++j) acc[j] += words[i + j];
  }
  uint64_t sum = 0;
  for (uint64_t a : acc) sum += a;
  return sum;
}

ReadFn BestRead(std::string* method) {
#if defined(__x86_64__)
  if (Supports(KernelPath::kAvx512) || Supports(KernelPath::kAvx512Bf16)) {
    *method = "avx512 loads";
    return ReadAvx512;
  }
  if (Supports(KernelPath::kAvx2)) {
    *method = "avx2 loads";
    return ReadAvx2;
  }
#endif
  *method = "portable loads";
  return ReadPortable;
}

double TimedRead(ReadFn read, std::span<const uint64_t> words, int threads, int repeats,
                 uint64_t* sum) {
  const size_t part = words.size() / static_cast<size_t>(threads);
  std::vector<uint64_t> sums(static_cast<size_t>(threads), 0);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double seconds = RunTogether(threads, [&](int t) {
      sums[static_cast<size_t>(t)] = read(words.data() + static_cast<size_t>(t) * part, part);
    });
    if (seconds > 0) {
      best = std::max(best, static_cast<double>(part * static_cast<size_t>(threads)) *
                                sizeof(uint64_t) / seconds / 1e9);
    }
  }
  if (sum != nullptr) {
    *sum = 0;
    for (uint64_t s : sums) *sum += s;
  }
  return best;
}

}  // namespace bandwidth_detail

Bandwidth MeasureReadBandwidth(int threads, int64_t bytes, int repeats) {
  using namespace bandwidth_detail;
  Bandwidth bw;
  bw.threads = std::clamp(threads, 1, UsableCores());
  const ReadFn read = BestRead(&bw.method);
  // Whole pages per thread (a multiple of kWordsPerStep words), one thread's
  // part after another.
  const int64_t part_bytes = bytes / bw.threads / kPageBytes * kPageBytes;
  if (part_bytes <= 0) return bw;
  bw.bytes = part_bytes * bw.threads;
  const size_t words = static_cast<size_t>(bw.bytes) / sizeof(uint64_t);
  std::unique_ptr<uint64_t, FreeDeleter> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(kPageBytes, static_cast<size_t>(bw.bytes))));
  if (buffer == nullptr) {
    bw.bytes = 0;
    return bw;
  }
  // Each thread writes the pages it will read (first touch places them near
  // its core where memory is split into nodes). Distinct non-zero words: a
  // page of zeros could be merged with others by the hypervisor.
  uint64_t* data = buffer.get();
  const size_t part = words / static_cast<size_t>(bw.threads);
  RunTogether(bw.threads, [&](int t) {
    const size_t begin = static_cast<size_t>(t) * part;
    for (size_t i = begin; i < begin + part; ++i) data[i] = i * 0x9E3779B97F4A7C15ull + 1;
  });
  bw.gb_per_s = TimedRead(read, {data, words}, bw.threads, repeats);
  return bw;
}

BandwidthFraction FractionOfBandwidth(double gb_per_s, const Bandwidth& bw) {
  BandwidthFraction f;
  if (!(bw.gb_per_s > 0)) {
    f.unreliable_reason = "no read bandwidth was measured";
    return f;
  }
  if (gb_per_s > bw.gb_per_s) {
    char why[384];
    std::snprintf(why, sizeof(why),
                  "the run read K and V at %.1f GB/s, above the measured read bandwidth of %.1f "
                  "GB/s (%s, %d threads, %.0f MiB): other work used the memory or the cores "
                  "while it was measured, or K and V were small enough to be read from the "
                  "caches",
                  gb_per_s, bw.gb_per_s, bw.method.c_str(), bw.threads,
                  static_cast<double>(bw.bytes) / kMiB);
    f.unreliable_reason = why;
    return f;
  }
  f.of_bandwidth = gb_per_s / bw.gb_per_s;
  return f;
}

SettledBandwidth SettleBandwidth(double gb_per_s, const Bandwidth& first,
                                 const std::function<Bandwidth()>& measure_again) {
  SettledBandwidth s;
  s.bandwidth = first;
  s.fraction = FractionOfBandwidth(gb_per_s, first);
  if (s.fraction.reliable()) return s;
  const Bandwidth second = measure_again();
  if (second.gb_per_s > s.bandwidth.gb_per_s) s.bandwidth = second;
  s.measurements = 2;
  s.fraction = FractionOfBandwidth(gb_per_s, s.bandwidth);
  if (!s.fraction.reliable()) s.fraction.unreliable_reason += " (measured twice)";
  return s;
}

}  // namespace ringsplash::cli

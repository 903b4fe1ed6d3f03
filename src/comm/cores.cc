// The cores a process may use (cores.h).
#include "src/comm/cores.h"

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <thread>

namespace ringsplash::comm_internal {

std::vector<uint64_t> UsableCpuMask() {
  std::vector<uint64_t> words;
#if defined(__linux__)
  // A mask as large as the kernel's: EINVAL means the set was too small for
  // it (machines of more than 1024 CPUs), so try a larger one.
  for (int cpus = 1024; cpus <= (1 << 20); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(size, set);
    const int rc = sched_getaffinity(0, size, set);
    const int error = errno;
    if (rc == 0) {
      for (int c = 0; c < cpus; ++c) {
        if (!CPU_ISSET_S(c, size, set)) continue;
        words.resize(std::max(words.size(), static_cast<size_t>(c / 64 + 1)), 0);
        words[static_cast<size_t>(c / 64)] |= uint64_t{1} << (c % 64);
      }
    }
    CPU_FREE(set);
    if (rc == 0 || error != EINVAL) break;
  }
#endif
  return words;
}

int CountCores(const std::vector<uint64_t>& mask) {
  int count = 0;
  for (uint64_t w : mask) count += std::popcount(w);
  if (count > 0) return count;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int UsableCores() { return CountCores(UsableCpuMask()); }

bool MasksOverlap(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  if (a.empty() || b.empty()) return true;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if ((a[i] & b[i]) != 0) return true;
  }
  return false;
}

}  // namespace ringsplash::comm_internal

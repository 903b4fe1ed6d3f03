// The process's peak resident memory, for tests that bound what a call
// holds: Linux's VmHWM, which writing "5" to /proc/self/clear_refs resets to
// the current resident size.
#ifndef RINGSPLASH_TESTS_SUPPORT_PEAK_MEMORY_H_
#define RINGSPLASH_TESTS_SUPPORT_PEAK_MEMORY_H_

#include <cstdint>
#include <string>

namespace ringsplash::testing {

// A field of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 if absent.
int64_t StatusBytes(const std::string& field);

// Resets VmHWM to the current resident size (Linux >= 4.0); false if the
// kernel does not allow it (the caller then skips its measurement).
bool ResetPeak();

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_PEAK_MEMORY_H_

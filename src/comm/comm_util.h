// Small helpers shared by the communicator backends: message formatting and
// deadline arithmetic, so both backends report failures in the same words.
#ifndef RINGSPLASH_COMM_COMM_UTIL_H_
#define RINGSPLASH_COMM_COMM_UTIL_H_

#include <chrono>
#include <sstream>
#include <string>

namespace ringsplash::comm_internal {

using Clock = std::chrono::steady_clock;

// A deadline `seconds` from now; non-positive or huge values mean "a very
// long time" rather than overflow.
inline Clock::time_point DeadlineAfter(double seconds) {
  const double capped = seconds > 0 && seconds < 1e7 ? seconds : 1e7;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(capped));
}

// "5 s", "0.25 s".
inline std::string FormatSeconds(double seconds) {
  std::ostringstream os;
  os << seconds << " s";
  return os.str();
}

// The message every backend throws once a peer has failed.
inline std::string PeerFailedMessage(int failed_rank, const std::string& reason) {
  return "rank " + std::to_string(failed_rank) + " failed: " + reason;
}

}  // namespace ringsplash::comm_internal

#endif  // RINGSPLASH_COMM_COMM_UTIL_H_

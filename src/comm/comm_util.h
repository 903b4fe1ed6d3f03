// Small helpers shared by the communicator backends: message formatting,
// deadline arithmetic (so both backends report failures in the same words)
// and the emulated link's timeline.
#ifndef RINGSPLASH_COMM_COMM_UTIL_H_
#define RINGSPLASH_COMM_COMM_UTIL_H_

#include <chrono>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "ringsplash/comm.h"

namespace ringsplash::comm_internal {

using Clock = std::chrono::steady_clock;

inline Clock::duration ToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

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

// What messages about a sub-communicator append to name its group: " of
// group {1, 3}" (job ranks; long groups abbreviated: " of group {0, 2, 4,
// 6, 8, 10, 12, 14, ... (512 ranks)}").
std::string GroupLabel(const std::vector<int>& job_ranks);

// AllToAll's argument checks, shared by the backends (Error naming the
// argument): buffers null with bytes, a total size that overflows, send and
// recv overlapping.
void CheckAllToAllArguments(const void* send, const void* recv, size_t bytes_per_rank, int size);

// The link model a communicator uses: options.link, else RINGSPLASH_LINK,
// else none; throws Error if it is invalid.
LinkModel ResolveLink(const CommOptions& options);

// One directed link's timeline (LinkModel in comm.h): messages go one at a
// time in the order scheduled. Not thread-safe: the owner serialises calls.
class LinkClock {
 public:
  // A message of `bytes` that may start at `ready`: returns its arrival time
  // (start = max(ready, link free), + bytes / bandwidth, + latency) and
  // marks the link busy until its last byte has left.
  Clock::time_point Schedule(const LinkModel& link, Clock::time_point ready, size_t bytes);

 private:
  Clock::time_point free_{};
};

}  // namespace ringsplash::comm_internal

#endif  // RINGSPLASH_COMM_COMM_UTIL_H_

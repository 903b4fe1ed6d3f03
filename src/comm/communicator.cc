// The Communicator base class's defaults (include/ringsplash/comm.h), for
// communicators written outside ringsplash that implement only the ring's
// calls, and helpers the backends share (comm_util.h).
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "src/comm/comm_util.h"
#include "src/comm/cores.h"

namespace ringsplash {

std::unique_ptr<Communicator> Communicator::Split(int /*color*/, int /*key*/) {
  Fail("Split: the '", backend(), "' communicator does not implement it");
}

void Communicator::AllToAll(const void* /*send*/, void* /*recv*/, size_t /*bytes_per_rank*/) {
  Fail("AllToAll: the '", backend(), "' communicator does not implement it");
}

int Communicator::DefaultThreads() const { return comm_internal::UsableCores(); }

namespace comm_internal {

std::string GroupLabel(const std::vector<int>& job_ranks) {
  constexpr size_t kShown = 8;
  std::string out = " of group {";
  for (size_t i = 0; i < job_ranks.size() && i < kShown; ++i) {
    out += (i ? ", " : "") + std::to_string(job_ranks[i]);
  }
  if (job_ranks.size() > kShown) out += ", ... (" + std::to_string(job_ranks.size()) + " ranks)";
  return out + "}";
}

void CheckAllToAllArguments(const void* send, const void* recv, size_t bytes_per_rank, int size) {
  Check(bytes_per_rank <= std::numeric_limits<size_t>::max() / static_cast<size_t>(size),
        "AllToAll: bytes_per_rank x ranks overflows: ", bytes_per_rank, " x ", size);
  const size_t total = bytes_per_rank * static_cast<size_t>(size);
  Check(send != nullptr || total == 0,
        "AllToAll: send is null but bytes_per_rank = ", bytes_per_rank);
  Check(recv != nullptr || total == 0,
        "AllToAll: recv is null but bytes_per_rank = ", bytes_per_rank);
  if (total == 0) return;
  const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
  Check(s + total <= r || r + total <= s, "AllToAll: send and recv overlap (", total,
        " bytes each, ", size, " blocks of ", bytes_per_rank, ")");
}

}  // namespace comm_internal

}  // namespace ringsplash

// Collectives over AllReduceSum and per-machine defaults.
#include "tools/cli_common.h"

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/comm/cores.h"

namespace ringsplash::cli {

std::vector<double> AllGather(Communicator& comm, double value) {
  // value = hi + mid + lo exactly for any double whose magnitude a float can
  // hold: three float pieces carry 72 significant bits. Each slot has only
  // one non-zero contributor, so the float sums are exact.
  const int n = comm.size();
  std::vector<float> slots(static_cast<size_t>(3 * n), 0.0f);
  const float hi = static_cast<float>(value);
  const float mid = static_cast<float>(value - hi);
  const float lo = static_cast<float>(value - hi - static_cast<double>(mid));
  slots[3 * comm.rank()] = hi;
  slots[3 * comm.rank() + 1] = mid;
  slots[3 * comm.rank() + 2] = lo;
  comm.AllReduceSum(slots.data(), slots.size());
  std::vector<double> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    out[r] = static_cast<double>(slots[3 * r]) + slots[3 * r + 1] + slots[3 * r + 2];
  }
  return out;
}

void CheckThreadsPerRank(int threads_per_rank) {
  if (threads_per_rank < 0 || threads_per_rank > kMaxThreads) {
    Usage("--threads-per-rank: expected 1 to ", kMaxThreads,
          " (or 0 for the cores each rank may use), got ", threads_per_rank);
  }
}

void SumInto(Communicator& comm, std::vector<float>& data) {
  if (comm.size() > 1 && !data.empty()) comm.AllReduceSum(data.data(), data.size());
}

uint64_t Broadcast(Communicator& comm, uint64_t value) {
  // Three 16-bit pieces, each exact in a float.
  float parts[3] = {0, 0, 0};
  if (comm.rank() == 0) {
    for (int i = 0; i < 3; ++i) parts[i] = static_cast<float>((value >> (16 * i)) & 0xffff);
  }
  comm.AllReduceSum(parts, 3);
  uint64_t v = 0;
  for (int i = 0; i < 3; ++i) v |= static_cast<uint64_t>(parts[i]) << (16 * i);
  return v;
}

int LocalRanks(int fallback) {
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    const int n = std::atoi(s);
    if (n > 0) return n;
  }
  return fallback;
}

int DefaultThreadsPerRank(const Communicator& comm) { return comm.DefaultThreads(); }

int DefaultThreadsPerRank(int ranks_sharing_cores) {
  return std::max(1, comm_internal::UsableCores() / std::max(1, ranks_sharing_cores));
}

void CheckEnvironment(int ranks, bool backward) {
  // A bad setting, not a failed run: every Error here is a usage error.
  try {
    ResolveKernelPath(KernelPath::kAuto);  // reads RINGSPLASH_KERNEL
    const std::optional<FaultSpec> fault = FaultSpec::FromEnv();
    if (!fault) return;
    const std::string what = std::string("RINGSPLASH_FAULT=") + std::getenv("RINGSPLASH_FAULT");
    // The ring skips a fault it never reaches; a user testing failure
    // handling would then believe a fault was injected.
    Check(ranks >= 2, what,
          ": no ring runs with 1 rank (the single-device kernel), so no fault can be injected; "
          "use --ranks 2 or more, or unset RINGSPLASH_FAULT");
    fault->CheckFits(ranks, what);
    Check(!fault->backward || backward, what,
          ": the backward pass does not run (attend: give --dout; bench: --pass bwd or fwdbwd)");
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

std::string KernelPathFor(DType dtype) {
  const KernelPath path = ResolveKernelPath(KernelPath::kAuto);
  const bool bf16_only = path == KernelPath::kAvx512Bf16 || path == KernelPath::kAmx;
  if (dtype != DType::kBF16 && bf16_only) return KernelPathName(KernelPath::kAvx512);
  return KernelPathName(path);
}

}  // namespace ringsplash::cli

// The CPU cores a process may use: what Communicator::DefaultThreads shares
// among the ranks that run on them (include/ringsplash/comm.h).
#ifndef RINGSPLASH_COMM_CORES_H_
#define RINGSPLASH_COMM_CORES_H_

#include <cstdint>
#include <vector>

namespace ringsplash::comm_internal {

// The CPUs this process may run on: the calling thread's affinity mask
// (sched_getaffinity; taskset, cgroup cpusets and mpirun's binding shrink it)
// as 64-bit words, CPU c in bit c % 64 of word c / 64, without trailing zero
// words. Empty where there is no mask to read (not Linux, or the call failed).
std::vector<uint64_t> UsableCpuMask();

// The number of CPUs in `mask`, or std::thread::hardware_concurrency() when
// it has none. >= 1.
int CountCores(const std::vector<uint64_t>& mask);

// CountCores(UsableCpuMask()).
int UsableCores();

// True when the masks share a CPU, or either is empty (unknown: assume so).
bool MasksOverlap(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b);

}  // namespace ringsplash::comm_internal

#endif  // RINGSPLASH_COMM_CORES_H_

// This machine's memory read bandwidth, measured by the running process: what
// a decoding step (a few query rows against a long K/V cache, bound by
// reading K and V once) is compared with, as a FLOP rate is with the peak
// (peak.h).
//
// A streaming read: `threads` threads at once, each summing its own
// contiguous part of one buffer far larger than the caches (ProbeBytes), with
// the widest loads the CPU has: AVX-512 (one 64-byte line per load), else
// AVX2, else a portable loop the compiler vectorises with the baseline ISA
// (SSE2, NEON). The width matters on a server core, whose read rate is bound
// by the lines it keeps in flight, and each load holds a place in the
// out-of-order window: narrower loads read markedly less, and the AVX-512
// decoding kernel would appear to beat a narrower probe (docs/perf/DESIGN_MEASUREMENTS.md:
// bandwidth probe load width). Dispatch is at run
// time (SupportedKernelPaths), so one binary runs on any x86-64; builds for
// other processors have only the portable loop (the AVX files are not
// compiled). Pages are written by the thread that reads them before the
// timed reads (an untouched page reads as the kernel's one zero page, from
// the cache), and the best of a few reads counts.
//
// As with the peak, other work on the machine lowers the figure, and a run
// can then appear to read faster than the machine: such a fraction is never
// reported as real (SettleBandwidth: measure once more, else mark it
// unreliable).
#ifndef RINGSPLASH_TOOLS_BANDWIDTH_H_
#define RINGSPLASH_TOOLS_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

namespace ringsplash::cli {

struct Bandwidth {
  double gb_per_s = 0;  // all `threads` together, 1e9 bytes per second; 0: none measured
  std::string method;   // "avx512 loads", "avx2 loads", "portable loads"
  int threads = 0;      // threads that read at once
  int64_t bytes = 0;    // bytes of the buffer, each read once per repeat
};

// The probe's buffer: twice the largest cache this CPU reports (Linux sysfs,
// else sysconf; an in-order read through an LRU-like cache of half its size
// misses on every line), at least 256 MiB and at most 1 GiB (first touching
// the pages costs ~0.4 s per GiB on the development VM), and at most an
// eighth of the machine's memory.
int64_t ProbeBytes();

// Reads a buffer of `bytes` (rounded down to whole pages per thread) on
// min(threads, UsableCores()) threads at once (threads beyond the cores
// would only take turns on them), `repeats` times; the fastest read counts.
// About 0.4 s for the default size on the development VM (most of it the
// kernel mapping the pages). A buffer that
// cannot be allocated gives gb_per_s = 0 (no fraction is then reported).
Bandwidth MeasureReadBandwidth(int threads, int64_t bytes = ProbeBytes(), int repeats = 4);

// Whether `bench` compares a configuration with the read bandwidth: a
// forward (--pass fwd) with at most kMaxDecodingRows query rows per kv head
// (q_seq x heads / kv_heads). Such a step does rows / 2 FLOPs per byte of f32
// K/V (rows per byte of bf16: 4 D FLOPs per row and key, against 2 D
// elements): at 16 rows 8 or 16, below the FMA peak over the read bandwidth
// of current server cores (tens of FLOPs per byte:
// docs/perf/DESIGN_MEASUREMENTS.md: decoding rows), so the bytes, not the
// FLOPs, bound a step; 16 is also the most rows per head the kernels'
// decoding schedules take (one vector, flash/schedule.h). Other
// calls are measured against the peak only and skip the probe (its buffer
// would add to every run's time and memory).
inline constexpr int64_t kMaxDecodingRows = 16;
bool DecodingShaped(bool forward_only, int64_t q_seq, int64_t heads, int64_t kv_heads);

// A run's K/V read rate as a fraction of the bandwidth measured for it.
struct BandwidthFraction {
  std::optional<double> of_bandwidth;  // gb_per_s over Bandwidth::gb_per_s; absent when unreliable
  std::string unreliable_reason;       // non-empty exactly when the fraction is absent: why
  bool reliable() const { return unreliable_reason.empty(); }
};

// The fraction of `gb_per_s`, or, when it is above the measured bandwidth (a
// bandwidth measured while other work used the memory or the cores, or K/V
// small enough to be read from the caches) or none was measured, none and the
// reason.
BandwidthFraction FractionOfBandwidth(double gb_per_s, const Bandwidth& bandwidth);

// The rate and fraction of a run that read K/V at `gb_per_s`, given the
// bandwidth measured after it (`first`): when the rate is above it,
// `measure_again` runs once and the higher of the two measurements counts
// (a busy machine only ever lowers one); a rate still above it leaves the
// fraction unreliable. `measurements` is 1 or 2.
struct SettledBandwidth {
  Bandwidth bandwidth;
  BandwidthFraction fraction;
  int measurements = 1;
};
SettledBandwidth SettleBandwidth(double gb_per_s, const Bandwidth& first,
                                 const std::function<Bandwidth()>& measure_again);

namespace bandwidth_detail {

// The sum (mod 2^64) of words[0, n), read in order; n a multiple of
// kWordsPerStep, words 64-byte aligned. The AVX ones are defined in files
// compiled with the matching -m flags: call only when supported.
inline constexpr size_t kWordsPerStep = 32;  // 256 bytes: four 64-byte lines
using ReadFn = uint64_t (*)(const uint64_t* words, size_t n);
uint64_t ReadPortable(const uint64_t* words, size_t n);
uint64_t ReadAvx2(const uint64_t* words, size_t n);
uint64_t ReadAvx512(const uint64_t* words, size_t n);

// The widest read this CPU runs, and its name (Bandwidth::method).
ReadFn BestRead(std::string* method);

// Reads `words` (64-byte aligned; size a multiple of threads x
// kWordsPerStep) with `read` on `threads` threads at once, thread t its own
// t-th contiguous part, `repeats` times: the fastest repeat in GB/s. *sum
// (if given) gets the sum (mod 2^64) of all words as the last repeat read
// it: every word read once.
double TimedRead(ReadFn read, std::span<const uint64_t> words, int threads, int repeats,
                 uint64_t* sum = nullptr);

}  // namespace bandwidth_detail

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_BANDWIDTH_H_

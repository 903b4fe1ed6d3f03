// The read-bandwidth probe of `bench` (tools/bandwidth.h): its loops read
// every word once, its rate agrees with a timing of the same buffer taken
// here, it runs no more threads than the cores the process may use, a K/V
// rate above it is measured again and then reported as unreliable (never as a
// fraction above 1), and only decoding-shaped benches run it.
#include "tools/bandwidth.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "tests/cli/cli_test_util.h"
#include "tests/support/sanitizers.h"
#include "tools/peak.h"

namespace ringsplash::cli {
namespace {

using bandwidth_detail::kWordsPerStep;
using bandwidth_detail::ReadFn;
constexpr int64_t kMiB = int64_t{1} << 20;

struct FreeDeleter {
  void operator()(uint64_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint64_t, FreeDeleter>;

using ringsplash::testing::kEmulated;
using ringsplash::testing::kSanitized;

// `words` 64-byte aligned words, each a distinct odd-looking value (a
// missed or twice-read word changes the sum).
Buffer MakeBuffer(size_t words) {
  // aligned_alloc wants a size that is a multiple of the alignment.
  const size_t bytes = (words * sizeof(uint64_t) + 4095) / 4096 * 4096;
  Buffer b(static_cast<uint64_t*>(std::aligned_alloc(4096, bytes)));
  for (size_t i = 0; i < words; ++i) b.get()[i] = (i + 1) * 0x9E3779B97F4A7C15ull ^ (i << 7);
  return b;
}

// Every read loop this CPU can run, with its name.
std::vector<std::pair<std::string, ReadFn>> ReadLoops() {
  std::vector<std::pair<std::string, ReadFn>> loops = {
      {"portable", bandwidth_detail::ReadPortable}};
#if defined(__x86_64__)
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  auto has = [&](KernelPath p) { return std::find(paths.begin(), paths.end(), p) != paths.end(); };
  if (has(KernelPath::kAvx2)) loops.emplace_back("avx2", bandwidth_detail::ReadAvx2);
  if (has(KernelPath::kAvx512) || has(KernelPath::kAvx512Bf16)) {
    loops.emplace_back("avx512", bandwidth_detail::ReadAvx512);
  }
#endif
  return loops;
}

// The JSON objects of `out`, one per line.
std::vector<nlohmann::json> JsonLines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  while (start < out.size()) {
    const size_t end = std::min(out.find('\n', start), out.size());
    if (out[start] == '{') lines.push_back(nlohmann::json::parse(out.substr(start, end - start)));
    start = end + 1;
  }
  return lines;
}

Bandwidth MakeBandwidth(double gb_per_s) {
  Bandwidth b;
  b.gb_per_s = gb_per_s;
  b.method = "avx512 loads";
  b.threads = 2;
  b.bytes = 512 * kMiB;
  return b;
}

TEST(BandwidthTest, EveryLoopReadsEveryWordOnce) {
  const size_t words = 3 * 4096 + kWordsPerStep;
  const Buffer b = MakeBuffer(words);
  for (const auto& [name, read] : ReadLoops()) {
    SCOPED_TRACE(name);
    for (const size_t n : {kWordsPerStep, size_t{4096}, words}) {
      EXPECT_EQ(read(b.get(), n), std::accumulate(b.get(), b.get() + n, uint64_t{0})) << n;
    }
  }
  // The timed read: thread t its own part, together every word.
  std::string method;
  const ReadFn best = bandwidth_detail::BestRead(&method);
  EXPECT_FALSE(method.empty());
  const std::span<const uint64_t> all(b.get(), 4 * 3 * kWordsPerStep);
  for (const int threads : {1, 3, 4}) {
    uint64_t sum = 0;
    EXPECT_GT(bandwidth_detail::TimedRead(best, all, threads, 2, &sum), 0);
    EXPECT_EQ(sum, std::accumulate(all.begin(), all.end(), uint64_t{0})) << threads;
  }
}

// The probe's rate against a timing of the same buffer by this test: a plain
// std::accumulate (the compiler's baseline vectors) on one thread, best of
// three each, alternated so that both meet the same load. The probe's wider
// loads keep more lines in flight (1.8x a 16-byte loop on the Xeon
// development VM), so it is never much slower and at most a few times
// faster; reads the compiler dropped, a wrong clock or a wrong byte count
// (bits, words, the buffer counted per repeat) are off by far more. Both
// read the same 256 MiB, so whatever the caches hold favours neither.
TEST(BandwidthTest, ProbeAgreesWithAnIndependentTimingOfTheSameBuffer) {
  const size_t words = 256 * kMiB / sizeof(uint64_t);
  const Buffer b = MakeBuffer(words);
  std::string method;
  const ReadFn best = bandwidth_detail::BestRead(&method);
  const std::span<const uint64_t> all(b.get(), words);
  double probe = 0, plain = 0;
  uint64_t expected = 0;
  for (int r = 0; r < 3; ++r) {
    probe = std::max(probe, bandwidth_detail::TimedRead(best, all, 1, 1));
    const auto start = std::chrono::steady_clock::now();
    expected = std::accumulate(all.begin(), all.end(), uint64_t{0});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    plain = std::max(plain, static_cast<double>(words * sizeof(uint64_t)) / seconds / 1e9);
  }
  uint64_t sum = 0;
  bandwidth_detail::TimedRead(best, all, 1, 1, &sum);
  EXPECT_EQ(sum, expected);
  // Rates compare only between equally compiled loops on the hardware:
  // under a sanitizer the plain loop's every load is instrumented, the
  // probe's intrinsics barely; under qemu-user (aarch64 CI) the probe's
  // portable loop ran 4.06x the plain one, a ratio of the emulator's
  // translations.
  if (kSanitized || kEmulated) return;
  EXPECT_GE(probe, 0.5 * plain) << method << ": " << probe << " GB/s, plain " << plain;
  EXPECT_LE(probe, 4 * plain) << method << ": " << probe << " GB/s, plain " << plain;
}

TEST(BandwidthTest, RunsAtMostOneThreadPerUsableCoreOnWholePages) {
  const int cores = UsableCores();
  const int64_t asked = 8 * kMiB + 12345;
  const Bandwidth bw = MeasureReadBandwidth(cores + 3, asked, 1);
  EXPECT_EQ(bw.threads, cores);
  EXPECT_GT(bw.gb_per_s, 0);
  EXPECT_FALSE(bw.method.empty());
  EXPECT_EQ(bw.bytes % (4096 * int64_t{cores}), 0) << bw.bytes;
  EXPECT_LE(bw.bytes, asked);
  EXPECT_GT(bw.bytes, asked - 4096 * int64_t{cores});
  EXPECT_EQ(MeasureReadBandwidth(0, 4 * kMiB, 1).threads, 1);
  // Less than a page per thread: nothing to read, no figure.
  EXPECT_EQ(MeasureReadBandwidth(1, 100, 1).gb_per_s, 0);
}

TEST(BandwidthTest, ProbeBufferIsLargerThanTheCaches) {
  const int64_t bytes = ProbeBytes();
  EXPECT_LE(bytes, 1024 * kMiB);
  // At least 256 MiB wherever the machine has 2 GiB of memory.
  if (bytes < 256 * kMiB) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    EXPECT_LT(int64_t{pages} * page, 2048 * kMiB) << bytes;
  }
}

TEST(BandwidthTest, DecodingShapedIsAtMost16RowsPerKvHeadForward) {
  EXPECT_TRUE(DecodingShaped(true, 1, 32, 8));   // the GQA target row: 4 rows
  EXPECT_TRUE(DecodingShaped(true, 1, 32, 2));   // 16
  EXPECT_FALSE(DecodingShaped(true, 1, 34, 2));  // 17
  EXPECT_TRUE(DecodingShaped(true, 16, 8, 8));   // 16 tokens of MHA
  EXPECT_FALSE(DecodingShaped(true, 17, 8, 8));
  EXPECT_TRUE(DecodingShaped(true, 2, 64, 8));    // 2 tokens x 8 heads
  EXPECT_FALSE(DecodingShaped(false, 1, 32, 8));  // a backward is not a step
  EXPECT_FALSE(DecodingShaped(true, 4096, 8, 8));
}

TEST(BandwidthFractionTest, AtOrBelowTheBandwidthIsAFraction) {
  for (const double rate : {0.0, 5.0, 20.0}) {
    const BandwidthFraction f = FractionOfBandwidth(rate, MakeBandwidth(20));
    ASSERT_TRUE(f.reliable()) << rate;
    EXPECT_DOUBLE_EQ(*f.of_bandwidth, rate / 20);
  }
}

TEST(BandwidthFractionTest, AboveTheBandwidthIsNoFractionButAReason) {
  const BandwidthFraction f = FractionOfBandwidth(23.4, MakeBandwidth(20));
  EXPECT_FALSE(f.reliable());
  EXPECT_FALSE(f.of_bandwidth.has_value());
  for (const char* part : {"23.4 GB/s", "20.0 GB/s", "avx512 loads", "2 threads", "512 MiB"}) {
    EXPECT_NE(f.unreliable_reason.find(part), std::string::npos) << f.unreliable_reason;
  }
  // No bandwidth at all is no fraction either (not a division by zero).
  const BandwidthFraction none = FractionOfBandwidth(1.0, MakeBandwidth(0));
  EXPECT_FALSE(none.reliable());
  EXPECT_FALSE(none.of_bandwidth.has_value());
}

TEST(SettleBandwidthTest, MeasuresAgainOnlyWhenTheRateIsAboveTheBandwidth) {
  int calls = 0;
  const auto again = [&calls](double gb_per_s) {
    return [&calls, gb_per_s] {
      ++calls;
      return MakeBandwidth(gb_per_s);
    };
  };
  // Below: one measurement, as it was.
  SettledBandwidth s = SettleBandwidth(15, MakeBandwidth(20), again(99));
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(s.measurements, 1);
  EXPECT_DOUBLE_EQ(*s.fraction.of_bandwidth, 0.75);
  EXPECT_DOUBLE_EQ(s.bandwidth.gb_per_s, 20);
  // Above, and the second measurement is higher: it counts.
  s = SettleBandwidth(23, MakeBandwidth(20), again(25));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.measurements, 2);
  ASSERT_TRUE(s.fraction.reliable());
  EXPECT_DOUBLE_EQ(*s.fraction.of_bandwidth, 23.0 / 25);
  EXPECT_DOUBLE_EQ(s.bandwidth.gb_per_s, 25);
  // Above, and the second is lower still: the higher first one stays, the
  // rate is above it: no fraction.
  calls = 0;
  s = SettleBandwidth(23, MakeBandwidth(20), again(18));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.measurements, 2);
  EXPECT_DOUBLE_EQ(s.bandwidth.gb_per_s, 20);
  EXPECT_FALSE(s.fraction.reliable());
  EXPECT_FALSE(s.fraction.of_bandwidth.has_value());
  EXPECT_NE(s.fraction.unreliable_reason.find("measured twice"), std::string::npos)
      << s.fraction.unreliable_reason;
}

// The bench's fields of a decoding-shaped run: a measured bandwidth and
// either a fraction within (0, 1] or none with the reason. `threads`: the
// probe threads expected.
void ExpectDecodingFields(const nlohmann::json& j, int threads) {
  SCOPED_TRACE(j.dump());
  ASSERT_TRUE(j["read_gb_per_s"].is_number());
  EXPECT_GT(j["read_gb_per_s"].get<double>(), 0);
  EXPECT_EQ(j["bandwidth_threads"], threads);
  EXPECT_GE(j["bandwidth_bytes"].get<int64_t>(), 4096 * threads);
  EXPECT_FALSE(j["bandwidth_method"].get<std::string>().empty());
  ASSERT_TRUE(j.contains("bandwidth_unreliable"));
  if (j["bandwidth_unreliable"].get<bool>()) {
    // K and V of a test are small enough for the caches: a rate above the
    // memory's is possible, and is then no figure.
    EXPECT_TRUE(j["fraction_of_bandwidth"].is_null());
    EXPECT_NE(j["bandwidth_unreliable_reason"].get<std::string>().find(
                  "above the measured read bandwidth"),
              std::string::npos);
    EXPECT_EQ(j["bandwidth_measurements"], 2);
  } else {
    EXPECT_GT(j["fraction_of_bandwidth"].get<double>(), 0);
    EXPECT_LE(j["fraction_of_bandwidth"].get<double>(), 1);
    EXPECT_FALSE(j.contains("bandwidth_unreliable_reason"));
    EXPECT_GE(j["bandwidth_measurements"].get<int>(), 1);
  }
}

// One token, H = 8 over Hkv = 2 (4 rows per kv head), 2 ranks x 2 threads:
// the probe reads on the cores the process may use, here one.
#if defined(__linux__)
TEST(BandwidthTest, DecodingBenchMeasuresTheBandwidthOnTheCoresItMayUse) {
  const testing::OneCpu one;
  ASSERT_TRUE(one.ok());
  const testing::CommandResult r =
      testing::RunCli({"bench", "--q-seq",    "2",          "--seq",
                       "4096",  "--heads",    "8",          "--kv-heads",
                       "2",     "--head-dim", "64",         "--ranks",
                       "2",     "--layout",   "contiguous", "--threads-per-rank",
                       "2",     "--warmup",   "0",          "--iters",
                       "2",     "--check"},
                      120);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  ExpectDecodingFields(lines[0], 1);
  // The result is still checked in the same run.
  EXPECT_LT(lines[0]["max_rel_err"].get<double>(), 1e-4) << lines[0].dump();
}
#endif

TEST(BandwidthTest, DecodingBenchUnderMpiAddsTheProcesses) {
#ifndef RINGSPLASH_MPIEXEC
  GTEST_SKIP() << "built without MPI";
#else
  const testing::CommandResult r =
      testing::RunCliUnderMpi(2, {"bench", "--backend",  "mpi",        "--q-seq",
                                  "2",     "--seq",      "4096",       "--heads",
                                  "8",     "--kv-heads", "2",          "--head-dim",
                                  "64",    "--layout",   "contiguous", "--threads-per-rank",
                                  "1",     "--warmup",   "0",          "--iters",
                                  "2"},
                              180);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<nlohmann::json> lines = JsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;  // rank 0 only
  ExpectDecodingFields(lines[0], 2);
#endif
}

// Other calls skip the probe: 64 query rows per kv head, and a backward.
TEST(BandwidthTest, OtherBenchesHaveNoBandwidthFields) {
  for (const char* pass : {"fwd", "bwd"}) {
    const bool fwd = std::string(pass) == "fwd";
    const testing::CommandResult r =
        testing::RunCli({"bench", "--q-seq", fwd ? "64" : "1", "--seq", "256", "--heads", "2",
                         "--head-dim", "16", "--pass", pass, "--warmup", "0", "--iters", "1"},
                        120);
    ASSERT_EQ(r.status, 0) << r.err;
    const std::vector<nlohmann::json> lines = JsonLines(r.out);
    ASSERT_EQ(lines.size(), 1u) << r.out;
    const nlohmann::json& j = lines[0];
    SCOPED_TRACE(j.dump());
    for (const char* f : {"read_gb_per_s", "fraction_of_bandwidth", "bandwidth_method",
                          "bandwidth_threads", "bandwidth_bytes"}) {
      ASSERT_TRUE(j.contains(f)) << f;
      EXPECT_TRUE(j[f].is_null()) << f;
    }
    EXPECT_EQ(j["bandwidth_measurements"], 0);
    EXPECT_EQ(j["bandwidth_unreliable"], false);
    EXPECT_FALSE(j.contains("bandwidth_unreliable_reason"));
  }
}

}  // namespace
}  // namespace ringsplash::cli

// The peak probe of `bench` and `demo` (tools/peak.h): it runs no more
// threads than the cores the process may use, and a fraction of peak above
// what the machine can do is measured again, then reported as unreliable,
// never as a figure.
#include "tools/peak.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace ringsplash::cli {
namespace {

#if defined(__linux__)
using testing::OneCpu;
#endif

Peak MakePeak(double gflops, double tile_gflops = 0) {
  Peak p;
  p.gflops = gflops;
  p.tile_gflops = tile_gflops;
  p.method = "avx512 fmadd_ps";
  p.threads = 2;
  return p;
}

TEST(PeakTest, RunsAtMostOneThreadPerUsableCore) {
  const int cores = UsableCores();
  ASSERT_GE(cores, 1);
  const Peak p = MeasurePeak(DType::kF32, cores + 3, 0.02);
  EXPECT_EQ(p.threads, cores);
  EXPECT_GT(p.gflops, 0);
  EXPECT_EQ(MeasurePeak(DType::kF32, 0, 0.02).threads, 1);
}

#if defined(__linux__)
// The affinity mask, not the machine's CPU count, bounds the threads: the
// first run of `demo` on a 2-core allotment ran 4 peak threads and printed
// "116.6 % of peak".
TEST(PeakTest, AffinityMaskOfOneCpuMeansOneThread) {
  const OneCpu one;
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(UsableCores(), 1);
  const Peak p = MeasurePeak(DType::kBF16, 4, 0.02);
  EXPECT_EQ(p.threads, 1);
  EXPECT_GT(p.gflops, 0);
}

// The same through the binary, which inherits the mask: 2 ranks x 2 threads
// ran on 1 CPU, and the peak may use only that one.
TEST(PeakTest, BenchMeasuresThePeakOnTheCoresItMayUse) {
  const OneCpu one;
  ASSERT_TRUE(one.ok());
  const testing::CommandResult r =
      testing::RunCli({"bench", "--seq", "64", "--heads", "2", "--head-dim", "16", "--ranks", "2",
                       "--threads-per-rank", "2", "--warmup", "0", "--iters", "1"},
                      120);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["peak_threads"], 1) << j.dump();
  EXPECT_EQ(j["config"]["threads_per_rank"], 2);
  // Either a real fraction or none, with the reason; never a figure above 1
  // on this f32 run (no AMX tile peak).
  ASSERT_TRUE(j.contains("peak_unreliable"));
  if (j["peak_unreliable"].get<bool>()) {
    EXPECT_TRUE(j["fraction_of_peak"].is_null()) << j.dump();
    EXPECT_TRUE(j["fraction_of_amx_peak"].is_null()) << j.dump();
    EXPECT_NE(j["peak_unreliable_reason"].get<std::string>().find("above the measured peak"),
              std::string::npos)
        << j.dump();
    EXPECT_EQ(j["peak_measurements"], 2);
  } else {
    EXPECT_GT(j["fraction_of_peak"].get<double>(), 0);
    EXPECT_LE(j["fraction_of_peak"].get<double>(), 1);
    EXPECT_FALSE(j.contains("peak_unreliable_reason"));
  }
}
#endif

TEST(PeakFractionTest, AtOrBelowThePeakIsAFraction) {
  for (const double gflops : {0.0, 50.0, 200.0}) {
    const PeakFraction f = FractionOfPeak(gflops, MakePeak(200));
    ASSERT_TRUE(f.reliable()) << gflops;
    EXPECT_DOUBLE_EQ(*f.of_peak, gflops / 200);
    EXPECT_FALSE(f.of_tile_peak.has_value());
  }
}

TEST(PeakFractionTest, AboveThePeakIsNoFractionButAReason) {
  const PeakFraction f = FractionOfPeak(233.2, MakePeak(200));
  EXPECT_FALSE(f.reliable());
  EXPECT_FALSE(f.of_peak.has_value());
  EXPECT_FALSE(f.of_tile_peak.has_value());
  for (const char* part : {"233.2 GFLOP/s", "200.0 GFLOP/s", "avx512 fmadd_ps", "2 threads"}) {
    EXPECT_NE(f.unreliable_reason.find(part), std::string::npos) << f.unreliable_reason;
  }
  // No peak at all is no fraction either (not a division by zero).
  EXPECT_FALSE(FractionOfPeak(1.0, MakePeak(0)).reliable());
}

// bf16 products on AMX tiles may beat the vector peak (a real fraction above
// 1), never the tile peak.
TEST(PeakFractionTest, TheTilePeakBoundsAmxRuns) {
  const PeakFraction f = FractionOfPeak(300, MakePeak(200, 1000));
  ASSERT_TRUE(f.reliable());
  EXPECT_DOUBLE_EQ(*f.of_peak, 1.5);
  EXPECT_DOUBLE_EQ(*f.of_tile_peak, 0.3);
  EXPECT_DOUBLE_EQ(RateBound(MakePeak(200, 1000)), 1000);
  EXPECT_DOUBLE_EQ(RateBound(MakePeak(200)), 200);
  const PeakFraction above = FractionOfPeak(1200, MakePeak(200, 1000));
  EXPECT_FALSE(above.reliable());
  EXPECT_NE(above.unreliable_reason.find("AMX tiles"), std::string::npos)
      << above.unreliable_reason;
}

TEST(PeakFractionTest, HigherPeakTakesTheHigherMeasurementOfEachLoop) {
  Peak a = MakePeak(200, 900);
  Peak b = MakePeak(250, 800);
  b.method = "avx512 dpbf16_ps";
  const Peak h = HigherPeak(a, b);
  EXPECT_DOUBLE_EQ(h.gflops, 250);
  EXPECT_EQ(h.method, "avx512 dpbf16_ps");
  EXPECT_DOUBLE_EQ(h.tile_gflops, 900);
  EXPECT_EQ(h.threads, 2);
  const Peak k = HigherPeak(b, a);
  EXPECT_DOUBLE_EQ(k.gflops, 250);
  EXPECT_EQ(k.method, "avx512 dpbf16_ps");
}

TEST(SettlePeakTest, MeasuresAgainOnlyWhenTheRateIsAboveThePeak) {
  int calls = 0;
  const auto again = [&calls](double gflops) {
    return [&calls, gflops] {
      ++calls;
      return MakePeak(gflops);
    };
  };
  // Below: one measurement, as it was.
  SettledPeak s = SettlePeak(150, MakePeak(200), again(999));
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(s.measurements, 1);
  EXPECT_DOUBLE_EQ(*s.fraction.of_peak, 0.75);
  EXPECT_DOUBLE_EQ(s.peak.gflops, 200);
  // Above, and the second measurement is higher: it counts.
  s = SettlePeak(233, MakePeak(200), again(250));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.measurements, 2);
  ASSERT_TRUE(s.fraction.reliable());
  EXPECT_DOUBLE_EQ(*s.fraction.of_peak, 233.0 / 250);
  EXPECT_DOUBLE_EQ(s.peak.gflops, 250);
  // Above, and the second is lower still: the higher first one stays, and
  // the rate is above it: no fraction.
  calls = 0;
  s = SettlePeak(233, MakePeak(200), again(180));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.measurements, 2);
  EXPECT_DOUBLE_EQ(s.peak.gflops, 200);
  EXPECT_FALSE(s.fraction.reliable());
  EXPECT_FALSE(s.fraction.of_peak.has_value());
  EXPECT_NE(s.fraction.unreliable_reason.find("measured twice"), std::string::npos)
      << s.fraction.unreliable_reason;
}

TEST(PeakFractionTest, DemoTextNeverShowsAnUnreliableFigure) {
  EXPECT_EQ(DescribeFraction(FractionOfPeak(126.2, MakePeak(200))), "63.1 % of peak");
  EXPECT_EQ(DescribeFraction(FractionOfPeak(300, MakePeak(200, 1000))),
            "150.0 % of peak, 30.0 % of the AMX tile peak");
  EXPECT_EQ(DescribeFraction(FractionOfPeak(233.2, MakePeak(200))),
            "n/a (peak measurement unreliable on a busy machine)");
}

}  // namespace
}  // namespace ringsplash::cli

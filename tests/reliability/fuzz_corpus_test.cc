// Replays every fuzz seed (fuzz/corpus/<target>/*) and every input that once
// broke a target (fuzz/regressions/<target>/*) through the fuzz targets'
// bodies, in the ordinary test suite: any compiler, every CI build, and under
// AddressSanitizer + UBSan in scripts/ci_sanitizers.sh. A broken property
// aborts with "FUZZ PROPERTY VIOLATED: ..." naming what went wrong; the test
// logs each file before running it, so the output names the input too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"

namespace ringsplash::fuzz {
namespace {

namespace fs = std::filesystem;

using TargetFn = int (*)(const uint8_t*, size_t);

// The seeds and saved crash inputs of `target`, and the seeds of `extra`
// (a target whose corpus also seeds this one; scripts/ci_fuzz.sh).
std::vector<fs::path> InputsOf(const std::string& target, const std::string& extra = "") {
  std::vector<fs::path> roots = {fs::path(RINGSPLASH_FUZZ_DIR) / "corpus" / target,
                                 fs::path(RINGSPLASH_FUZZ_DIR) / "regressions" / target};
  if (!extra.empty()) roots.push_back(fs::path(RINGSPLASH_FUZZ_DIR) / "corpus" / extra);
  std::vector<fs::path> files;
  for (const fs::path& root : roots) {
    if (!fs::is_directory(root)) continue;
    for (const auto& entry : fs::directory_iterator(root)) {
      if (entry.is_regular_file() && entry.path().filename().string()[0] != '.') {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Runs every input of `target` (and `extra`'s seeds); returns how many ran.
size_t Replay(const std::string& target, TargetFn fn, const std::string& extra = "") {
  const std::vector<fs::path> files = InputsOf(target, extra);
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    std::fprintf(stderr, "replaying %s (%zu bytes)\n", f.c_str(), bytes.size());
    fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  return files.size();
}

TEST(FuzzCorpus, MaskParse) { EXPECT_GT(Replay("mask_parse", MaskParseOneInput), 0u); }

TEST(FuzzCorpus, Attention) { EXPECT_GT(Replay("attention", AttentionOneInput), 0u); }

// The ring target's own seeds cover what the attention seeds do not reach
// through the ring (both seed its fuzzer).
TEST(FuzzCorpus, Ring) { EXPECT_GT(Replay("ring", RingOneInput, "attention"), 0u); }

#ifdef RINGSPLASH_HAVE_NPY
TEST(FuzzCorpus, Npy) { EXPECT_GT(Replay("npy", NpyOneInput), 0u); }
#endif

// The targets must accept empty and tiny inputs (libFuzzer starts there).
TEST(FuzzCorpus, EmptyAndTinyInputs) {
  const uint8_t bytes[4] = {0xff, 0x00, 0x7f, 0x80};
  for (size_t n = 0; n <= sizeof bytes; ++n) {
    MaskParseOneInput(bytes, n);
    AttentionOneInput(bytes, n);
    RingOneInput(bytes, n);
#ifdef RINGSPLASH_HAVE_NPY
    NpyOneInput(bytes, n);
#endif
  }
}

}  // namespace
}  // namespace ringsplash::fuzz

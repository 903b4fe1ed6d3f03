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

std::vector<fs::path> InputsOf(const std::string& target) {
  std::vector<fs::path> files;
  for (const char* dir : {"corpus", "regressions"}) {
    const fs::path root = fs::path(RINGSPLASH_FUZZ_DIR) / dir / target;
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

// Runs every input of `target`; returns how many ran.
size_t Replay(const std::string& target, TargetFn fn) {
  const std::vector<fs::path> files = InputsOf(target);
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

#ifdef RINGSPLASH_HAVE_NPY
TEST(FuzzCorpus, Npy) { EXPECT_GT(Replay("npy", NpyOneInput), 0u); }
#endif

// The targets must accept empty and tiny inputs (libFuzzer starts there).
TEST(FuzzCorpus, EmptyAndTinyInputs) {
  const uint8_t bytes[4] = {0xff, 0x00, 0x7f, 0x80};
  for (size_t n = 0; n <= sizeof bytes; ++n) {
    MaskParseOneInput(bytes, n);
    AttentionOneInput(bytes, n);
#ifdef RINGSPLASH_HAVE_NPY
    NpyOneInput(bytes, n);
#endif
  }
}

}  // namespace
}  // namespace ringsplash::fuzz

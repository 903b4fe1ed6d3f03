// Counter-based random fill (splitmix64 of the global element index).
#include "tools/random_fill.h"

#include <numeric>

#include "ringsplash/error.h"

namespace ringsplash::cli {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

void FillRandom(const Tensor& t, uint64_t seed, RandomStream stream, std::span<const int64_t> rows,
                int64_t global_seq) {
  const std::vector<int64_t>& shape = t.shape();
  Check(shape.size() >= 2 && shape[1] == static_cast<int64_t>(rows.size()),
        "FillRandom: tensor rows do not match the row list");
  int64_t inner = 1;
  for (size_t i = 2; i < shape.size(); ++i) inner *= shape[i];
  const uint64_t key = SplitMix64(seed ^ (static_cast<uint64_t>(stream) << 56));
  const TensorView view = t.view();
  const int64_t n = shape[1];
  for (int64_t b = 0; b < shape[0]; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t global_row = b * global_seq + rows[i];
      for (int64_t e = 0; e < inner; ++e) {
        const uint64_t h = SplitMix64(key + static_cast<uint64_t>(global_row * inner + e));
        // Top 24 bits -> [0, 1) exactly representable, then [-1, 1).
        const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
        StoreFromF32(view, (b * n + i) * inner + e, 2.0f * u - 1.0f);
      }
    }
  }
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

}  // namespace ringsplash::cli

// Uses the installed library through its public headers only: the README's
// "Library in a dozen lines" on a small problem, single device and on a
// 4-rank ring of threads, which must agree; and a wrong shape, which must
// be a ringsplash::Error naming the argument. Exit status 0 when all hold.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ringsplash/ringsplash.h"

using namespace ringsplash;

int main() {
  constexpr int64_t kB = 1, kS = 256, kH = 4, kHkv = 2, kD = 32;
  // Deterministic inputs in [-1, 1): no random generator needed.
  auto fill = [](std::vector<float>& v, int salt) {
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] =
          static_cast<float>(((i * 2654435761u + static_cast<size_t>(salt)) % 2048) / 1024.0 - 1.0);
    }
  };
  std::vector<float> q(kB * kS * kH * kD), k(kB * kS * kHkv * kD), v(k.size());
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  AttentionInputs in;
  in.q = TensorView::Contiguous(q.data(), DType::kF32, {kB, kS, kH, kD});
  in.k = TensorView::Contiguous(k.data(), DType::kF32, {kB, kS, kHkv, kD});
  in.v = TensorView::Contiguous(v.data(), DType::kF32, {kB, kS, kHkv, kD});
  AttentionOptions opt;
  opt.mask = Mask::Parse("causal & local:64,0");

  std::vector<float> out(q.size()), lse(kB * kH * kS), ring_out(q.size()), ring_lse(lse.size());
  auto view = [](std::vector<float>& x, std::vector<int64_t> shape) {
    return TensorView::Contiguous(x.data(), DType::kF32, std::move(shape));
  };
  AttentionForward(in, opt, view(out, {kB, kS, kH, kD}), view(lse, {kB, kH, kS}));
  RingRun run;
  run.num_ranks = 4;
  run.options.attention = opt;
  RingAttentionThreads(run, in, view(ring_out, {kB, kS, kH, kD}), view(ring_lse, {kB, kH, kS}));

  // Both are f32 computations of the same sums in different orders: within
  // a few 1e-6 of each other for inputs of O(1) (the test suite's bound is
  // 1e-5); a wrong slice or mask would differ by > 1e-2.
  double worst = 0, largest = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(out[i] - ring_out[i])));
    largest = std::max(largest, static_cast<double>(std::fabs(out[i])));
  }
  if (!(largest > 0) || worst > 1e-5 * largest) {
    std::fprintf(stderr, "consumer: ring and single device differ by %g (largest %g)\n", worst,
                 largest);
    return 1;
  }

  in.k = TensorView::Contiguous(k.data(), DType::kF32, {kB, kS, 3, kD});  // 3 does not divide 4
  try {
    AttentionForward(in, opt, view(out, {kB, kS, kH, kD}), view(lse, {kB, kH, kS}));
    std::fprintf(stderr, "consumer: a k with 3 heads for 4 query heads was accepted\n");
    return 1;
  } catch (const Error& e) {
    if (std::string(e.what()).rfind("k:", 0) != 0) {
      std::fprintf(stderr, "consumer: the error does not name k: %s\n", e.what());
      return 1;
    }
  }
  std::printf("consumer: ring = single device (max diff %.1e), shape errors name k\n", worst);
  return 0;
}

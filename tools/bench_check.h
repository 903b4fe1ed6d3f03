// The sampled correctness check of `bench --check` and `demo`: rows of the
// ring's results at sampled global positions against the single-device
// kernel (AttentionForward/AttentionBackward on one rank).
//
//   out, lse, dq: sampled query rows; the single-device kernel runs those
//                 rows only (q_positions = the sample) against all of k/v.
//   dk, dv:       sampled key/value rows; the single-device backward runs all
//                 query rows against those k/v rows only, given the
//                 single-device forward's out and lse over ALL of k/v (one
//                 full single-device forward, the check's main cost).
#ifndef RINGSPLASH_TOOLS_BENCH_CHECK_H_
#define RINGSPLASH_TOOLS_BENCH_CHECK_H_

#include <cstdint>
#include <span>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "tools/bench_run.h"

namespace ringsplash::cli {

// `count` positions spread evenly over [0, n), first and last included.
std::vector<int64_t> SampleRows(int64_t n, int64_t count);

// The ring's results at the sampled rows, f32 C order:
//   out [B, Rq, H, Dv], lse [B, H, Rq], dq [B, Rq, H, D],
//   dk [B, Rkv, Hkv, D], dv [B, Rkv, Hkv, Dv] (gradients only with backward).
struct SampledResults {
  std::vector<int64_t> q_rows, kv_rows;
  std::vector<float> out, lse, dq, dk, dv;
};

// This rank's results (shards at q_pos / kv_pos, as from the ring) for the
// sampled rows it holds.
struct LocalResults {
  std::span<const int64_t> q_pos, kv_pos;
  const Tensor* out = nullptr;  // [B, nq, H, Dv]
  const Tensor* lse = nullptr;  // [B, H, nq]
  const Tensor* dq = nullptr;   // [B, nq, H, D] or null
  const Tensor* dk = nullptr;   // [B, nkv, Hkv, D] or null
  const Tensor* dv = nullptr;   // [B, nkv, Hkv, Dv] or null
};

// Collective: every rank contributes the sampled rows it holds; all get all.
SampledResults GatherSamples(Communicator& comm, const BenchConfig& config,
                             const LocalResults& local);

// Recomputes the samples with the single-device kernel on `threads` threads
// and compares. Inputs are regenerated from the seed (random_fill.h).
CheckResult CheckSamples(const BenchConfig& config, const Mask& mask, const SampledResults& samples,
                         int threads);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_BENCH_CHECK_H_

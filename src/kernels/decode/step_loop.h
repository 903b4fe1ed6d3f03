// The loop both decoding steps share (micro.h DecodeStepFn: step_avx2.cc,
// step_avx512.cc): keys in chunks of kKeys (a vector of lanes), and within a
// chunk the entries in runs that read the same K and V rows (one kv head),
// up to kMaxDecodeShare at a time, each run handed to the step's Chunk as a
// compile-time G (so its loads of a row serve all G entries from registers);
// and the reordering around their word-pair mode for bf16 rows (InPairOrder).
// No intrinsics: includable from either step's translation unit. The chunk
// is a lambda of the including file's unnamed namespace, so every
// instantiation is private to that file and its instruction set.
#ifndef RINGSPLASH_KERNELS_DECODE_STEP_LOOP_H_
#define RINGSPLASH_KERNELS_DECODE_STEP_LOOP_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {

// For every chunk of keys [j0, j0 + rows) (rows <= kKeys) and every run of
// G entries from a.head + i that share their rows, ORs into the result
// chunk(std::integral_constant<int, G>, a.head + i, j0, rows): whether a
// logit of the run was not finite. Runs hold at most kMaxRun entries (only
// G <= kMaxRun is instantiated): kMaxRun = 1 for a chunk function that
// takes one entry at a time.
template <int kKeys, int kMaxRun = static_cast<int>(kMaxDecodeShare), typename ChunkFn>
RINGSPLASH_INLINE bool ForEachChunk(const DecodeArgs& a, const ChunkFn& chunk) {
  constexpr int kMaxShare = kMaxRun;  // entries done together
  static_assert(kMaxDecodeShare == 8 && kMaxShare >= 1 && kMaxShare <= 8,
                "ForEachChunk dispatches runs of 1 to 8 entries");
  bool bad = false;
  for (int64_t j0 = 0; j0 < a.keys; j0 += kKeys) {
    const int rows = static_cast<int>(std::min<int64_t>(kKeys, a.keys - j0));
    for (int64_t i = 0; i < a.heads;) {
      // The run of entries from i that read the same rows (one kv head).
      int g = 1;
      while (g < kMaxShare && i + g < a.heads && a.head[i + g].k == a.head[i].k &&
             a.head[i + g].v == a.head[i].v) {
        ++g;
      }
      const DecodeHead* h = a.head + i;
      switch (g) {
        case 1:
          bad |= chunk(std::integral_constant<int, 1>{}, h, j0, rows);
          break;
        case 2:
          if constexpr (kMaxShare >= 2) bad |= chunk(std::integral_constant<int, 2>{}, h, j0, rows);
          break;
        case 3:
          if constexpr (kMaxShare >= 3) bad |= chunk(std::integral_constant<int, 3>{}, h, j0, rows);
          break;
        case 4:
          if constexpr (kMaxShare >= 4) bad |= chunk(std::integral_constant<int, 4>{}, h, j0, rows);
          break;
        case 5:
          if constexpr (kMaxShare >= 5) bad |= chunk(std::integral_constant<int, 5>{}, h, j0, rows);
          break;
        case 6:
          if constexpr (kMaxShare >= 6) bad |= chunk(std::integral_constant<int, 6>{}, h, j0, rows);
          break;
        case 7:
          if constexpr (kMaxShare >= 7) bad |= chunk(std::integral_constant<int, 7>{}, h, j0, rows);
          break;
        case 8:
          if constexpr (kMaxShare >= 8) bad |= chunk(std::integral_constant<int, 8>{}, h, j0, rows);
          break;
      }
      i += g;
    }
  }
  return bad;
}

// The word-pair mode both steps have for bf16 rows: step(pairs) on a copy
// of `a` whose entries' q [d] and acc [dv] are per-thread copies reordered
// by to_pairs(x, n, y), and acc reordered back by from_pairs(y, n, x) after
// it (a few hundred floats per entry against its pass over the call's K
// and V rows). Entries must not share an acc (DecodeHead: one row of one
// head each). `step` is the including file's lambda, so each instantiation
// and its per-thread copies are private to that file.
template <typename Reorder, typename StepFn>
bool InPairOrder(const DecodeArgs& a, Reorder to_pairs, Reorder from_pairs, const StepFn& step) {
  thread_local std::vector<DecodeHead> heads;
  thread_local std::vector<float> q, acc;
  const auto n = static_cast<size_t>(a.heads);
  heads.assign(a.head, a.head + a.heads);
  q.resize(n * static_cast<size_t>(a.d));
  acc.resize(n * static_cast<size_t>(a.dv));
  for (size_t i = 0; i < n; ++i) {
    float* qi = q.data() + i * static_cast<size_t>(a.d);
    to_pairs(a.head[i].q, a.d, qi);
    heads[i].q = qi;
    heads[i].acc = acc.data() + i * static_cast<size_t>(a.dv);
    to_pairs(a.head[i].acc, a.dv, heads[i].acc);
  }
  DecodeArgs pairs = a;
  pairs.head = heads.data();
  const bool bad = step(pairs);
  for (size_t i = 0; i < n; ++i) from_pairs(heads[i].acc, a.dv, a.head[i].acc);
  return bad;
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_DECODE_STEP_LOOP_H_

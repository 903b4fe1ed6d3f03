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

// The number of entries from a.head + i that read the same rows as it (one
// kv head), up to kMaxDecodeShare: the run ForEachChunk takes together.
// Runs follow the entries' rows only, so a call's items (any number of
// whole kv groups) leave them as they are.
RINGSPLASH_INLINE int RunAt(const DecodeArgs& a, int64_t i) {
  int g = 1;
  while (g < kMaxDecodeShare && i + g < a.heads && a.head[i + g].k == a.head[i].k &&
         a.head[i + g].v == a.head[i].v) {
    ++g;
  }
  return g;
}

// For every chunk of keys [j0, j0 + rows) (rows <= kKeys) and every run of
// G entries from a.head + i that share their rows, ORs into the result
// chunk(std::integral_constant<int, G>, a.head + i, j0, rows): whether a
// logit of the run was not finite.
template <int kKeys, typename ChunkFn>
RINGSPLASH_INLINE bool ForEachChunk(const DecodeArgs& a, const ChunkFn& chunk) {
  constexpr int kMaxShare = static_cast<int>(kMaxDecodeShare);  // entries done together
  static_assert(kMaxShare == 8, "ForEachChunk dispatches runs of 1 to 8 entries");
  bool bad = false;
  for (int64_t j0 = 0; j0 < a.keys; j0 += kKeys) {
    const int rows = static_cast<int>(std::min<int64_t>(kKeys, a.keys - j0));
    for (int64_t i = 0; i < a.heads;) {
      const int g = RunAt(a, i);
      const DecodeHead* h = a.head + i;
      switch (g) {
        case 1:
          bad |= chunk(std::integral_constant<int, 1>{}, h, j0, rows);
          break;
        case 2:
          bad |= chunk(std::integral_constant<int, 2>{}, h, j0, rows);
          break;
        case 3:
          bad |= chunk(std::integral_constant<int, 3>{}, h, j0, rows);
          break;
        case 4:
          bad |= chunk(std::integral_constant<int, 4>{}, h, j0, rows);
          break;
        case 5:
          bad |= chunk(std::integral_constant<int, 5>{}, h, j0, rows);
          break;
        case 6:
          bad |= chunk(std::integral_constant<int, 6>{}, h, j0, rows);
          break;
        case 7:
          bad |= chunk(std::integral_constant<int, 7>{}, h, j0, rows);
          break;
        case 8:
          bad |= chunk(std::integral_constant<int, 8>{}, h, j0, rows);
          break;
      }
      i += g;
    }
  }
  return bad;
}

// The word-pair mode both steps have for bf16 rows: step(pairs) on a copy
// of `a` in which the entries of every run of G entries with in_pairs(G)
// (RunAt) have their q [d] and acc [dv] in per-thread copies reordered by
// to_pairs(x, n, y); after it, those accs are reordered back by
// from_pairs(y, n, x) (a few hundred floats per entry against its pass over
// the call's K and V rows). Entries must not share an acc (DecodeHead: one
// row of one head each). `step` is the including file's lambda, so each
// instantiation and its per-thread copies are private to that file.
template <typename Reorder, typename RunPredicate, typename StepFn>
bool InPairOrder(const DecodeArgs& a, Reorder to_pairs, Reorder from_pairs,
                 const RunPredicate& in_pairs, const StepFn& step) {
  // fn(e) for every entry e in a run with in_pairs. Runs are the same in
  // the copy `heads` below (the same rows), so each loop finds them.
  auto for_each_reordered = [&](auto&& fn) {
    for (int64_t i = 0; i < a.heads;) {
      const int g = RunAt(a, i);
      if (in_pairs(g)) {
        for (int64_t e = i; e < i + g; ++e) fn(static_cast<size_t>(e));
      }
      i += g;
    }
  };
  // Calls with no such run (GQA calls, where every run shares its rows)
  // reorder nothing: the step on `a` itself, without the copies.
  bool any = false;
  for_each_reordered([&any](size_t) { any = true; });
  if (!any) return step(a);
  thread_local std::vector<DecodeHead> heads;
  thread_local std::vector<float> q, acc;
  const auto n = static_cast<size_t>(a.heads);
  heads.assign(a.head, a.head + a.heads);
  q.resize(n * static_cast<size_t>(a.d));
  acc.resize(n * static_cast<size_t>(a.dv));
  for_each_reordered([&](size_t e) {
    float* qe = q.data() + e * static_cast<size_t>(a.d);
    to_pairs(a.head[e].q, a.d, qe);
    heads[e].q = qe;
    heads[e].acc = acc.data() + e * static_cast<size_t>(a.dv);
    to_pairs(a.head[e].acc, a.dv, heads[e].acc);
  });
  DecodeArgs pairs = a;
  pairs.head = heads.data();
  const bool bad = step(pairs);
  for_each_reordered([&](size_t e) { from_pairs(heads[e].acc, a.dv, a.head[e].acc); });
  return bad;
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_DECODE_STEP_LOOP_H_

// Seeded pseudo-random benchmark inputs, addressed by GLOBAL coordinates.
//
// Each value depends only on (seed, stream, batch, global row, inner index),
// never on which rank generates it: a rank fills exactly its shard's rows, and
// a checker fills any sample of rows, and both equal the same rows of the one
// global tensor — without generating or sending the whole of it.
#ifndef RINGSPLASH_TOOLS_RANDOM_FILL_H_
#define RINGSPLASH_TOOLS_RANDOM_FILL_H_

#include <cstdint>
#include <span>
#include <vector>

#include "ringsplash/tensor.h"

namespace ringsplash::cli {

// Streams: one per benchmark tensor, so q and k differ.
enum class RandomStream : uint32_t { kQ = 1, kK = 2, kV = 3, kDout = 4 };

// Fills `t` (C order [B, n, inner...], float dtype) with values in [-1, 1):
// row i of dim 1 is global row `rows[i]` of a [B, global_seq, inner...]
// tensor. Values are rounded to t's dtype.
void FillRandom(const Tensor& t, uint64_t seed, RandomStream stream, std::span<const int64_t> rows,
                int64_t global_seq);

// 0, 1, ..., n-1.
std::vector<int64_t> Iota(int64_t n);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_RANDOM_FILL_H_

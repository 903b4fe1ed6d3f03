// BlockMap, ClassifyTile, ClassifySegments, FillTileMask against brute force.
//
// Random masks are built together with an independent predicate written here
// from SPEC §3, so every claim of the code under test (empty / full tiles,
// runs, element masks) is checked element by element against formulas that
// do not call it.
#include "src/mask/block_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/mask.h"

namespace ringsplash::mask {
namespace {

using Pred = std::function<bool(int64_t head, int64_t q, int64_t kv)>;

// A mask and the same mask as an independent formula.
struct RefMask {
  Mask mask;
  Pred allowed;
  std::string text;
};

constexpr int64_t kHeads = 3;
// Dense leaves cover [0, kExtent)^2; random positions stay inside.
constexpr int64_t kExtent = 256;

class RandomMasks {
 public:
  explicit RandomMasks(uint64_t seed) : rng_(seed) {}

  int64_t Uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  std::mt19937_64& rng() { return rng_; }

  RefMask Structured() {
    switch (Uniform(0, 3)) {
      case 0:
        return {Mask::Full(), [](int64_t, int64_t, int64_t) { return true; }, "full"};
      case 1: {
        const int64_t off = Uniform(-30, 30);
        return {Mask::Causal(off), [off](int64_t, int64_t q, int64_t kv) { return q + off >= kv; },
                "causal:" + std::to_string(off)};
      }
      case 2: {
        std::optional<int64_t> l, r;
        if (Coin(0.8)) l = Uniform(0, 40);
        if (Coin(0.8)) r = Uniform(0, 40);
        const int64_t off = Uniform(-30, 30);
        return {Mask::Local(l, r, off),
                [=](int64_t, int64_t q, int64_t kv) {
                  return (!l || q + off - *l <= kv) && (!r || kv <= q + off + *r);
                },
                "local"};
      }
      default: {
        const int64_t c = Uniform(1, 50);
        return {Mask::ChunkedCausal(c),
                [c](int64_t, int64_t q, int64_t kv) {
                  // Chunks [k*c, (k+1)*c), also for negative positions.
                  const auto chunk = [c](int64_t x) { return (x - (((x % c) + c) % c)) / c; };
                  return chunk(q) == chunk(kv) && q >= kv;
                },
                "chunked:" + std::to_string(c)};
      }
    }
  }

  // Dense matrices with structure (so that empty and full tiles occur),
  // plus noise, or plain random bits of some density.
  RefMask Dense(int64_t heads) {
    const int64_t planes = std::max<int64_t>(heads, 1);
    auto values = std::make_shared<std::vector<uint8_t>>(planes * kExtent * kExtent);
    for (int64_t h = 0; h < planes; ++h) {
      const int style = static_cast<int>(Uniform(0, 2));
      const RefMask shape = Structured();
      const uint64_t threshold = rng_.max() / 100 * std::vector<uint64_t>{2, 50, 98}[Uniform(0, 2)];
      for (int64_t q = 0; q < kExtent; ++q) {
        for (int64_t kv = 0; kv < kExtent; ++kv) {
          const bool noise = (q * 7 + kv * 3) % 97 == 0;
          bool v = false;
          if (style == 0) v = shape.allowed(0, q, kv);
          if (style == 1) v = shape.allowed(0, q, kv) != noise;
          if (style == 2) v = rng_() < threshold;
          // Any non-zero byte means allowed.
          (*values)[(h * kExtent + q) * kExtent + kv] =
              v ? static_cast<uint8_t>(1 + (q ^ kv) % 200) : 0;
        }
      }
    }
    return {Mask::Dense(*values, heads, kExtent, kExtent),
            [values, heads](int64_t h, int64_t q, int64_t kv) {
              const int64_t p = heads == 0 ? 0 : h;
              // Positions outside the matrix are not allowed.
              if (q < 0 || q >= kExtent || kv < 0 || kv >= kExtent) return false;
              return (*values)[(p * kExtent + q) * kExtent + kv] != 0;
            },
            "dense"};
  }

  RefMask Leaf(bool allow_dense, bool allow_heads) {
    const int64_t kinds = allow_dense ? (allow_heads ? 7 : 5) : (allow_heads ? 5 : 4);
    const int64_t k = Uniform(0, kinds - 1);
    if (k < 4) return Structured();
    if (allow_dense && k == 4) return Dense(0);
    if (allow_dense && k == 5) return Dense(kHeads);
    // PerHead of head-independent (or kHeads-dependent dense) children.
    std::vector<Mask> masks;
    std::vector<Pred> preds;
    for (int64_t h = 0; h < kHeads; ++h) {
      RefMask c = allow_dense && Coin(0.3) ? Dense(Coin() ? 0 : kHeads) : Structured();
      masks.push_back(c.mask);
      preds.push_back(c.allowed);
    }
    return {Mask::PerHead(masks),
            [preds](int64_t h, int64_t q, int64_t kv) { return preds[h](h, q, kv); }, "perhead"};
  }

  RefMask Tree(int depth, bool allow_dense, bool allow_heads) {
    if (depth == 0 || Coin(0.4)) return Leaf(allow_dense, allow_heads);
    RefMask a = Tree(depth - 1, allow_dense, allow_heads);
    RefMask b = Tree(depth - 1, allow_dense, allow_heads);
    if (Coin()) {
      return {a.mask & b.mask,
              [fa = a.allowed, fb = b.allowed](int64_t h, int64_t q, int64_t kv) {
                return fa(h, q, kv) && fb(h, q, kv);
              },
              "(" + a.text + " & " + b.text + ")"};
    }
    return {a.mask | b.mask,
            [fa = a.allowed, fb = b.allowed](int64_t h, int64_t q, int64_t kv) {
              return fa(h, q, kv) || fb(h, q, kv);
            },
            "(" + a.text + " | " + b.text + ")"};
  }

  // Global positions of n rows in one of the layouts a ring step sees, or
  // arbitrary; all in [0, kExtent).
  std::vector<int64_t> Positions(int64_t n, int style) {
    std::vector<int64_t> p(n);
    switch (style) {
      case 0: {  // contiguous
        const int64_t base = Uniform(0, kExtent - n);
        std::iota(p.begin(), p.end(), base);
        break;
      }
      case 1: {  // zigzag-like: two contiguous runs, in either order
        const int64_t half = n / 2;
        const int64_t a = Uniform(0, (kExtent - n) / 2);
        const int64_t b = Uniform(a + half, kExtent - (n - half));
        for (int64_t i = 0; i < n; ++i) p[i] = i < half ? a + i : b + (i - half);
        if (Coin()) std::rotate(p.begin(), p.begin() + half, p.end());
        break;
      }
      case 2: {  // striped with step N
        const int64_t step = 2;
        const int64_t r = Uniform(0, step - 1);
        for (int64_t i = 0; i < n; ++i) p[i] = r + step * i;
        break;
      }
      default: {  // arbitrary distinct values, sorted (style 3) or not (style 4)
        std::vector<int64_t> all(kExtent);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        p.assign(all.begin(), all.begin() + n);
        if (style == 3) std::sort(p.begin(), p.end());
        break;
      }
    }
    return p;
  }

 private:
  std::mt19937_64 rng_;
};

// Kind of every tile [plane][qb][kvb] as claimed by a map's runs; checks the
// runs are well formed on the way.
std::vector<BlockKind> KindsFromRuns(const BlockMap& map, int64_t head_for_plane0) {
  const int64_t nqb = map.num_q_blocks(), nkvb = map.num_kv_blocks();
  const int64_t rows = map.by_column() ? nkvb : nqb;
  const int64_t minors = map.by_column() ? nqb : nkvb;
  std::vector<BlockKind> kinds(map.num_planes() * nqb * nkvb, BlockKind::kEmpty);
  for (int64_t plane = 0; plane < map.num_planes(); ++plane) {
    const int64_t head = map.num_planes() == 1 ? head_for_plane0 : plane;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t prev_end = 0;
      for (const BlockRun& run : map.Runs(head, r)) {
        EXPECT_LE(prev_end, run.begin);
        EXPECT_LT(run.begin, run.end);
        EXPECT_LE(run.end, minors);
        EXPECT_NE(run.kind, BlockKind::kEmpty);
        prev_end = run.end;
        for (int64_t b = run.begin; b < run.end; ++b) {
          const int64_t qb = map.by_column() ? b : r;
          const int64_t kvb = map.by_column() ? r : b;
          kinds[(plane * nqb + qb) * nkvb + kvb] = run.kind;
        }
      }
    }
  }
  return kinds;
}

// Tiles of each kind seen by CheckMaps, so the random tests can show they
// exercised every kind (a test that only ever saw partial tiles would prove
// little).
int64_t g_seen[3] = {0, 0, 0};

// Builds row and column maps and checks every claim against brute force.
void CheckMaps(const RefMask& m, const std::vector<int64_t>& q_pos,
               const std::vector<int64_t>& kv_pos, int64_t bq, int64_t bkv) {
  const BlockMap row = BlockMap::Build(m.mask, q_pos, kv_pos, bq, bkv, kHeads, false);
  const BlockMap col = BlockMap::Build(m.mask, q_pos, kv_pos, bq, bkv, kHeads, true);
  const int64_t planes = m.mask.num_heads() != 0 ? kHeads : 1;
  ASSERT_EQ(row.num_planes(), planes);
  ASSERT_EQ(col.num_planes(), planes);
  const auto sq = static_cast<int64_t>(q_pos.size());
  const auto skv = static_cast<int64_t>(kv_pos.size());
  const int64_t nqb = (sq + bq - 1) / bq, nkvb = (skv + bkv - 1) / bkv;
  ASSERT_EQ(row.num_q_blocks(), nqb);
  ASSERT_EQ(row.num_kv_blocks(), nkvb);

  // A head-independent map answers the same for every head.
  const std::vector<BlockKind> kinds = KindsFromRuns(row, 0);
  for (int64_t h = 1; h < kHeads && planes == 1; ++h) ASSERT_EQ(KindsFromRuns(row, h), kinds);
  // The column map is the transpose of the row map (same tile kinds).
  ASSERT_EQ(KindsFromRuns(col, 0), kinds) << "column map differs";

  int64_t counted[3] = {0, 0, 0};
  const int64_t ld = bkv + 3;  // wider than a tile: the padding must stay untouched
  std::vector<uint8_t> buf(bq * ld);
  for (int64_t plane = 0; plane < planes; ++plane) {
    for (int64_t qb = 0; qb < nqb; ++qb) {
      for (int64_t kvb = 0; kvb < nkvb; ++kvb) {
        const BlockKind kind = kinds[(plane * nqb + qb) * nkvb + kvb];
        ++counted[static_cast<int>(kind)];
        const int64_t rows = std::min(bq, sq - qb * bq), cols = std::min(bkv, skv - kvb * bkv);
        // Every head of the plane (all heads when head-independent).
        for (int64_t h = 0; h < kHeads; ++h) {
          if (planes != 1 && h != plane) continue;
          std::fill(buf.begin(), buf.end(), uint8_t{0xAB});
          if (kind == BlockKind::kPartial) row.FillPartial(h, qb, kvb, buf.data(), ld);
          int64_t allowed = 0;
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t j = 0; j < cols; ++j) {
              const bool a = m.allowed(h, q_pos[qb * bq + i], kv_pos[kvb * bkv + j]);
              allowed += a;
              if (kind == BlockKind::kPartial) {
                ASSERT_EQ(buf[i * ld + j], a ? 1 : 0) << "FillPartial head " << h << " tile " << qb
                                                      << "," << kvb << " elem " << i << "," << j;
              }
            }
            for (int64_t j = cols; j < ld && kind == BlockKind::kPartial; ++j) {
              ASSERT_EQ(buf[i * ld + j], 0xAB) << "FillPartial wrote past the tile";
            }
          }
          if (kind == BlockKind::kFull) {
            ASSERT_EQ(allowed, rows * cols) << "tile " << qb << "," << kvb << " claimed full";
          }
          if (kind == BlockKind::kEmpty) {
            ASSERT_EQ(allowed, 0) << "tile " << qb << "," << kvb << " claimed empty";
          }
        }
      }
    }
  }
  for (BlockKind k : {BlockKind::kEmpty, BlockKind::kPartial, BlockKind::kFull}) {
    g_seen[static_cast<int>(k)] += counted[static_cast<int>(k)];
    EXPECT_EQ(row.Count(k), counted[static_cast<int>(k)]);
    EXPECT_EQ(col.Count(k), counted[static_cast<int>(k)]);
  }
}

TEST(BlockMapTest, RandomMasksLayoutsAndBlockSizesAgreeWithBruteForce) {
  RandomMasks gen(20240611);
  const char* styles[] = {"contiguous", "zigzag", "striped", "sorted", "unsorted"};
  for (int iter = 0; iter < 250; ++iter) {
    const bool dense = iter % 3 == 0;
    const RefMask m = gen.Tree(3, dense, iter % 2 == 0);
    const int qs = static_cast<int>(gen.Uniform(0, 4)), ks = static_cast<int>(gen.Uniform(0, 4));
    const std::vector<int64_t> q_pos = gen.Positions(gen.Uniform(1, 110), qs);
    const std::vector<int64_t> kv_pos = gen.Positions(gen.Uniform(1, 110), ks);
    const int64_t bq = gen.Uniform(1, 40), bkv = gen.Uniform(1, 40);
    SCOPED_TRACE("iter " + std::to_string(iter) + " mask " + m.mask.ToString() + " q " +
                 styles[qs] + " kv " + styles[ks] + " bq=" + std::to_string(bq) +
                 " bkv=" + std::to_string(bkv) + " sq=" + std::to_string(q_pos.size()) +
                 " skv=" + std::to_string(kv_pos.size()));
    CheckMaps(m, q_pos, kv_pos, bq, bkv);
    if (HasFatalFailure()) return;
  }
  for (const int64_t seen : g_seen) EXPECT_GT(seen, 1000);
}

// The same positions with the same block size on both sides (what a
// single-device causal call sees), where many tiles are full or empty.
TEST(BlockMapTest, RandomStructuredMasksOnMatchingLayouts) {
  RandomMasks gen(7);
  for (int iter = 0; iter < 150; ++iter) {
    const RefMask m = gen.Tree(2, false, false);
    const int style = static_cast<int>(gen.Uniform(0, 4));
    const std::vector<int64_t> pos = gen.Positions(gen.Uniform(1, 120), style);
    const int64_t b = gen.Uniform(1, 24);
    SCOPED_TRACE("iter " + std::to_string(iter) + " mask " + m.mask.ToString() + " style " +
                 std::to_string(style) + " block " + std::to_string(b));
    CheckMaps(m, pos, pos, b, b);
    if (HasFatalFailure()) return;
  }
}

// For a single structured leaf the analytic classification is exact in both
// directions on integer ranges: kind == brute-force kind of the rectangle.
TEST(BlockMapTest, ClassifyTileIsExactForSingleStructuredLeaves) {
  RandomMasks gen(99);
  for (int iter = 0; iter < 4000; ++iter) {
    const RefMask m = gen.Structured();
    const int64_t q_lo = gen.Uniform(0, 80), q_hi = q_lo + gen.Uniform(0, 25);
    const int64_t kv_lo = gen.Uniform(0, 80), kv_hi = kv_lo + gen.Uniform(0, 25);
    int64_t allowed = 0;
    for (int64_t q = q_lo; q <= q_hi; ++q) {
      for (int64_t kv = kv_lo; kv <= kv_hi; ++kv) allowed += m.allowed(0, q, kv);
    }
    const int64_t total = (q_hi - q_lo + 1) * (kv_hi - kv_lo + 1);
    const BlockKind expected = allowed == 0       ? BlockKind::kEmpty
                               : allowed == total ? BlockKind::kFull
                                                  : BlockKind::kPartial;
    ASSERT_EQ(ClassifyTile(m.mask, 0, q_lo, q_hi, kv_lo, kv_hi), expected)
        << m.mask.ToString() << " q [" << q_lo << "," << q_hi << "] kv [" << kv_lo << "," << kv_hi
        << "]";
  }
}

// Compositions (and Dense leaves, scanned over the rectangle) may say
// partial when unsure, but never claim empty or full wrongly.
TEST(BlockMapTest, ClassifyTileClaimsAreSoundForCompositions) {
  RandomMasks gen(5);
  for (int iter = 0; iter < 1500; ++iter) {
    const RefMask m = gen.Tree(3, iter % 4 == 0, true);
    const int64_t head = gen.Uniform(0, kHeads - 1);
    const int64_t q_lo = gen.Uniform(0, 300), q_hi = q_lo + gen.Uniform(0, 40);
    const int64_t kv_lo = gen.Uniform(0, 300), kv_hi = kv_lo + gen.Uniform(0, 40);
    const BlockKind kind = ClassifyTile(m.mask, head, q_lo, q_hi, kv_lo, kv_hi);
    if (kind == BlockKind::kPartial) continue;
    for (int64_t q = q_lo; q <= q_hi; ++q) {
      for (int64_t kv = kv_lo; kv <= kv_hi; ++kv) {
        ASSERT_EQ(m.allowed(head, q, kv), kind == BlockKind::kFull)
            << m.mask.ToString() << " head " << head << " q [" << q_lo << "," << q_hi << "] kv ["
            << kv_lo << "," << kv_hi << "] at " << q << "," << kv;
      }
    }
  }
}

// Brute-force kind of `allowed` for head `head` on the integer rectangle
// [q_lo, q_hi] x [kv_lo, kv_hi]; stops as soon as the rectangle is known to
// be partial (most are), so large rectangles stay cheap.
BlockKind BruteKind(const Pred& allowed, int64_t head, int64_t q_lo, int64_t q_hi, int64_t kv_lo,
                    int64_t kv_hi) {
  bool any_in = false, any_out = false;
  for (int64_t q = q_lo; q <= q_hi && !(any_in && any_out); ++q) {
    for (int64_t kv = kv_lo; kv <= kv_hi && !(any_in && any_out); ++kv) {
      (allowed(head, q, kv) ? any_in : any_out) = true;
    }
  }
  if (!any_in) return BlockKind::kEmpty;
  return any_out ? BlockKind::kPartial : BlockKind::kFull;
}

// What `a & b` and `a | b` must claim given what the children are on the
// same rectangle: a tile either child rules out is skipped under & (SPEC
// §3; §6: the seed dropped every other mask under causal), one either child
// fills needs no element mask under |. Only these implications are checked:
// compositions may still say partial for, e.g., two partial children whose
// allowed sets do not meet (block_map.h: "may say partial when unsure").
// `seen` counts how often each implication was exercised: [0] & with an
// empty child, [1] & with two full ones, [2] | with a full child, [3] | with
// two empty ones.
void ExpectCompositionRules(BlockKind a, BlockKind b, BlockKind a_and_b, BlockKind a_or_b,
                            int64_t seen[4]) {
  if (a == BlockKind::kEmpty || b == BlockKind::kEmpty) {
    ++seen[0];
    EXPECT_EQ(a_and_b, BlockKind::kEmpty) << "an empty child must make & empty";
  }
  if (a == BlockKind::kFull && b == BlockKind::kFull) {
    ++seen[1];
    EXPECT_EQ(a_and_b, BlockKind::kFull) << "two full children must make & full";
  }
  if (a == BlockKind::kFull || b == BlockKind::kFull) {
    ++seen[2];
    EXPECT_EQ(a_or_b, BlockKind::kFull) << "a full child must make | full";
  }
  if (a == BlockKind::kEmpty && b == BlockKind::kEmpty) {
    ++seen[3];
    EXPECT_EQ(a_or_b, BlockKind::kEmpty) << "two empty children must make | empty";
  }
}

// The cases that matter most must each have come up: the draws of the
// tests below give over a thousand of each; 200 is far below that and far
// above zero.
void ExpectEveryRuleExercised(const int64_t seen[4]) {
  for (int i = 0; i < 4; ++i) EXPECT_GT(seen[i], 200) << "composition rule " << i;
}

// ClassifyTile of two structured leaves composed with & and |, in both
// operand orders, against the children brute-forced on the rectangle (a
// single leaf is classified exactly, which is checked here too).
TEST(BlockMapTest, ClassifyTileCompositionsKeepWhatEitherStructuredLeafDecides) {
  RandomMasks gen(31);
  int64_t seen[4] = {0, 0, 0, 0};
  int64_t one_empty_and = 0;  // & with exactly one empty child: the case the seed lost
  for (int iter = 0; iter < 4000; ++iter) {
    const RefMask a = gen.Structured(), b = gen.Structured();
    // Rectangles around the diagonal, where offsets in [-30, 30] and windows
    // of up to 40 make every leaf kind empty, full or partial.
    const int64_t q_lo = gen.Uniform(0, 80), q_hi = q_lo + gen.Uniform(0, 25);
    const int64_t kv_lo = gen.Uniform(0, 80), kv_hi = kv_lo + gen.Uniform(0, 25);
    SCOPED_TRACE(a.mask.ToString() + " , " + b.mask.ToString() + " q [" + std::to_string(q_lo) +
                 "," + std::to_string(q_hi) + "] kv [" + std::to_string(kv_lo) + "," +
                 std::to_string(kv_hi) + "]");
    const BlockKind ka = BruteKind(a.allowed, 0, q_lo, q_hi, kv_lo, kv_hi);
    const BlockKind kb = BruteKind(b.allowed, 0, q_lo, q_hi, kv_lo, kv_hi);
    ASSERT_EQ(ClassifyTile(a.mask, 0, q_lo, q_hi, kv_lo, kv_hi), ka);
    ASSERT_EQ(ClassifyTile(b.mask, 0, q_lo, q_hi, kv_lo, kv_hi), kb);
    one_empty_and += (ka == BlockKind::kEmpty) != (kb == BlockKind::kEmpty);
    const auto classify = [&](const Mask& m) {
      return ClassifyTile(m, 0, q_lo, q_hi, kv_lo, kv_hi);
    };
    ExpectCompositionRules(ka, kb, classify(a.mask & b.mask), classify(a.mask | b.mask), seen);
    ExpectCompositionRules(kb, ka, classify(b.mask & a.mask), classify(b.mask | a.mask), seen);
    if (HasFailure()) return;
  }
  ExpectEveryRuleExercised(seen);
  EXPECT_GT(one_empty_and, 200);
}

// The same implications one level up: whatever ClassifyTile claims for two
// subtrees (Dense and PerHead leaves included) survives composing them.
// Brute force cannot be the premise here: a composed child may itself be
// partial where its elements are all out (the looseness above).
TEST(BlockMapTest, ClassifyTileCompositionsKeepTheirSubtreesClaims) {
  RandomMasks gen(37);
  int64_t seen[4] = {0, 0, 0, 0};
  for (int iter = 0; iter < 1500; ++iter) {
    const RefMask a = gen.Tree(2, iter % 4 == 0, true), b = gen.Tree(2, iter % 4 == 1, true);
    const int64_t head = gen.Uniform(0, kHeads - 1);
    const int64_t q_lo = gen.Uniform(0, 300), q_hi = q_lo + gen.Uniform(0, 40);
    const int64_t kv_lo = gen.Uniform(0, 300), kv_hi = kv_lo + gen.Uniform(0, 40);
    SCOPED_TRACE(a.mask.ToString() + " , " + b.mask.ToString() + " head " + std::to_string(head) +
                 " q [" + std::to_string(q_lo) + "," + std::to_string(q_hi) + "] kv [" +
                 std::to_string(kv_lo) + "," + std::to_string(kv_hi) + "]");
    const auto classify = [&](const Mask& m) {
      return ClassifyTile(m, head, q_lo, q_hi, kv_lo, kv_hi);
    };
    ExpectCompositionRules(classify(a.mask), classify(b.mask), classify(a.mask & b.mask),
                           classify(a.mask | b.mask), seen);
    if (HasFailure()) return;
  }
  // Fewer draws and rarer decided subtrees than above (about 250 of the
  // rarest, two full subtrees): 50 of each still shows every rule was reached.
  for (const int64_t s : seen) EXPECT_GT(s, 50);
}

// BlockMap::Build classifies with its own postfix evaluator, not
// ClassifyTile: its tiles of a & b and a | b must obey the same rules, with
// each child brute-forced on the tile's [min, max] position rectangle (what
// the builder classifies; for strided or unsorted positions the rectangle
// holds more pairs than the tile, so that is all it can promise).
TEST(BlockMapTest, BlockMapCompositionsKeepWhatEitherStructuredLeafDecides) {
  RandomMasks gen(41);
  int64_t seen[4] = {0, 0, 0, 0};
  for (int iter = 0; iter < 300; ++iter) {
    const RefMask a = gen.Structured(), b = gen.Structured();
    const int qs = static_cast<int>(gen.Uniform(0, 4)), ks = static_cast<int>(gen.Uniform(0, 4));
    const std::vector<int64_t> q_pos = gen.Positions(gen.Uniform(1, 110), qs);
    const std::vector<int64_t> kv_pos = gen.Positions(gen.Uniform(1, 110), ks);
    const int64_t bq = gen.Uniform(1, 40), bkv = gen.Uniform(1, 40);
    SCOPED_TRACE("iter " + std::to_string(iter) + " " + a.mask.ToString() + " , " +
                 b.mask.ToString() + " styles " + std::to_string(qs) + "," + std::to_string(ks) +
                 " bq=" + std::to_string(bq) + " bkv=" + std::to_string(bkv));
    const BlockRanges qr = BlockRanges::Of(q_pos, bq), kr = BlockRanges::Of(kv_pos, bkv);
    const int64_t nqb = qr.num_blocks(), nkvb = kr.num_blocks();
    for (const bool by_column : {false, true}) {
      const std::vector<BlockKind> and_kinds =
          KindsFromRuns(BlockMap::Build(a.mask & b.mask, q_pos, kv_pos, bq, bkv, 1, by_column), 0);
      const std::vector<BlockKind> or_kinds =
          KindsFromRuns(BlockMap::Build(a.mask | b.mask, q_pos, kv_pos, bq, bkv, 1, by_column), 0);
      for (int64_t qb = 0; qb < nqb; ++qb) {
        for (int64_t kvb = 0; kvb < nkvb; ++kvb) {
          SCOPED_TRACE("tile " + std::to_string(qb) + "," + std::to_string(kvb) +
                       (by_column ? " column map" : " row map"));
          const auto kind = [&](const RefMask& m) {
            return BruteKind(m.allowed, 0, qr.lo[qb], qr.hi[qb], kr.lo[kvb], kr.hi[kvb]);
          };
          ExpectCompositionRules(kind(a), kind(b), and_kinds[qb * nkvb + kvb],
                                 or_kinds[qb * nkvb + kvb], seen);
          if (HasFailure()) return;
        }
      }
    }
  }
  ExpectEveryRuleExercised(seen);
}

// Causal, S = 4096, bq = bkv = 128, contiguous: nb = 32 blocks per side.
// Tile (i, j) spans q [128i, 128i+127], kv [128j, 128j+127]: full iff every
// kv <= every q iff 128j + 127 <= 128i iff j < i; empty iff 128j > 128i + 127
// iff j > i; partial iff i == j. So empty = full = nb(nb-1)/2 = 496 and
// partial = nb = 32, and row i is runs full [0, i), partial [i, i+1).
TEST(BlockMapTest, CausalSkipCounts) {
  std::vector<int64_t> pos(4096);
  std::iota(pos.begin(), pos.end(), 0);
  const BlockMap map = BlockMap::Build(Mask::Causal(), pos, pos, 128, 128, 8);
  const int64_t nb = 32;
  EXPECT_EQ(map.num_planes(), 1);
  EXPECT_EQ(map.Count(BlockKind::kEmpty), nb * (nb - 1) / 2);
  EXPECT_EQ(map.Count(BlockKind::kFull), nb * (nb - 1) / 2);
  EXPECT_EQ(map.Count(BlockKind::kPartial), nb);
  for (int64_t i = 0; i < nb; ++i) {
    const auto runs = map.Runs(5, i);
    ASSERT_EQ(runs.size(), i == 0 ? 1u : 2u);
    if (i > 0) {
      EXPECT_EQ(runs[0].begin, 0);
      EXPECT_EQ(runs[0].end, i);
      EXPECT_EQ(runs[0].kind, BlockKind::kFull);
    }
    EXPECT_EQ(runs.back().begin, i);
    EXPECT_EQ(runs.back().end, i + 1);
    EXPECT_EQ(runs.back().kind, BlockKind::kPartial);
  }
  // bq = 64, bkv = 128: q block i [64i, 64i+63] lies inside kv block i/2,
  // which is partial; kv blocks j < i/2 (floor) are full, the rest empty.
  const BlockMap half = BlockMap::Build(Mask::Causal(), pos, pos, 64, 128, 1);
  int64_t full = 0;
  for (int64_t i = 0; i < 64; ++i) full += i / 2;
  EXPECT_EQ(half.Count(BlockKind::kFull), full);
  EXPECT_EQ(half.Count(BlockKind::kPartial), 64);
  EXPECT_EQ(half.Count(BlockKind::kEmpty), 64 * 32 - full - 64);
}

// Sliding window local:w,0 (kv in [q - w, q]), w = 512, S = 4096, blocks of
// 128. Row i (q [128i, 128i+127]): kv block j is empty iff 128j + 127 <
// 128i - 512 (j <= i - 5) or j > i; full iff 128j >= 128i + 127 - 512 and
// 128j + 127 <= 128i, i.e. i - 3 <= j <= i - 1. So rows i >= 4 have
// w / bkv + 1 = 5 non-empty tiles: 3 full, 2 partial (j = i - 4 and j = i).
TEST(BlockMapTest, SlidingWindowTouchesAboutWOverBkvPlusOneTilesPerRow) {
  std::vector<int64_t> pos(4096);
  std::iota(pos.begin(), pos.end(), 0);
  const int64_t w = 512, b = 128, nb = 32;
  const BlockMap map = BlockMap::Build(Mask::Local(w, 0), pos, pos, b, b, 1);
  int64_t full = 0, partial = 0;
  for (int64_t i = 0; i < nb; ++i) {
    int64_t non_empty = 0;
    for (const BlockRun& run : map.Runs(0, i)) non_empty += run.end - run.begin;
    EXPECT_EQ(non_empty, std::min<int64_t>(i, w / b) + 1) << "row " << i;
    full += std::max<int64_t>(0, std::min<int64_t>(i, 3));
    partial += i >= 4 ? 2 : 1;
  }
  EXPECT_EQ(map.Count(BlockKind::kFull), full);
  EXPECT_EQ(map.Count(BlockKind::kPartial), partial);
  EXPECT_EQ(map.Count(BlockKind::kEmpty), nb * nb - full - partial);
}

std::vector<uint8_t> DenseCausal(int64_t s) {
  std::vector<uint8_t> v(s * s);
  for (int64_t q = 0; q < s; ++q) {
    for (int64_t kv = 0; kv < s; ++kv) v[q * s + kv] = kv <= q;
  }
  return v;
}

// A dense causal matrix on contiguous positions with bq == bkv: every
// diagonal tile is the same lower triangle, so exactly one unique pattern.
TEST(BlockMapTest, DenseCausalDeduplicatesToOnePattern) {
  const int64_t s = 512, b = 64, nb = s / b;
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  const Mask dense = Mask::Dense(DenseCausal(s), 0, s, s);
  const BlockMap map = BlockMap::Build(dense, pos, pos, b, b, 2);
  EXPECT_EQ(map.num_unique_partial_tiles(), 1);
  EXPECT_EQ(map.Count(BlockKind::kPartial), nb);
  EXPECT_EQ(map.Count(BlockKind::kFull), nb * (nb - 1) / 2);
  EXPECT_EQ(map.Count(BlockKind::kEmpty), nb * (nb - 1) / 2);
  std::vector<uint8_t> tile(b * b);
  for (int64_t i = 0; i < nb; ++i) {
    map.FillPartial(1, i, i, tile.data(), b);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t c = 0; c < b; ++c) ASSERT_EQ(tile[r * b + c], c <= r ? 1 : 0);
    }
  }
  // bq = 32, bkv = 64: q block i is the upper or lower half of kv block i/2's
  // diagonal triangle: two patterns.
  EXPECT_EQ(BlockMap::Build(dense, pos, pos, 32, 64, 1).num_unique_partial_tiles(), 2);
  // Mixed with a structured leaf: classified exactly, not de-duplicated.
  const BlockMap mixed = BlockMap::Build(dense & Mask::Local(100, std::nullopt), pos, pos, b, b, 1);
  EXPECT_EQ(mixed.num_unique_partial_tiles(), 0);
  EXPECT_EQ(BlockMap::Build(Mask::Causal(), pos, pos, b, b, 1).num_unique_partial_tiles(), 0);
}

TEST(BlockMapTest, ClassifySegments) {
  EXPECT_EQ(ClassifySegments(0, 3, 4, 9), BlockKind::kEmpty);
  EXPECT_EQ(ClassifySegments(5, 9, 0, 4), BlockKind::kEmpty);
  EXPECT_EQ(ClassifySegments(2, 2, 2, 2), BlockKind::kFull);
  EXPECT_EQ(ClassifySegments(2, 2, 3, 3), BlockKind::kEmpty);
  EXPECT_EQ(ClassifySegments(0, 3, 3, 9), BlockKind::kPartial);  // meet at id 3
  EXPECT_EQ(ClassifySegments(1, 1, 1, 2), BlockKind::kPartial);
  EXPECT_EQ(ClassifySegments(0, 9, 2, 2), BlockKind::kPartial);
  EXPECT_EQ(Combine(BlockKind::kFull, ClassifySegments(0, 1, 2, 3)), BlockKind::kEmpty);
  EXPECT_EQ(Combine(BlockKind::kFull, ClassifySegments(4, 4, 4, 4)), BlockKind::kFull);
  EXPECT_EQ(Combine(BlockKind::kPartial, ClassifySegments(4, 4, 4, 4)), BlockKind::kPartial);
}

TEST(BlockMapTest, BlockRangesAreRaggedMinMax) {
  const std::vector<int64_t> v = {5, 1, 9, -3, 7, 7, 100};
  const BlockRanges r = BlockRanges::Of(v, 3);
  ASSERT_EQ(r.num_blocks(), 3);
  EXPECT_EQ(r.lo, (std::vector<int64_t>{1, -3, 100}));
  EXPECT_EQ(r.hi, (std::vector<int64_t>{9, 7, 100}));
  const std::vector<int32_t> seg = {2, 2, 3, 0};
  const BlockRanges s = BlockRanges::Of(seg, 2);
  EXPECT_EQ(s.lo, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(s.hi, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(BlockRanges::Of(std::vector<int64_t>{}, 4).num_blocks(), 0);
  EXPECT_THROW(BlockRanges::Of(v, 0), Error);
}

TEST(BlockMapTest, BuildRejectsBadArguments) {
  const std::vector<int64_t> pos = {0, 1, 2};
  EXPECT_THROW(BlockMap::Build(Mask::Causal(), pos, pos, 0, 4, 1), Error);
  EXPECT_THROW(BlockMap::Build(Mask::Causal(), pos, pos, 4, -1, 1), Error);
  EXPECT_THROW(BlockMap::Build(Mask::Causal(), pos, pos, 4, 4, 0), Error);
  const Mask two = Mask::PerHead({Mask::Causal(), Mask::Full()});
  EXPECT_THROW(BlockMap::Build(two, pos, pos, 4, 4, 3), Error);
  EXPECT_EQ(BlockMap::Build(two, pos, pos, 4, 4, 2).num_planes(), 2);
}

TEST(BlockMapTest, EmptySequencesGiveEmptyMaps) {
  const std::vector<int64_t> none, pos = {0, 1, 2};
  const BlockMap a = BlockMap::Build(Mask::Causal(), none, pos, 4, 4, 1);
  EXPECT_EQ(a.num_q_blocks(), 0);
  EXPECT_EQ(a.Count(BlockKind::kPartial) + a.Count(BlockKind::kFull), 0);
  const BlockMap b = BlockMap::Build(Mask::Causal(), pos, none, 4, 4, 1);
  EXPECT_EQ(b.num_kv_blocks(), 0);
  EXPECT_TRUE(b.Runs(0, 0).empty());
}

// FillTileMask on the largest tiles the kernels use, sorted and unsorted kv
// positions (two code paths), against the independent predicate.
TEST(BlockMapTest, FillTileMaskLargeTiles) {
  RandomMasks gen(3);
  const int64_t rows = 256, cols = 512, ld = 520;
  std::vector<uint8_t> out(rows * ld);
  for (int iter = 0; iter < 24; ++iter) {
    const RefMask m = gen.Tree(3, iter % 3 == 0, true);
    const int64_t head = gen.Uniform(0, kHeads - 1);
    std::vector<int64_t> q(rows), kv(cols);
    for (auto& x : q) x = gen.Uniform(0, kExtent - 1);
    for (auto& x : kv) x = gen.Uniform(0, kExtent - 1);
    if (iter % 2 == 0) std::sort(kv.begin(), kv.end());
    if (iter % 4 == 0) std::iota(kv.begin(), kv.end(), -60);  // contiguous, partly outside
    if (iter % 4 == 0 && m.mask.has_dense()) std::iota(kv.begin(), kv.end(), 0);
    std::fill(out.begin(), out.end(), uint8_t{0xCD});
    FillTileMask(m.mask, head, q, kv, out.data(), ld);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        ASSERT_EQ(out[i * ld + j], m.allowed(head, q[i], kv[j]) ? 1 : 0)
            << m.mask.ToString() << " iter " << iter << " at " << i << "," << j;
      }
      for (int64_t j = cols; j < ld; ++j) ASSERT_EQ(out[i * ld + j], 0xCD);
    }
  }
}

// A 1,048,576-token causal map is built analytically: memory is O(blocks)
// (a few runs per row), never O(S^2), and the build takes milliseconds
// (about 10-20 ms optimised, a few hundred under ASan + UBSan at -O0). The
// time bound is deliberately loose and uses this thread's CPU time, so a
// busy shared machine cannot make it flaky; the memory bound is the real
// check: an O(Sq * Skv)-byte or per-element build could not meet it at all.
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

TEST(BlockMapTest, MillionTokenCausalMapIsSmallAndFast) {
  const int64_t s = int64_t{1} << 20;
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  for (const auto& [bq, bkv] : {std::pair<int64_t, int64_t>{128, 128}, {64, 128}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = ThreadCpuSeconds();
    const BlockMap map = BlockMap::Build(Mask::Causal(), pos, pos, bq, bkv, 32);
    const double cpu = ThreadCpuSeconds() - cpu0;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "[ info ] 1M causal map bq=" << bq << " bkv=" << bkv << ": " << secs * 1e3
              << " ms wall, " << cpu * 1e3 << " ms cpu, " << map.memory_bytes() << " bytes\n";
    EXPECT_LT(cpu, 2.0);
    const int64_t nqb = s / bq, nkvb = s / bkv;
    EXPECT_LT(map.memory_bytes(), size_t{64} << 20);
    // ~2 runs (12 bytes) + a row offset (8) per row, 24 bytes of positions
    // per block: well under 128 bytes per q or kv block.
    EXPECT_LT(map.memory_bytes(), static_cast<size_t>(128 * (nqb + nkvb)));
    // Counts from the closed forms: q block i meets kv blocks j < i*bq/bkv
    // fully when bq divides bkv (floor(i * bq / bkv)), one partial, rest empty.
    int64_t full = 0;
    for (int64_t i = 0; i < nqb; ++i) full += i * bq / bkv;
    EXPECT_EQ(map.Count(BlockKind::kFull), full);
    EXPECT_EQ(map.Count(BlockKind::kPartial), nqb);
    EXPECT_EQ(map.Count(BlockKind::kEmpty), nqb * nkvb - full - nqb);
    // The column map (backward dK/dV) is built the same way.
    const BlockMap col = BlockMap::Build(Mask::Causal(), pos, pos, bq, bkv, 32, true);
    EXPECT_EQ(col.Count(BlockKind::kFull), full);
    EXPECT_LT(col.memory_bytes(), static_cast<size_t>(128 * (nqb + nkvb)));
  }
}

// The long-context mask users run most, a causal sliding window, composed
// with & (two leaves, classified per tile in O(1)): the same O(blocks)
// metadata as plain causal at 1M tokens, and the counts of its closed form.
TEST(BlockMapTest, MillionTokenCausalWindowMapIsSmallAndFast) {
  const int64_t s = int64_t{1} << 20, b = 128, window = 4096;
  std::vector<int64_t> pos(s);
  std::iota(pos.begin(), pos.end(), 0);
  const Mask mask = Mask::Causal() & Mask::Local(window, 0);
  const double cpu0 = ThreadCpuSeconds();
  const BlockMap map = BlockMap::Build(mask, pos, pos, b, b, 32);
  const double cpu = ThreadCpuSeconds() - cpu0;
  std::cout << "[ info ] 1M causal & local:4096,0 map: " << cpu * 1e3 << " ms cpu, "
            << map.memory_bytes() << " bytes\n";
  EXPECT_LT(cpu, 2.0);
  const int64_t n = s / b;
  EXPECT_LT(map.memory_bytes(), static_cast<size_t>(128 * (n + n)));
  // Row r of q block i sees keys [128 i + r - 4096, 128 i + r]: kv block
  // i - 32 partly (keys >= its r-th), blocks i - 31 .. i - 1 fully, block i
  // up to the diagonal. The first 32 q blocks have only i full blocks.
  const int64_t reach = window / b;  // 32
  int64_t full = 0, partial = 0;
  for (int64_t i = 0; i < n; ++i) {
    full += std::min(i, reach - 1);
    partial += i >= reach ? 2 : 1;
  }
  EXPECT_EQ(map.Count(BlockKind::kFull), full);
  EXPECT_EQ(map.Count(BlockKind::kPartial), partial);
  EXPECT_EQ(map.Count(BlockKind::kEmpty), n * n - full - partial);
  const BlockMap col = BlockMap::Build(mask, pos, pos, b, b, 32, true);
  EXPECT_EQ(col.Count(BlockKind::kFull), full);
  EXPECT_EQ(col.Count(BlockKind::kPartial), partial);
  EXPECT_LT(col.memory_bytes(), static_cast<size_t>(128 * (n + n)));
}

}  // namespace
}  // namespace ringsplash::mask

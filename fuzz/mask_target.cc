// Fuzz target: the mask text parser (Mask::Parse) and what the kernels build
// from a parsed mask (the block map).
//
// The input is the mask text. A stable hash of it picks the rest (sequence
// lengths, block sizes, how positions are laid out and where they start,
// up to 2^62), so a corpus file always means the same test.
// Properties (anything else aborts):
//   - Parse either throws ringsplash::Error (never another exception) or
//     returns a mask;
//   - ToString() of a parsed mask parses back, is a fixed point, and the
//     re-parsed mask allows exactly the same (q, kv) pairs;
//   - BlockMap::Build (row- and column-major) agrees with Mask::Allowed on
//     every element: tiles outside every run have no allowed pair, full
//     tiles only allowed pairs, partial tiles (FillPartial) the exact bits;
//     tile counts add up; FillTileMask equals Allowed.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "fuzz/fuzz_util.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "src/mask/block_map.h"

namespace ringsplash::fuzz {
namespace {

using mask::BlockKind;
using mask::BlockMap;
using mask::BlockRun;

// Texts longer than this are skipped: parsing is linear, and longer texts
// only make deeper trees of the same terms.
constexpr size_t kMaxText = 512;

// Deterministic pseudo-random stream from the text's hash (splitmix64).
class HashStream {
 public:
  explicit HashStream(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int64_t Range(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }

 private:
  uint64_t state_;
};

// Global positions of `n` rows starting at `base`: contiguous, strided like
// the striped layout, two chunks like zigzag, or sorted with random gaps.
std::vector<int64_t> Positions(HashStream& hs, int64_t n, int64_t base) {
  std::vector<int64_t> pos(static_cast<size_t>(n));
  const int64_t kind = hs.Range(0, 3);
  const int64_t step = hs.Range(2, 5);
  for (int64_t i = 0; i < n; ++i) {
    switch (kind) {
      case 0:
        pos[i] = base + i;
        break;
      case 1:
        pos[i] = base + step * i + 1;
        break;
      case 2:
        pos[i] = i < n / 2 ? base + i : base + 3 * n + i;
        break;
      default:
        pos[i] = (i == 0 ? base : pos[i - 1]) + hs.Range(i == 0 ? 0 : 1, 9);
        break;
    }
  }
  return pos;
}

// The kind of tile (qb, kvb) according to the map's runs.
BlockKind TileKind(const BlockMap& map, int64_t qb, int64_t kvb) {
  const int64_t row = map.by_column() ? kvb : qb;
  const int64_t col = map.by_column() ? qb : kvb;
  for (const BlockRun& run : map.Runs(0, row)) {
    if (col >= run.begin && col < run.end) return run.kind;
  }
  return BlockKind::kEmpty;
}

void CheckBlockMap(const Mask& mask, const std::vector<int64_t>& qp,
                   const std::vector<int64_t>& kvp, int64_t bq, int64_t bkv, bool by_column,
                   const std::vector<uint8_t>& allowed, const std::string& text) {
  const auto sq = static_cast<int64_t>(qp.size());
  const auto skv = static_cast<int64_t>(kvp.size());
  const BlockMap map = BlockMap::Build(mask, qp, kvp, bq, bkv, /*num_query_heads=*/1, by_column);
  const int64_t nqb = (sq + bq - 1) / bq;
  const int64_t nkvb = (skv + bkv - 1) / bkv;
  FuzzCheck(map.num_q_blocks() == nqb && map.num_kv_blocks() == nkvb, "mask '", text,
            "': block map has the wrong number of blocks");
  FuzzCheck(
      map.Count(BlockKind::kEmpty) + map.Count(BlockKind::kPartial) + map.Count(BlockKind::kFull) ==
          nqb * nkvb * map.num_planes(),
      "mask '", text, "': tile counts do not add up to the number of tiles");
  std::vector<uint8_t> tile(static_cast<size_t>(bq * bkv));
  for (int64_t qb = 0; qb < nqb; ++qb) {
    for (int64_t kvb = 0; kvb < nkvb; ++kvb) {
      const BlockKind kind = TileKind(map, qb, kvb);
      const int64_t rows = std::min(bq, sq - qb * bq);
      const int64_t cols = std::min(bkv, skv - kvb * bkv);
      if (kind == BlockKind::kPartial) map.FillPartial(0, qb, kvb, tile.data(), bkv);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          const bool want = allowed[static_cast<size_t>((qb * bq + i) * skv + kvb * bkv + j)] != 0;
          const bool got = kind == BlockKind::kFull ? true
                           : kind == BlockKind::kEmpty
                               ? false
                               : tile[static_cast<size_t>(i * bkv + j)] != 0;
          FuzzCheck(got == want, "mask '", text, "': ", by_column ? "column" : "row",
                    "-major block map tile (", qb, ", ", kvb, ") kind ", static_cast<int>(kind),
                    " says pair (q ", qp[qb * bq + i], ", kv ", kvp[kvb * bkv + j], ") is ",
                    got ? "allowed" : "masked", ", Mask::Allowed says ",
                    want ? "allowed" : "masked");
        }
      }
    }
  }
}

}  // namespace

int MaskParseOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxText) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Mask mask;
  try {
    mask = Mask::Parse(text);
  } catch (const Error&) {
    return 0;
  } catch (const std::exception& e) {
    FuzzCheck(false, "Mask::Parse threw a non-ringsplash exception: ", e.what());
  }
  FuzzCheck(mask.num_heads() == 0 && !mask.has_dense(), "mask '", text,
            "': text masks must be head-independent and structured");

  const std::string canon = mask.ToString();
  Mask again;
  try {
    again = Mask::Parse(canon);
  } catch (const Error& e) {
    FuzzCheck(false, "mask '", text, "': canonical text '", canon, "' does not parse: ", e.what());
  }
  FuzzCheck(again.ToString() == canon, "mask '", text, "': canonical text '", canon,
            "' re-parses to '", again.ToString(), "'");

  HashStream hs(Fnv1a(text));
  const int64_t sq = hs.Range(1, 70);
  const int64_t skv = hs.Range(1, 70);
  const int64_t bases[] = {0, hs.Range(0, 1000), int64_t{1} << 40, (int64_t{1} << 62) - 1000};
  const int64_t q_base = bases[hs.Range(0, 3)];
  const int64_t kv_base = hs.Range(0, 3) == 0 ? bases[hs.Range(0, 3)] : q_base;
  const std::vector<int64_t> qp = Positions(hs, sq, q_base);
  const std::vector<int64_t> kvp = Positions(hs, skv, kv_base);

  // The element predicate, and its agreement with the re-parsed mask and
  // with the vectorised tile filler.
  std::vector<uint8_t> allowed(static_cast<size_t>(sq * skv));
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t j = 0; j < skv; ++j) {
      const bool a = mask.Allowed(0, qp[i], kvp[j]);
      allowed[static_cast<size_t>(i * skv + j)] = a ? 1 : 0;
      FuzzCheck(a == again.Allowed(0, qp[i], kvp[j]), "mask '", text, "' and its canonical text '",
                canon, "' disagree at (q ", qp[i], ", kv ", kvp[j], ")");
    }
  }
  std::vector<uint8_t> filled(static_cast<size_t>(sq * skv), 2);
  mask::FillTileMask(mask, 0, qp, kvp, filled.data(), skv);
  FuzzCheck(filled == allowed, "mask '", text, "': FillTileMask disagrees with Mask::Allowed");

  const int64_t blocks[] = {16, 32, 48};
  const int64_t bq = blocks[hs.Range(0, 2)];
  const int64_t bkv = blocks[hs.Range(0, 2)];
  CheckBlockMap(mask, qp, kvp, bq, bkv, /*by_column=*/false, allowed, text);
  CheckBlockMap(mask, qp, kvp, bq, bkv, /*by_column=*/true, allowed, text);
  return 0;
}

}  // namespace ringsplash::fuzz

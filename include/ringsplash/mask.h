// Attention masks (SPEC §3) as composable values.
//
// A Mask is a predicate on GLOBAL token positions: allowed(head, q_pos, kv_pos).
// Callers (the single-device kernel, every ring step) pass the global positions
// of the rows they hold, so a mask means the same thing whatever the sharding.
// Masks are immutable and cheap to copy (shared tree of nodes).
#ifndef RINGSPLASH_MASK_H_
#define RINGSPLASH_MASK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ringsplash {

namespace mask_detail {
struct Node;
}

class Mask {
 public:
  // Default-constructed mask is Full().
  Mask();

  static Mask Full();
  // allowed iff q_pos + offset >= kv_pos.
  static Mask Causal(int64_t offset = 0);
  // allowed iff q_pos + offset - left <= kv_pos <= q_pos + offset + right;
  // an unset side is unbounded. left/right must be >= 0.
  static Mask Local(std::optional<int64_t> left, std::optional<int64_t> right, int64_t offset = 0);
  // allowed iff q_pos / chunk == kv_pos / chunk and q_pos >= kv_pos; chunk > 0.
  // (Chunks are [k * chunk, (k + 1) * chunk), i.e. floor division, should a
  // position ever be negative.)
  static Mask ChunkedCausal(int64_t chunk);
  // A given boolean matrix indexed by global positions: `values` is row-major
  // [sq, skv] (heads == 0: same for every head) or [heads, sq, skv].
  // Non-zero bytes mean allowed. Allowed() is false for positions outside
  // [0, sq) x [0, skv); the API layer rejects such positions up front.
  static Mask Dense(std::vector<uint8_t> values, int64_t heads, int64_t sq, int64_t skv);
  // A dense mask holding only some query rows: `values` is row-major
  // [rows.size(), skv] (heads == 0) or [heads, rows.size(), skv], and its row
  // r gives the allowed keys of global query position rows[r] (rows strictly
  // increasing, >= 0). For a ring rank, its own rows — rows =
  // LayoutPositions(layout, Sq, rank, N) (ring.h) — so a rank holds
  // Sq/N x Skv bytes, never the global Sq x Skv. A call whose query
  // positions are not all among `rows` is an Error at the API.
  static Mask DenseRows(std::vector<uint8_t> values, int64_t heads, std::vector<int64_t> rows,
                        int64_t skv);
  // Head h uses masks[h]; masks.size() must equal the number of query heads.
  static Mask PerHead(std::vector<Mask> masks);
  // Text form used on the command line: terms `full`, `causal`, `causal:OFF`,
  // `local:L,R`, `local:L,R,OFF` (empty L or R is unbounded, offsets may be
  // negative), `chunked:C`, joined with `&` (binds tighter) and `|`.
  // Parentheses group. Whitespace around terms, operators and arguments is
  // ignored. Throws Error naming the bad term.
  static Mask Parse(std::string_view text);

  friend Mask operator&(const Mask& a, const Mask& b);
  friend Mask operator|(const Mask& a, const Mask& b);

  // Element predicate. `head` is the query head (ignored unless head-dependent).
  bool Allowed(int64_t head, int64_t q_pos, int64_t kv_pos) const;

  // 0 if the mask is the same for every head; otherwise the number of query
  // heads it was built for (PerHead size, Dense heads), which must equal H.
  int64_t num_heads() const;
  // For Dense leaves: the global [sq, skv] extent it covers (0, 0 if none;
  // the smallest extent when several Dense leaves are combined; for
  // DenseRows, sq is its last row + 1 — rows below it may still be missing:
  // FirstUncoveredQuery).
  // Positions outside a Dense extent are a caller error checked at the API.
  int64_t dense_sq() const;
  int64_t dense_skv() const;
  bool has_dense() const;
  // Whether some Dense leaf is a DenseRows one (holds only listed rows).
  bool has_dense_rows() const;
  // With Dense leaves: the first of `q_positions` that some Dense leaf holds
  // no row for (outside [0, sq) of Mask::Dense, not among the rows of
  // Mask::DenseRows); nullopt when every position is held (or no Dense leaf).
  std::optional<int64_t> FirstUncoveredQuery(std::span<const int64_t> q_positions) const;

  // Canonical text (Parse(ToString()) is equivalent for text-expressible masks).
  std::string ToString() const;

  const mask_detail::Node& node() const { return *node_; }

 private:
  explicit Mask(std::shared_ptr<const mask_detail::Node> node);
  std::shared_ptr<const mask_detail::Node> node_;
};

}  // namespace ringsplash

#endif  // RINGSPLASH_MASK_H_

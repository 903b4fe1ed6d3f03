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
  // the smallest extent when several Dense leaves are combined).
  // Positions outside a Dense extent are a caller error checked at the API.
  int64_t dense_sq() const;
  int64_t dense_skv() const;
  bool has_dense() const;

  // Canonical text (Parse(ToString()) is equivalent for text-expressible masks).
  std::string ToString() const;

  const mask_detail::Node& node() const { return *node_; }

 private:
  explicit Mask(std::shared_ptr<const mask_detail::Node> node);
  std::shared_ptr<const mask_detail::Node> node_;
};

}  // namespace ringsplash

#endif  // RINGSPLASH_MASK_H_

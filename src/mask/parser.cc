// Mask::Parse — the command-line text form of masks.
//
// Grammar (whitespace around terms, operators and arguments is ignored):
//   expr    := and ('|' and)*
//   and     := primary ('&' primary)*
//   primary := term | '(' expr ')'
//   term    := 'full' | 'causal' [':' INT] | 'local' ':' [INT] ',' [INT] [',' INT]
//            | 'chunked' ':' INT
// INT is an optionally signed decimal int64. Every error quotes the whole
// text and the offending term or operator, and says what was expected.
#include <charconv>
#include <string>
#include <string_view>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/mask.h"

namespace ringsplash {
namespace {

constexpr const char* kExpectedTerms = "full, causal[:OFF], local:L,R[,OFF], chunked:C";

std::string_view Trim(std::string_view s) {
  const auto is_space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

enum class TokenKind { kTerm, kAnd, kOr, kOpen, kClose, kEnd };

struct Token {
  TokenKind kind;
  std::string_view text;
};

// Bounds that keep parsing, evaluation and destruction of the mask tree (all
// recursive) far from the stack limit; real masks use a handful of terms.
constexpr int64_t kMaxDepth = 64;
constexpr int64_t kMaxTerms = 256;

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) { Tokenize(); }

  Mask Parse() {
    int64_t terms = 0;
    for (const Token& t : tokens_) terms += t.kind == TokenKind::kTerm;
    if (terms > kMaxTerms) {
      Reject("too many terms (", terms, "; at most ", kMaxTerms, ")");
    }
    if (tokens_.size() == 1) {
      Reject("empty mask text (expected terms ", kExpectedTerms, " joined with & and |)");
    }
    Mask mask = ParseOr();
    if (Peek().kind == TokenKind::kClose) Reject("unmatched ')'");
    return mask;
  }

 private:
  template <typename... Args>
  [[noreturn]] void Reject(Args&&... parts) const {
    // Quote long texts only in part: the message is one line on a terminal.
    constexpr size_t kQuoteMax = 120;
    const std::string_view quoted = text_.substr(0, kQuoteMax);
    Fail("mask '", quoted, text_.size() > kQuoteMax ? "..." : "",
         "': ", std::forward<Args>(parts)...);
  }

  void Tokenize() {
    size_t i = 0;
    while (i < text_.size()) {
      const char c = text_[i];
      TokenKind kind = TokenKind::kTerm;
      if (c == '&') kind = TokenKind::kAnd;
      if (c == '|') kind = TokenKind::kOr;
      if (c == '(') kind = TokenKind::kOpen;
      if (c == ')') kind = TokenKind::kClose;
      if (kind != TokenKind::kTerm) {
        tokens_.push_back({kind, text_.substr(i, 1)});
        ++i;
        continue;
      }
      const size_t end = text_.find_first_of("&|()", i);
      const std::string_view term =
          Trim(text_.substr(i, end == std::string_view::npos ? std::string_view::npos : end - i));
      if (!term.empty()) tokens_.push_back({TokenKind::kTerm, term});
      i = end == std::string_view::npos ? text_.size() : end;
    }
    tokens_.push_back({TokenKind::kEnd, {}});
  }

  const Token& Peek() const { return tokens_[pos_]; }
  const Token* Previous() const { return pos_ == 0 ? nullptr : &tokens_[pos_ - 1]; }

  Mask ParseOr() {
    Mask mask = ParseAnd();
    while (Peek().kind == TokenKind::kOr) {
      ++pos_;
      mask = mask | ParseAnd();
    }
    return mask;
  }

  Mask ParseAnd() {
    Mask mask = ParsePrimary();
    while (Peek().kind == TokenKind::kAnd) {
      ++pos_;
      mask = mask & ParsePrimary();
    }
    // Two operands side by side, e.g. "causal (full)".
    if (Peek().kind == TokenKind::kTerm || Peek().kind == TokenKind::kOpen) {
      Reject("expected '&' or '|' between '", Previous()->text, "' and '", Peek().text, "'");
    }
    return mask;
  }

  Mask ParsePrimary() {
    const Token tok = Peek();
    const Token* prev = Previous();
    const bool after_operator =
        prev != nullptr && (prev->kind == TokenKind::kAnd || prev->kind == TokenKind::kOr);
    switch (tok.kind) {
      case TokenKind::kTerm:
        ++pos_;
        return ParseTerm(tok.text);
      case TokenKind::kOpen: {
        ++pos_;
        // The parser recurses once per '(': bound it so hostile text is an
        // Error, not a stack overflow.
        if (++depth_ > kMaxDepth) Reject("parentheses nested deeper than ", kMaxDepth);
        Mask mask = ParseOr();
        --depth_;
        if (Peek().kind != TokenKind::kClose) Reject("unclosed '(' (expected ')')");
        ++pos_;
        return mask;
      }
      case TokenKind::kAnd:
      case TokenKind::kOr:
        if (after_operator) {
          Reject("missing term between '", prev->text, "' and '", tok.text, "' (expected ",
                 kExpectedTerms, ")");
        }
        Reject("missing term before '", tok.text, "' (expected ", kExpectedTerms, ")");
      case TokenKind::kClose:
        if (after_operator) {
          Reject("missing term after '", prev->text, "' (expected ", kExpectedTerms, ")");
        }
        if (prev != nullptr && prev->kind == TokenKind::kOpen) Reject("empty parentheses '()'");
        Reject("unmatched ')'");
      case TokenKind::kEnd:
        if (after_operator) {
          Reject("missing term after trailing '", prev->text, "' (expected ", kExpectedTerms, ")");
        }
        Reject("unclosed '(' (expected a term and ')')");
    }
    Reject("internal parser error");
  }

  // Parses one optionally signed decimal int64 argument of `term`;
  // `expected` says what the term wants there (for the message).
  int64_t ParseInt(std::string_view term, std::string_view arg, const char* what,
                   const char* expected = "an optionally signed decimal integer") const {
    arg = Trim(arg);
    if (arg.empty()) Reject("term '", term, "': missing ", what, " (expected ", expected, ")");
    std::string_view digits = arg;
    if (digits.front() == '+') digits.remove_prefix(1);
    int64_t value = 0;
    const char* first = digits.data();
    const char* last = digits.data() + digits.size();
    const auto [ptr, ec] = std::from_chars(first, last, value);
    if (ec == std::errc::result_out_of_range) {
      Reject("term '", term, "': ", what, " '", arg, "' is out of range for a 64-bit integer");
    }
    if (ec != std::errc() || ptr != last || digits.empty() ||
        (digits.front() == '-' && arg.front() == '+')) {
      Reject("term '", term, "': ", what, " '", arg, "' is not an integer (expected ", expected,
             ")");
    }
    return value;
  }

  Mask ParseTerm(std::string_view term) {
    const size_t colon = term.find(':');
    const std::string_view name = Trim(term.substr(0, colon));
    std::vector<std::string_view> args;
    if (colon != std::string_view::npos) {
      std::string_view rest = term.substr(colon + 1);
      for (;;) {
        const size_t comma = rest.find(',');
        args.push_back(Trim(rest.substr(0, comma)));
        if (comma == std::string_view::npos) break;
        rest = rest.substr(comma + 1);
      }
    }
    const bool has_args = colon != std::string_view::npos;

    if (name == "full") {
      if (has_args) Reject("term '", term, "': full takes no arguments (expected full)");
      return Mask::Full();
    }
    if (name == "causal") {
      if (!has_args) return Mask::Causal();
      if (args.size() != 1) {
        Reject("term '", term, "': causal takes one offset (expected causal or causal:OFF)");
      }
      return Mask::Causal(ParseInt(term, args[0], "offset"));
    }
    if (name == "local") {
      if (!has_args || args.size() < 2 || args.size() > 3) {
        Reject("term '", term,
               "': local needs window sides L,R and an optional offset (expected local:L,R or "
               "local:L,R,OFF; an empty L or R is unbounded)");
      }
      std::optional<int64_t> left;
      std::optional<int64_t> right;
      constexpr const char* kSide = "a decimal integer >= 0, or nothing for unbounded";
      if (!args[0].empty()) left = ParseInt(term, args[0], "left side L", kSide);
      if (!args[1].empty()) right = ParseInt(term, args[1], "right side R", kSide);
      if ((left && *left < 0) || (right && *right < 0)) {
        Reject("term '", term, "': window sides L and R must be >= 0, got L=",
               left ? std::to_string(*left) : "(unbounded)",
               " R=", right ? std::to_string(*right) : "(unbounded)");
      }
      const int64_t offset = args.size() == 3 ? ParseInt(term, args[2], "offset") : 0;
      return Mask::Local(left, right, offset);
    }
    if (name == "chunked") {
      if (!has_args || args.size() != 1) {
        Reject("term '", term, "': chunked needs one chunk length (expected chunked:C)");
      }
      const int64_t chunk = ParseInt(term, args[0], "chunk length C", "a decimal integer > 0");
      if (chunk <= 0) Reject("term '", term, "': chunk length must be > 0, got ", chunk);
      return Mask::ChunkedCausal(chunk);
    }
    // "causal local:1,1": two terms with the operator missing between them.
    if (Trim(term).find_first_of(" \t") != std::string_view::npos) {
      Reject("unknown term '", term, "' (terms are joined with '&' or '|'; expected ",
             kExpectedTerms, ")");
    }
    Reject("unknown term '", term, "' (expected ", kExpectedTerms, ")");
  }

  std::string_view text_;
  std::vector<Token> tokens_;
  int64_t depth_ = 0;
  size_t pos_ = 0;
};

}  // namespace

Mask Mask::Parse(std::string_view text) { return Parser(text).Parse(); }

}  // namespace ringsplash

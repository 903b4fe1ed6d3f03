// Mask::Parse: every term form, precedence, parentheses, whitespace, and
// malformed inputs (each must raise Error quoting the offending piece).
// Expected predicates are written here from SPEC §3.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/mask.h"

namespace ringsplash {
namespace {

using Pred = std::function<bool(int64_t q, int64_t kv)>;

void ExpectParsesTo(const std::string& text, const Pred& expected) {
  SCOPED_TRACE("text: '" + text + "'");
  const Mask m = Mask::Parse(text);
  for (int64_t q = 0; q < 48; ++q) {
    for (int64_t kv = 0; kv < 48; ++kv) {
      ASSERT_EQ(m.Allowed(0, q, kv), expected(q, kv)) << "q=" << q << " kv=" << kv;
    }
  }
}

TEST(MaskParserTest, EveryTermForm) {
  ExpectParsesTo("full", [](int64_t, int64_t) { return true; });
  ExpectParsesTo("causal", [](int64_t q, int64_t kv) { return q >= kv; });
  ExpectParsesTo("causal:5", [](int64_t q, int64_t kv) { return q + 5 >= kv; });
  ExpectParsesTo("causal:-5", [](int64_t q, int64_t kv) { return q - 5 >= kv; });
  ExpectParsesTo("causal:+2", [](int64_t q, int64_t kv) { return q + 2 >= kv; });
  ExpectParsesTo("local:3,4", [](int64_t q, int64_t kv) { return q - 3 <= kv && kv <= q + 4; });
  ExpectParsesTo("local:3,4,-6",
                 [](int64_t q, int64_t kv) { return q - 6 - 3 <= kv && kv <= q - 6 + 4; });
  ExpectParsesTo("local:0,0,10", [](int64_t q, int64_t kv) { return kv == q + 10; });
  ExpectParsesTo("local:,4", [](int64_t q, int64_t kv) { return kv <= q + 4; });
  ExpectParsesTo("local:3,", [](int64_t q, int64_t kv) { return q - 3 <= kv; });
  ExpectParsesTo("local:,", [](int64_t, int64_t) { return true; });
  ExpectParsesTo("local:,,-2", [](int64_t, int64_t) { return true; });
  ExpectParsesTo("local:2,,-7", [](int64_t q, int64_t kv) { return q - 7 - 2 <= kv; });
  ExpectParsesTo("chunked:16", [](int64_t q, int64_t kv) { return q / 16 == kv / 16 && q >= kv; });
  ExpectParsesTo("chunked:1", [](int64_t q, int64_t kv) { return q == kv; });
}

TEST(MaskParserTest, AndBindsTighterThanOr) {
  // local:0,0 | full & causal:-3 is local:0,0 | (full & causal:-3): the
  // diagonal is allowed. Read as (local:0,0 | full) & causal:-3 it would not be.
  const Pred tight = [](int64_t q, int64_t kv) { return kv == q || kv <= q - 3; };
  ExpectParsesTo("local:0,0 | full & causal:-3", tight);
  ExpectParsesTo("full & causal:-3 | local:0,0", tight);
  ExpectParsesTo("(local:0,0 | full) & causal:-3",
                 [](int64_t q, int64_t kv) { return kv <= q - 3; });
  ExpectParsesTo("((causal))", [](int64_t q, int64_t kv) { return q >= kv; });
  ExpectParsesTo("causal & local:4,0 & chunked:8",
                 [](int64_t q, int64_t kv) { return kv <= q && q - 4 <= kv && q / 8 == kv / 8; });
  ExpectParsesTo("causal:-40 | local:0,0 | local:0,0,3",
                 [](int64_t q, int64_t kv) { return kv <= q - 40 || kv == q || kv == q + 3; });
}

TEST(MaskParserTest, WhitespaceIsIgnored) {
  const Pred expected = [](int64_t q, int64_t kv) {
    return q - 3 >= kv || (q - 2 <= kv && kv <= q + 4);
  };
  ExpectParsesTo("causal:-3|local:2,4", expected);
  ExpectParsesTo("  causal : -3 |\tlocal: 2 , 4\n", expected);
  ExpectParsesTo(" ( causal:-3 ) | ( local:2,4 ) ", expected);
}

TEST(MaskParserTest, BriefExampleMessage) {
  try {
    Mask::Parse("causal&locl:3,4");
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "mask 'causal&locl:3,4': unknown term 'locl:3,4' (expected full, causal[:OFF], "
              "local:L,R[,OFF], chunked:C)");
  }
}

struct BadInput {
  std::string text;
  std::string needle;  // must appear in the message (the bad term or operator)
};

TEST(MaskParserTest, MalformedInputsRaiseErrorsNamingTheProblem) {
  const std::vector<BadInput> cases = {
      {"", "empty"},
      {"   ", "empty"},
      {"locl:3,4", "'locl:3,4'"},
      {"Causal", "'Causal'"},
      {"dense", "'dense'"},
      {"causal causal", "'causal causal'"},
      {"causal local:1,1", "terms are joined with '&' or '|'"},
      {"causal&", "'&'"},
      {"causal |", "'|'"},
      {"|causal", "'|'"},
      {"causal&&full", "'&'"},
      {"causal&|full", "'|'"},
      {"causal:", "'causal:'"},
      {"causal:abc", "'causal:abc'"},
      {"causal:3x", "'causal:3x'"},
      {"causal:1,2", "'causal:1,2'"},
      {"causal:- 1", "'causal:- 1'"},
      {"causal:99999999999999999999", "'99999999999999999999'"},
      {"causal:-99999999999999999999", "out of range"},
      {"local", "'local'"},
      {"local:3", "'local:3'"},
      {"local:1,2,3,4", "'local:1,2,3,4'"},
      {"local:1,2,", "'local:1,2,'"},
      {"local:-1,2", "'local:-1,2'"},
      {"local:1,-2", "'local:1,-2'"},
      {"local:1,2,99999999999999999999", "'99999999999999999999'"},
      {"local:a,2", "'local:a,2'"},
      {"local:a,2", "expected a decimal integer >= 0, or nothing for unbounded"},
      {"chunked", "'chunked'"},
      {"chunked:", "'chunked:'"},
      {"chunked:0", "'chunked:0'"},
      {"chunked:-4", "'chunked:-4'"},
      {"chunked:4,4", "'chunked:4,4'"},
      {"chunked:abc", "'abc' is not an integer (expected a decimal integer > 0)"},
      {"full:1", "'full:1'"},
      {"(causal", "'('"},
      {"causal)", "')'"},
      {"()", "'()'"},
      {"causal & ()", "'()'"},
      {"causal (full)", "'('"},
      {"(causal) full", "'full'"},
      {"causal & (local:1,1 |)", "'|'"},
  };
  for (const BadInput& c : cases) {
    SCOPED_TRACE("text: '" + c.text + "'");
    try {
      Mask::Parse(c.text);
      ADD_FAILURE() << "expected Error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("mask '" + c.text + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
    }
  }
}

TEST(MaskParserTest, ErrorsSayWhatWasExpected) {
  auto message = [](const std::string& text) -> std::string {
    try {
      Mask::Parse(text);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message("causal&").find("expected"), std::string::npos);
  EXPECT_NE(message("local:3").find("local:L,R"), std::string::npos);
  EXPECT_NE(message("chunked:0").find("> 0"), std::string::npos);
  EXPECT_NE(message("local:-1,2").find(">= 0"), std::string::npos);
  EXPECT_NE(message("causal:1,2").find("causal:OFF"), std::string::npos);
}

}  // namespace
}  // namespace ringsplash

namespace ringsplash {
namespace {

// Hostile text must be an Error, never a stack overflow: the parser recurses
// per '(' and the mask tree is walked recursively (reviewer's finding: 200k
// nested parentheses crashed the CLI with SIGSEGV).
TEST(MaskParserTest, DeepNestingAndHugeTextsAreErrorsNotCrashes) {
  const std::string deep = std::string(200000, '(') + "causal" + std::string(200000, ')');
  try {
    Mask::Parse(deep);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("nested deeper than"), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 400u) << "the message quotes long text only in part";
  }
  std::string many = "causal";
  for (int i = 0; i < 100000; ++i) many += "&full";
  EXPECT_THROW(Mask::Parse(many), Error);
  // Moderate nesting still parses and means what it says.
  const Mask m = Mask::Parse(std::string(32, '(') + "causal" + std::string(32, ')'));
  EXPECT_TRUE(m.Allowed(0, 5, 5));
  EXPECT_FALSE(m.Allowed(0, 5, 6));
}

}  // namespace
}  // namespace ringsplash

// Helpers shared by the fuzz targets: a reader that turns fuzzer bytes into
// structured choices (never reads past the input; yields zeros once it runs
// out, so every input decodes to something), and FuzzCheck, which reports a
// broken property and aborts — libFuzzer records the input as a crash, and
// the corpus replay test (tests/reliability/fuzz_corpus_test.cc) fails.
#ifndef RINGSPLASH_FUZZ_FUZZ_UTIL_H_
#define RINGSPLASH_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "ringsplash/error.h"

namespace ringsplash::fuzz {

// Aborts with a message unless `condition` holds. Used only for properties
// the library promises (a clean Error or a correct result), never for input
// the library is entitled to reject.
template <typename... Args>
void FuzzCheck(bool condition, Args&&... parts) {
  if (condition) return;
  std::ostringstream os;
  (os << ... << std::forward<Args>(parts));
  std::fprintf(stderr, "FUZZ PROPERTY VIOLATED: %s\n", os.str().c_str());
  std::fflush(stderr);
  std::abort();
}

// Runs `call`; returns true if it threw ringsplash::Error (message in *msg).
// Any other exception is a violation.
template <typename F>
bool Throws(F&& call, std::string* msg) {
  try {
    call();
  } catch (const Error& e) {
    *msg = e.what();
    return true;
  } catch (const std::exception& e) {
    FuzzCheck(false, "non-ringsplash exception: ", e.what());
  }
  return false;
}

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t remaining() const { return size_ - pos_; }

  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  bool Bool() { return (U8() & 1) != 0; }
  // True with probability about num/256 for random bytes.
  bool Chance(int num) { return U8() < num; }
  // Uniform-ish integer in [lo, hi] (inclusive); lo when exhausted.
  int64_t Range(int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    const uint64_t raw = span <= 256 ? U8() : span <= 65536 ? U16() : U32();
    return lo + static_cast<int64_t>(raw % span);
  }
  // One of the given values.
  template <typename T, size_t N>
  T Pick(const T (&values)[N]) {
    return values[Range(0, static_cast<int64_t>(N) - 1)];
  }
  // Raw bits as a float (NaN, inf, denormals included).
  float RawFloat() {
    const uint32_t bits = U32();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// FNV-1a: a stable hash (std::hash is not) to derive configuration from text
// inputs, so a corpus file means the same thing on every machine.
inline uint64_t Fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace ringsplash::fuzz

#endif  // RINGSPLASH_FUZZ_FUZZ_UTIL_H_

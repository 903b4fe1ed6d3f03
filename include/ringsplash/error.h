// ringsplash::Error — the one exception type thrown at the public API.
//
// Every message names the argument at fault, what was expected and what was
// given, so a user can act on it without reading the source.
#ifndef RINGSPLASH_ERROR_H_
#define RINGSPLASH_ERROR_H_

#include <exception>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>

namespace ringsplash {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Builds a message from streamable parts: Fail("q: expected 4 dims, got ", n).
template <typename... Args>
[[noreturn]] void Fail(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw Error(os.str());
}

// A message part made only if the message is: Fail formats its parts, and
// Check calls Fail only when the check fails, so a part that takes work to
// make (a shape string) costs nothing on the path that passes, e.g.
//   Check(ok, "expected ", Lazy([&] { return ShapeText(d); }), ", got ", view);
template <typename Make>
struct LazyPart {
  Make make;
  friend std::ostream& operator<<(std::ostream& os, const LazyPart& part) {
    return os << part.make();
  }
};
template <typename Make>
LazyPart<Make> Lazy(Make make) {
  return LazyPart<Make>{std::move(make)};
}

// Throws Error with the given parts unless `condition` holds.
template <typename... Args>
void Check(bool condition, Args&&... args) {
  if (!condition) Fail(std::forward<Args>(args)...);
}

// What a failed rank tells its peers about exception `e`: e.what(), except
// that std::bad_alloc itself (whose what() is only "std::bad_alloc"; not its
// subclasses, which say more) says that memory ran out.
inline std::string FailureReason(const std::exception& e) {
  if (typeid(e) == typeid(std::bad_alloc)) return "out of memory (std::bad_alloc)";
  return e.what();
}

}  // namespace ringsplash

#endif  // RINGSPLASH_ERROR_H_

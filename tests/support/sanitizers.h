// Whether this test binary runs under AddressSanitizer or ThreadSanitizer:
// they add shadow memory, quarantines and slowdowns, so tests that measure
// resident memory or rates skip or shrink there. Likewise under an emulator
// (kEmulated).
#ifndef RINGSPLASH_TESTS_SUPPORT_SANITIZERS_H_
#define RINGSPLASH_TESTS_SUPPORT_SANITIZERS_H_

namespace ringsplash::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// Whether this test binary runs under an emulator (qemu-user, the aarch64
// cross build's tests): an emulator translates each kind of loop at its own
// cost, so rates measured there compare nothing the hardware does.
#if defined(RINGSPLASH_TESTS_EMULATED)
inline constexpr bool kEmulated = true;
#else
inline constexpr bool kEmulated = false;
#endif

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_SANITIZERS_H_

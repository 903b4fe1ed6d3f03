// CPU detection and the KernelPath functions of ringsplash/attention.h.
#include "src/kernels/micro/cpu_features.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"

namespace ringsplash {
namespace kernels {
namespace {

#if defined(__x86_64__)

// XCR0: which register states the OS saves on context switch. AVX-512 needs
// SSE (bit 1), AVX (bit 2), opmask (5), ZMM_Hi256 (6) and Hi16_ZMM (7).
uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Linux enables the 8 KiB AMX tile state per process, on request; the
// permission then holds for all of the process's threads (AmxTilesPermitted).
bool RequestTileData() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;  // no known way to ask: leave AMX off
#endif
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  // Vendor string "AuthenticAMD" is ebx, edx, ecx.
  const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
  f.hw_prefetch_streams = amd;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool fma = (ecx >> 12) & 1;
  const bool osxsave = (ecx >> 27) & 1;
  const bool avx = (ecx >> 28) & 1;
  const bool f16c = (ecx >> 29) & 1;
  if (!osxsave || !avx) return f;
  // The OS must save the ymm state (XCR0 bits 1, 2) for AVX2, and also the
  // opmask and zmm state (bits 5, 6, 7) for AVX-512.
  const uint64_t xcr0 = ReadXcr0();
  const uint64_t kYmmState = (1u << 1) | (1u << 2);
  const uint64_t kZmmState = kYmmState | (1u << 5) | (1u << 6) | (1u << 7);
  if ((xcr0 & kYmmState) != kYmmState) return f;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  const bool avx2 = (ebx >> 5) & 1;
  const bool amx_bf16 = (edx >> 22) & 1;
  const bool amx_tile = (edx >> 24) & 1;
  f.avx2 = avx2 && fma && f16c;
  if ((xcr0 & kZmmState) != kZmmState) return f;
  const bool avx512f = (ebx >> 16) & 1;
  const bool avx512dq = (ebx >> 17) & 1;
  const bool avx512bw = (ebx >> 30) & 1;
  const bool avx512vl = (ebx >> 31) & 1;
  f.avx512 = f.avx2 && avx512f && avx512dq && avx512bw && avx512vl;
  unsigned max_sub = eax;
  if (f.avx512 && max_sub >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    f.avx512_bf16 = (eax >> 5) & 1;
  }
  f.fast_bf16_dot = f.avx512_bf16 && amd;
  const uint64_t kTileState = (uint64_t{1} << 17) | (uint64_t{1} << 18);
  f.amx = f.avx512_bf16 && amx_bf16 && amx_tile && (xcr0 & kTileState) == kTileState;
  return f;
}

#else

// Not x86-64 (aarch64, ...): the AVX kernels are not built (CMakeLists.txt),
// so only the portable path exists.
CpuFeatures Detect() { return CpuFeatures{}; }

#endif

bool Supported(KernelPath path) {
  const CpuFeatures& f = DetectCpuFeatures();
  switch (path) {
    case KernelPath::kPortable:
      return true;
    case KernelPath::kAvx2:
      return f.avx2;
    case KernelPath::kAvx512:
      return f.avx512;
    case KernelPath::kAvx512Bf16:
      return f.avx512_bf16;
    case KernelPath::kAmx:
      return f.amx;
    case KernelPath::kAuto:
      return true;
  }
  return false;
}

}  // namespace

namespace {

const CpuFeatures& RealFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

const CpuFeatures* g_override = nullptr;  // ScopedCpuFeaturesForTesting

}  // namespace

const CpuFeatures& DetectCpuFeatures() {
  return g_override != nullptr ? *g_override : RealFeatures();
}

ScopedCpuFeaturesForTesting::ScopedCpuFeaturesForTesting(const CpuFeatures& features)
    : features_(features), previous_(g_override) {
  const CpuFeatures& real = RealFeatures();
  // Each set also needs the narrower ones, as on every real CPU.
  features_.avx2 = features.avx2 && real.avx2;
  features_.avx512 = features.avx512 && real.avx512 && features_.avx2;
  features_.avx512_bf16 = features.avx512_bf16 && real.avx512_bf16 && features_.avx512;
  features_.amx = features.amx && real.amx && features_.avx512_bf16;
  g_override = &features_;
}

ScopedCpuFeaturesForTesting::~ScopedCpuFeaturesForTesting() { g_override = previous_; }

bool AmxTilesPermitted() {
#if defined(__x86_64__)
  // The real CPU's: a test's override must not decide this once for the
  // whole process.
  static const bool permitted = RealFeatures().amx && RequestTileData();
  return permitted;
#else
  return false;
#endif
}

}  // namespace kernels

const char* KernelPathName(KernelPath path) {
  switch (path) {
    case KernelPath::kAuto:
      return "auto";
    case KernelPath::kPortable:
      return "portable";
    case KernelPath::kAvx2:
      return "avx2";
    case KernelPath::kAvx512:
      return "avx512";
    case KernelPath::kAvx512Bf16:
      return "avx512_bf16";
    case KernelPath::kAmx:
      return "amx";
  }
  return "unknown";
}

namespace {

// Every path but kAuto, narrowest first (the order SupportedKernelPaths keeps):
// the one list a new path is added to, besides KernelPathName.
constexpr KernelPath kPaths[] = {KernelPath::kPortable, KernelPath::kAvx2, KernelPath::kAvx512,
                                 KernelPath::kAvx512Bf16, KernelPath::kAmx};

// "portable|avx2|..." — every path's name, for error messages.
std::string PathNames() {
  std::string names;
  for (KernelPath p : kPaths) {
    names += names.empty() ? "" : "|";
    names += KernelPathName(p);
  }
  return names;
}

}  // namespace

KernelPath ParseKernelPath(const std::string& text) {
  if (text == KernelPathName(KernelPath::kAuto)) return KernelPath::kAuto;
  for (KernelPath p : kPaths) {
    if (text == KernelPathName(p)) return p;
  }
  Fail("kernel path: expected one of auto|", PathNames(), ", got '", text, "'");
}

std::vector<KernelPath> SupportedKernelPaths() {
  std::vector<KernelPath> paths;
  for (KernelPath p : kPaths) {
    if (kernels::Supported(p)) paths.push_back(p);
  }
  return paths;
}

namespace {

// "portable, avx2, ..." — the paths this CPU supports, for error messages.
std::string SupportedNames() {
  std::string names;
  for (KernelPath p : SupportedKernelPaths()) {
    names += names.empty() ? "" : ", ";
    names += KernelPathName(p);
  }
  return names;
}

}  // namespace

KernelPath ResolveKernelPath(KernelPath requested) {
  if (requested == KernelPath::kAuto) {
    // The environment is read on every call (cheap) so tests and long-lived
    // processes see changes; only the CPU detection is cached.
    const char* env = std::getenv("RINGSPLASH_KERNEL");
    if (env != nullptr && *env != '\0') {
      KernelPath forced;
      try {
        forced = ParseKernelPath(env);
      } catch (const Error&) {
        // "auto" is accepted too (the same as unset), so the list names it.
        Fail("RINGSPLASH_KERNEL: expected auto|", PathNames(), ", got '", env, "'");
      }
      if (forced != KernelPath::kAuto) {
        Check(kernels::Supported(forced), "RINGSPLASH_KERNEL: kernel path '", env,
              "' is not supported by this CPU (supported: ", SupportedNames(), ")");
        return forced;
      }
    }
    const kernels::CpuFeatures& f = kernels::DetectCpuFeatures();
    if (f.amx) return KernelPath::kAmx;
    if (f.avx512_bf16 && f.fast_bf16_dot) return KernelPath::kAvx512Bf16;
    if (f.avx512) return KernelPath::kAvx512;
    if (f.avx2) return KernelPath::kAvx2;
    return KernelPath::kPortable;
  }
  Check(kernels::Supported(requested), "kernel_path: '", KernelPathName(requested),
        "' is not supported by this CPU (supported: ", SupportedNames(), ")");
  return requested;
}

}  // namespace ringsplash

// libFuzzer entry point of the ring target (see fuzz_targets.h).
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return ringsplash::fuzz::RingOneInput(data, size);
}

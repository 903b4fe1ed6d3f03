// The fuzz targets' bodies, as plain functions so that two programs can run
// them: the libFuzzer binaries (fuzz/*_fuzzer.cc, clang only) and the corpus
// replay test (tests/reliability/fuzz_corpus_test.cc, any compiler), which
// runs every seed and every saved crash input on each CI build.
//
// Each returns 0 and aborts (via FuzzCheck) when a promised property breaks:
//   NpyOneInput:       the .npy reader either opens the bytes as a file whose
//                      size matches its header and loads the exact values,
//                      or throws ringsplash::Error naming the file.
//   MaskParseOneInput: Mask::Parse either throws Error, or yields a mask whose
//                      canonical text parses back to an equivalent mask and
//                      whose block classification agrees with its element
//                      predicate (empty tiles have no allowed pair, full
//                      tiles only allowed pairs, partial tiles the exact bits).
//   AttentionOneInput: AttentionForward/Backward on random shapes, strides,
//                      dtypes and options either throw Error (exactly when an
//                      argument is invalid) or match the f64 reference.
//   RingOneInput:      the same problems, where valid, through
//                      RingAttentionThreads on 1-4 ranks and every layout:
//                      accepted, and matching the f64 reference.
#ifndef RINGSPLASH_FUZZ_FUZZ_TARGETS_H_
#define RINGSPLASH_FUZZ_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>

namespace ringsplash::fuzz {

int NpyOneInput(const uint8_t* data, size_t size);
int MaskParseOneInput(const uint8_t* data, size_t size);
int AttentionOneInput(const uint8_t* data, size_t size);
int RingOneInput(const uint8_t* data, size_t size);

}  // namespace ringsplash::fuzz

#endif  // RINGSPLASH_FUZZ_FUZZ_TARGETS_H_

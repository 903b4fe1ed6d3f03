// Fuzz target: ring attention (RingAttentionThreads, the threads backend)
// on the same random problems as the attention target (DecodeProblem), over
// 1-4 ranks and every layout. The single-device target owns argument
// validation; this one takes the problems the single-device contract calls
// valid (explicit positions replaced by the ring's own, 0..S-1), splits them
// over as many ranks as their lengths allow, and checks that
//   - the ring accepts them (only explicit positions and lengths that do not
//     split are ring-specific errors, and neither is generated here);
//   - out/lse (and, when the problem has a valid backward, dq/dk/dv/dsinks)
//     match the f64 reference within attention_check.h's tolerances — every
//     mask kind, GQA, sinks, segment ids, strided and 16-bit views, block
//     sizes and kernel paths, now with the kv slices travelling the ring and
//     partial results merged per step;
//   - nothing else is thrown, and nothing crashes, hangs or trips a sanitizer.
//
// The ring's shape (ranks, layout) comes from the byte after the problem, or,
// when the input ends there (every seed of the attention corpus), from a
// hash of the whole input — so the attention corpus seeds this target too.
#include <string>
#include <string_view>

#include "fuzz/attention_check.h"
#include "fuzz/attention_problem.h"
#include "fuzz/fuzz_targets.h"
#include "fuzz/fuzz_util.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"

namespace ringsplash::fuzz {
namespace {

constexpr int kMaxRanks = 4;

// The most ranks <= want over which both lengths split (by n, or by 2n
// chunks for zigzag); 1 rank of the contiguous layout when none does.
void SplitRing(int want, int64_t sq, int64_t skv, RingRun* run) {
  for (int n = want; n >= 1; --n) {
    const int64_t parts = run->options.layout == Layout::kZigzag ? 2 * n : n;
    if (sq % parts == 0 && skv % parts == 0) {
      run->num_ranks = n;
      return;
    }
  }
  run->num_ranks = 1;
  run->options.layout = Layout::kContiguous;
}

}  // namespace

int RingOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  ByteReader reader(data, size);
  FuzzProblem p = DecodeProblem(reader);
  if (p.forward.invalid || p.forward.uncertain) return 0;
  if (!p.in.q_positions.empty() || !p.in.kv_positions.empty()) {
    // The ring derives global positions from the layout (0..S-1): the
    // problem is run with those instead, unless a dense mask's extent only
    // covered the explicit ones (the one way dropping them can make it
    // invalid).
    const Mask& m = p.opt.mask;
    if (m.has_dense() && (p.in.q.shape[1] > m.dense_sq() || p.in.k.shape[1] > m.dense_skv())) {
      return 0;
    }
    p.in.q_positions.clear();
    p.in.kv_positions.clear();
  }
  const auto config = static_cast<uint32_t>(
      reader.remaining() > 0 ? reader.U8()
                             : Fnv1a(std::string_view(reinterpret_cast<const char*>(data), size)));
  const Layout layouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};
  RingRun run;
  run.options.layout = layouts[(config / kMaxRanks) % 3];
  SplitRing(static_cast<int>(config % kMaxRanks) + 1, p.in.q.shape[1], p.in.k.shape[1], &run);
  run.options.attention = p.opt;
  run.options.fault = FaultSpec{};  // no injected failure, whatever RINGSPLASH_FAULT says
  const bool backward = p.backward && !p.backward_verdict.invalid && !p.backward_verdict.uncertain;

  std::string msg;
  const bool threw = Throws(
      [&] {
        if (backward) {
          RingAttentionThreads(run, p.in, p.out.view, p.lse.view, p.dout.view, p.dq.view, p.dk.view,
                               p.dv.view, p.dsinks.view);
        } else {
          RingAttentionThreads(run, p.in, p.out.view, p.lse.view);
        }
      },
      &msg);
  const std::string ring =
      "ring of " + std::to_string(run.num_ranks) + " (" + LayoutName(run.options.layout) + ")";
  FuzzCheck(!threw, ring, " rejected a call the single-device entry points accept: \"", msg, "\"; ",
            p.Describe());
  const ReferenceCheck check(p);
  check.Forward((ring + " forward").c_str());
  if (backward) check.Backward((ring + " backward").c_str());
  return 0;
}

}  // namespace ringsplash::fuzz

// Does a ring hide its communication behind compute? Measured on any
// backend with an emulated link (LinkModel, include/ringsplash/comm.h) whose
// per-message latency d is comparable to a ring step's compute, and judged
// from the ring's own RankStats. Shared by the threads backend's test
// (tests/ring_transport_test.cc) and the MPI backend's (mpi_ring_test.cc).
//
// Why this is a sound timing test:
//   - d is half the FASTEST forward step this machine produced for the
//     problem (measured first, without a link; every step is the same work).
//     With overlap, a message started with a step is ready before the step
//     ends unless that step runs more than twice as fast as the fastest one
//     seen: exposed wait ~ 0 plus scheduling noise. Load only slows compute,
//     which widens the margin.
//   - Without overlap every message costs at least d: a modelled delay is a
//     sleep, which never ends early. So the no-overlap exposed wait is at
//     least twice the bound checked below, on an idle or a loaded machine.
//   - A rank whose neighbours compute more slowly (it got a whole core while
//     they shared one) waits for them whatever the link: that is imbalance,
//     not exposed communication. So each step is judged by the LEAST exposed
//     wait of any rank at that step — with overlap the slowest rank of the
//     step waits ~0; without it every rank waits at least d.
//   - The bound is on the exposed wait, not on "total < 0.8 x (compute +
//     link)": that form fails a perfectly overlapped ring whenever load
//     makes compute several times longer than the link.
// What remains is noise in the few steps measured (every rank descheduled
// at once); the tests run the measurement once more before failing.
#ifndef RINGSPLASH_TESTS_MPI_RING_OVERLAP_H_
#define RINGSPLASH_TESTS_MPI_RING_OVERLAP_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"

namespace ringsplash::overlap_testing {

// The problem: full mask, contiguous layout, so every rank does the same
// work at every step; B = 1, H = 2, D = Dv = 64, f32; `rows` query and key
// rows per rank; one kernel thread per rank.
inline mpi_testing::Problem ProblemFor(int64_t rows, int n) {
  mpi_testing::Problem p;
  p.spec = testing::ProblemSpec(1, rows * n, rows * n, 2, 2, 64, 64);
  p.seed = 11;
  return p;
}

inline RingOptions OverlapRingOptions() {
  RingOptions o;
  o.layout = Layout::kContiguous;
  o.attention.mask = Mask::Full();
  o.attention.num_threads = 1;
  return o;
}

// One forward (+ backward) ring run.
struct Timing {
  // This rank's sums over steps (RankStats). The backward's last step is
  // kept apart: it waits for this rank's own accumulators as soon as it has
  // sent them on (nothing is left to hide that transfer behind), and so also
  // for the slowest rank's last kernel.
  double fwd_compute = 0, fwd_exposed = 0;
  double bwd_compute = 0, bwd_exposed = 0;  // steps 0..n-2
  double bwd_last_compute = 0, bwd_last_exposed = 0;
  double min_fwd_step = 0;  // this rank's shortest forward step
  // The same on every rank: summed over the steps, the least exposed wait
  // of any rank at that step (what the verdict reads).
  double ring_fwd_exposed = 0, ring_bwd_exposed = 0;
};

inline Timing RunRing(Communicator& comm, int64_t rows, bool backward = true) {
  const int n = comm.size(), r = comm.rank();
  const mpi_testing::Problem p = ProblemFor(rows, n);
  const mpi_testing::Global g = mpi_testing::MakeGlobal(p);
  const RingOptions options = OverlapRingOptions();
  mpi_testing::Local l = mpi_testing::MakeLocal(p, g, options.layout, r, n);
  RankStats stats;
  comm.Barrier();  // start together
  mpi_testing::RunRingOnRank(comm, p, options, l, backward, &stats);
  Timing t;
  t.min_fwd_step = std::numeric_limits<double>::infinity();
  for (const RingStepStats& s : stats.forward_steps) {
    t.fwd_compute += s.compute_seconds;
    t.fwd_exposed += s.comm_wait_seconds;
    t.min_fwd_step = std::min(t.min_fwd_step, s.compute_seconds);
  }
  for (size_t i = 0; i < stats.backward_steps.size(); ++i) {
    const RingStepStats& s = stats.backward_steps[i];
    const bool last = i + 1 == stats.backward_steps.size();
    (last ? t.bwd_last_compute : t.bwd_compute) += s.compute_seconds;
    (last ? t.bwd_last_exposed : t.bwd_exposed) += s.comm_wait_seconds;
  }
  // Every rank's wait at every step, [step][rank] (forward steps, then the
  // backward's), gathered by a sum over ranks of zeros but one's own slot.
  std::vector<const RingStepStats*> steps;
  for (const RingStepStats& s : stats.forward_steps) steps.push_back(&s);
  for (const RingStepStats& s : stats.backward_steps) steps.push_back(&s);
  std::vector<float> waits(steps.size() * static_cast<size_t>(n), 0.0f);
  for (size_t i = 0; i < steps.size(); ++i) {
    waits[i * static_cast<size_t>(n) + static_cast<size_t>(r)] =
        static_cast<float>(steps[i]->comm_wait_seconds);
  }
  comm.AllReduceSum(waits.data(), waits.size());
  const size_t fwd_steps = stats.forward_steps.size();
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i > fwd_steps && i + 1 == steps.size()) break;  // the backward's last step
    const auto first = waits.begin() + static_cast<std::ptrdiff_t>(i) * n;
    const double least = *std::min_element(first, first + n);
    (i < fwd_steps ? t.ring_fwd_exposed : t.ring_bwd_exposed) += least;
  }
  return t;
}

// The mean over ranks (identical on every rank).
inline double MeanOverRanks(Communicator& comm, double x) {
  float v = static_cast<float>(x);
  comm.AllReduceSum(&v, 1);
  return static_cast<double>(v) / comm.size();
}

// A forward step of ~kTargetStepSeconds: d (half of it) is then large
// against scheduling noise yet the test stays short.
constexpr double kTargetStepSeconds = 0.1;

// Rows per rank for a forward step of about kTargetStepSeconds on this
// machine (in [256, 4096], a multiple of 128): forward runs from 512 rows,
// three times scaled by the square root of the time ratio (full mask: work ~
// rows^2; the later passes correct for what is not: below ~1024 rows K and V
// stay in cache and a step is several times faster per FLOP). A slow machine
// or a sanitizer build gets fewer rows, a fast one more. Collective; `comm`
// should have no link.
inline int64_t CalibrateRows(Communicator& comm) {
  constexpr int64_t kMin = 256, kMax = 4096;
  int64_t rows = 512;
  RunRing(comm, rows, /*backward=*/false);  // warm-up: thread pools, page faults
  for (int pass = 0; pass < 3; ++pass) {
    const double step = MeanOverRanks(comm, RunRing(comm, rows, /*backward=*/false).min_fwd_step);
    const double scaled = static_cast<double>(rows) * std::sqrt(kTargetStepSeconds / step);
    rows = std::clamp(static_cast<int64_t>(std::ceil(scaled / 128)) * 128, kMin, kMax);
  }
  return rows;
}

// The per-message latency for the measured run: half the fastest forward
// step at `rows` over two runs (mean over ranks, so every rank uses the
// same). Collective; `comm` should have no link.
inline double CalibrateLatency(Communicator& comm, int64_t rows) {
  const double a = RunRing(comm, rows, /*backward=*/false).min_fwd_step;
  const double b = RunRing(comm, rows, /*backward=*/false).min_fwd_step;
  return 0.5 * MeanOverRanks(comm, std::min(a, b));
}

// The verdict on a run with per-message latency d on n ranks (the same on
// every rank): overlapped if the ring's exposed wait is under half the link
// time that could hide behind compute.
//   forward:  n-1 slice messages, each started with a step and waited for
//             at its end.
//   backward, steps 0..n-2: the slices 0..n-2 and accumulators 0..n-3
//             (each sent after one step, waited for after the next): 2n-3
//             messages. The last step is left out (Timing says why); its
//             wait is printed.
struct Verdict {
  bool fwd_hidden = false, bwd_hidden = false;
  double fwd_bound = 0, bwd_bound = 0;  // on the exposed wait
  bool hidden() const { return fwd_hidden && bwd_hidden; }
};

inline Verdict Judge(const Timing& t, double d, int n) {
  Verdict v;
  v.fwd_bound = 0.5 * (n - 1) * d;
  v.bwd_bound = 0.5 * (2 * n - 3) * d;
  v.fwd_hidden = t.ring_fwd_exposed < v.fwd_bound;
  v.bwd_hidden = t.ring_bwd_exposed < v.bwd_bound;
  return v;
}

// "forward: ring's exposed wait 0.0 ms (bound 25.3; link 50.7 ms); this
// rank: compute 213.5 ms, exposed wait 0.0 ms, compute + link 264.2 ms;
// backward steps 0..0: ...; last step: ..."
inline std::string Describe(const Timing& t, double d, int n) {
  const Verdict v = Judge(t, d, n);
  const double fwd_link = (n - 1) * d, bwd_link = (2 * n - 3) * d;
  char text[768];
  std::snprintf(text, sizeof text,
                "forward: ring's exposed wait %.1f ms (bound %.1f; link %.1f ms); this rank: "
                "compute %.1f ms, exposed wait %.1f ms, compute + link %.1f ms; backward steps "
                "0..%d: ring's exposed wait %.1f ms (bound %.1f; link %.1f ms); this rank: compute "
                "%.1f ms, exposed wait %.1f ms, compute + link %.1f ms; last step: compute %.1f "
                "ms, wait %.1f ms",
                t.ring_fwd_exposed * 1e3, v.fwd_bound * 1e3, fwd_link * 1e3, t.fwd_compute * 1e3,
                t.fwd_exposed * 1e3, (t.fwd_compute + fwd_link) * 1e3, n - 2,
                t.ring_bwd_exposed * 1e3, v.bwd_bound * 1e3, bwd_link * 1e3, t.bwd_compute * 1e3,
                t.bwd_exposed * 1e3, (t.bwd_compute + bwd_link) * 1e3, t.bwd_last_compute * 1e3,
                t.bwd_last_exposed * 1e3);
  return text;
}

}  // namespace ringsplash::overlap_testing

#endif  // RINGSPLASH_TESTS_MPI_RING_OVERLAP_H_

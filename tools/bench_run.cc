// Timed runs of one configuration on every rank, gathered on rank 0.
#include "tools/bench_run.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "tools/bandwidth.h"
#include "tools/bench_check.h"
#include "tools/cli_common.h"
#include "tools/peak.h"
#include "tools/random_fill.h"

namespace ringsplash::cli {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// What one rank measured, summed over the timed iterations.
struct RankTotals {
  double compute = 0, wait = 0, flops = 0, computed = 0, skipped = 0, all_to_all = 0;
  void Add(const RankStats& s) {
    compute += s.compute_seconds();
    wait += s.comm_wait_seconds();
    flops += s.flops();
    computed += static_cast<double>(s.computed_blocks());
    skipped += static_cast<double>(s.skipped_blocks());
  }
  void Add(const KernelStats& s, double seconds) {
    compute += seconds;
    flops += s.flops;
    computed += static_cast<double>(s.computed_blocks);
    skipped += static_cast<double>(s.skipped_blocks);
  }
};

}  // namespace

BenchResult RunBenchOnRank(Communicator& comm, const BenchConfig& c) {
  const int n = comm.size();
  const int rank = comm.rank();
  const bool single = n == 1;
  const bool fwd = c.pass != Pass::kBwd;
  const bool bwd = c.pass != Pass::kFwd;
  const Mask mask = Mask::Parse(c.mask);
  const std::vector<int64_t> q_pos =
      single ? Iota(c.q_seq) : LayoutPositions(c.layout, c.q_seq, rank, n, "--q-seq");
  const std::vector<int64_t> kv_pos =
      single ? Iota(c.seq) : LayoutPositions(c.layout, c.seq, rank, n, "--seq");
  const auto nq = static_cast<int64_t>(q_pos.size());
  const auto nkv = static_cast<int64_t>(kv_pos.size());

  Tensor q(c.dtype, {c.batch, nq, c.heads, c.head_dim});
  Tensor k(c.dtype, {c.batch, nkv, c.kv_heads, c.head_dim});
  Tensor v(c.dtype, {c.batch, nkv, c.kv_heads, c.v_head_dim});
  FillRandom(q, c.seed, RandomStream::kQ, q_pos, c.q_seq);
  FillRandom(k, c.seed, RandomStream::kK, kv_pos, c.seq);
  FillRandom(v, c.seed, RandomStream::kV, kv_pos, c.seq);
  Tensor dout, dq, dk, dv;
  if (bwd) {
    dout = Tensor(c.dtype, {c.batch, nq, c.heads, c.v_head_dim});
    FillRandom(dout, c.seed, RandomStream::kDout, q_pos, c.q_seq);
    dq = Tensor(DType::kF32, {c.batch, nq, c.heads, c.head_dim});
    dk = Tensor(DType::kF32, {c.batch, nkv, c.kv_heads, c.head_dim});
    dv = Tensor(DType::kF32, {c.batch, nkv, c.kv_heads, c.v_head_dim});
  }
  Tensor out(DType::kF32, {c.batch, nq, c.heads, c.v_head_dim});
  Tensor lse(DType::kF32, {c.batch, c.heads, nq});

  AttentionInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  RingOptions ro;
  ro.attention.mask = mask;
  ro.attention.block_sizes = c.blocks;
  ro.attention.num_threads = c.threads_per_rank;
  ro.layout = c.layout;

  // 2-D context parallelism: the groups once for every iteration (two
  // Splits); each rank's rows are the 1-D ring's whatever U.
  const bool grid = !single && c.ulysses > 1;
  ContextParallelOptions cpo;
  cpo.ring = ro;
  cpo.ulysses = c.ulysses;
  std::unique_ptr<ContextParallelGroups> groups;
  if (grid) groups = std::make_unique<ContextParallelGroups>(comm, c.ulysses, c.layout);

  RankTotals totals;
  auto run_forward = [&](bool timed) {
    if (grid) {
      ContextParallelStats cs;
      ContextParallelForward(*groups, in, cpo, out.view(), lse.view(), &cs);
      if (timed) {
        totals.Add(cs.ring);
        totals.all_to_all += cs.forward_all_to_all_seconds;
      }
    } else if (single) {
      KernelStats ks;
      const double t0 = Now();
      AttentionForward(in, ro.attention, out.view(), lse.view(), &ks);
      if (timed) totals.Add(ks, Now() - t0);
    } else {
      RankStats rs;
      RingAttentionForward(comm, in, ro, out.view(), lse.view(), &rs);
      if (timed) totals.Add(rs);
    }
  };
  auto run_backward = [&](bool timed) {
    if (grid) {
      ContextParallelStats cs;
      ContextParallelBackward(*groups, in, cpo, out.view(), lse.view(), dout.view(), dq.view(),
                              dk.view(), dv.view(), {}, &cs);
      if (timed) {
        totals.Add(cs.ring);
        totals.all_to_all += cs.backward_all_to_all_seconds;
      }
    } else if (single) {
      KernelStats ks;
      const double t0 = Now();
      AttentionBackward(in, ro.attention, out.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                        dv.view(), {}, &ks);
      if (timed) totals.Add(ks, Now() - t0);
    } else {
      RankStats rs;
      RingAttentionBackward(comm, in, ro, out.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                            dv.view(), {}, &rs);
      if (timed) totals.Add(rs);
    }
  };

  if (!fwd) run_forward(false);  // backward alone needs out and lse
  std::vector<double> fwd_times, bwd_times, times;
  for (int it = 0; it < c.warmup + c.iters; ++it) {
    const bool timed = it >= c.warmup;
    comm.Barrier();
    const double t0 = Now();
    if (fwd) run_forward(timed);
    comm.Barrier();
    const double t1 = Now();
    if (bwd) run_backward(timed);
    comm.Barrier();
    const double t2 = Now();
    if (timed) {
      if (fwd) fwd_times.push_back(t1 - t0);
      if (bwd) bwd_times.push_back(t2 - t1);
      times.push_back(t2 - t0);
    }
  }

  BenchResult r;
  r.config = c;
  r.kernel_path = KernelPathFor(c.dtype);
  r.seconds = Median(times);
  r.forward_seconds = Median(fwd_times);
  r.backward_seconds = Median(bwd_times);
  const double iters = std::max(1, c.iters);
  r.compute_seconds = AllGather(comm, totals.compute / iters);
  r.comm_wait_seconds = AllGather(comm, totals.wait / iters);
  r.all_to_all_seconds = AllGather(comm, totals.all_to_all / iters);
  r.rank_flops = AllGather(comm, totals.flops / iters);
  std::vector<double> computed = AllGather(comm, totals.computed / iters);
  std::vector<double> skipped = AllGather(comm, totals.skipped / iters);
  for (int i = 0; i < n; ++i) {
    r.kernel_flops += r.rank_flops[i];
    r.computed_blocks += static_cast<int64_t>(computed[i]);
    r.skipped_blocks += static_cast<int64_t>(skipped[i]);
  }
  const double max_flops = *std::max_element(r.rank_flops.begin(), r.rank_flops.end());
  const double mean_flops = r.kernel_flops / n;
  r.imbalance = mean_flops > 0 ? max_flops / mean_flops : 1.0;

  SampledResults samples;
  if (c.check) {
    LocalResults local;
    local.q_pos = q_pos;
    local.kv_pos = kv_pos;
    local.out = &out;
    local.lse = &lse;
    if (bwd) {
      local.dq = &dq;
      local.dk = &dk;
      local.dv = &dv;
    }
    samples = GatherSamples(comm, c, local);
  }

  if (rank == 0) {
    r.allowed_pairs = AllowedPairs(mask, c.q_seq, c.seq, c.heads);
    r.kv_bytes = static_cast<double>(c.batch) * static_cast<double>(c.seq) *
                 static_cast<double>(c.kv_heads) * static_cast<double>(c.head_dim + c.v_head_dim) *
                 static_cast<double>(DTypeSize(c.dtype));
    r.kv_gb_per_s = r.seconds > 0 ? r.kv_bytes / r.seconds / 1e9 : 0;
    r.flops = UsefulFlops(r.allowed_pairs, c.batch, c.head_dim, c.v_head_dim, c.pass);
    r.gflops = r.seconds > 0 ? r.flops / r.seconds / 1e9 : 0;
  }

  // The peak over the threads this run used: under MPI every process
  // measures its own threads at the same time and the results add up; on
  // the threads backend rank 0 measures all ranks' threads at once. Each
  // process runs at most as many threads as it has cores (MeasurePeak).
  auto measure_peak = [&]() {
    Peak peak;
    if (c.mpi) {
      comm.Barrier();
      peak = MeasurePeak(c.dtype, c.threads_per_rank);
      const std::vector<double> all = AllGather(comm, peak.gflops);
      const std::vector<double> tiles = AllGather(comm, peak.tile_gflops);
      const std::vector<double> threads = AllGather(comm, peak.threads);
      peak.gflops = peak.tile_gflops = 0;
      peak.threads = 0;
      for (int i = 0; i < n; ++i) {
        peak.gflops += all[i];
        peak.tile_gflops += tiles[i];
        peak.threads += static_cast<int>(threads[i]);
      }
    } else if (rank == 0) {
      peak = MeasurePeak(c.dtype, c.threads_per_rank * n);
    }
    return peak;
  };
  // The same for the read bandwidth, for decoding-shaped calls only (the
  // probe's buffer would add to every other run's time and memory): each
  // MPI process reads with its threads at the same moment (memory they
  // share), and the rates add up. The processes on one machine share one
  // probe's worth of buffer: the caches it must exceed are theirs together.
  const bool decoding = DecodingShaped(c.pass == Pass::kFwd, c.q_seq, c.heads, c.kv_heads);
  auto measure_bandwidth = [&]() {
    Bandwidth bw;
    if (c.mpi) {
      comm.Barrier();
      bw = MeasureReadBandwidth(c.threads_per_rank, ProbeBytes() / LocalRanks(n));
      const std::vector<double> rates = AllGather(comm, bw.gb_per_s);
      const std::vector<double> threads = AllGather(comm, bw.threads);
      const std::vector<double> bytes = AllGather(comm, static_cast<double>(bw.bytes));
      bw.gb_per_s = 0;
      bw.threads = 0;
      bw.bytes = 0;
      bool every_process = true;
      for (int i = 0; i < n; ++i) {
        every_process = every_process && rates[i] > 0;
        bw.gb_per_s += rates[i];
        bw.threads += static_cast<int>(threads[i]);
        bw.bytes += static_cast<int64_t>(bytes[i]);
      }
      // A process that could not measure (no buffer) leaves no figure for
      // all: the sum of the others would understate the machine.
      if (!every_process) bw.gb_per_s = 0;
    } else if (rank == 0) {
      bw = MeasureReadBandwidth(c.threads_per_rank * n);
    }
    return bw;
  };
  const Peak first = measure_peak();
  const Bandwidth first_bandwidth = decoding ? measure_bandwidth() : Bandwidth{};
  // A rate above the peak (a peak measured while other work had the cores)
  // is measured once more (SettlePeak), and a K/V rate above the bandwidth
  // likewise (SettleBandwidth). Rank 0 decides; under MPI the other ranks
  // learn whether to measure with it, the peak first.
  if (rank != 0) {
    if (c.mpi && Broadcast(comm, 0) != 0) measure_peak();
    if (c.mpi && decoding && Broadcast(comm, 0) != 0) measure_bandwidth();
    return r;  // no collective below: other ranks may leave
  }
  bool again = false;
  const SettledPeak settled = SettlePeak(r.gflops, first, [&] {
    again = true;
    if (c.mpi) Broadcast(comm, 1);
    return measure_peak();
  });
  if (c.mpi && !again) Broadcast(comm, 0);
  r.peak_gflops = settled.peak.gflops;
  r.peak_method = settled.peak.method;
  r.peak_threads = settled.peak.threads;
  r.amx_peak_gflops = settled.peak.tile_gflops;
  r.peak_measurements = settled.measurements;
  if (settled.fraction.reliable()) {
    r.fraction_of_peak = settled.fraction.of_peak;
    r.fraction_of_amx_peak = settled.fraction.of_tile_peak.value_or(0.0);
  } else {
    r.peak_unreliable_reason = settled.fraction.unreliable_reason;
  }
  if (decoding) {
    bool read_again = false;
    const SettledBandwidth bw = SettleBandwidth(r.kv_gb_per_s, first_bandwidth, [&] {
      read_again = true;
      if (c.mpi) Broadcast(comm, 1);
      return measure_bandwidth();
    });
    if (c.mpi && !read_again) Broadcast(comm, 0);
    if (bw.bandwidth.gb_per_s > 0) r.read_gb_per_s = bw.bandwidth.gb_per_s;
    r.bandwidth_method = bw.bandwidth.method;
    r.bandwidth_threads = bw.bandwidth.threads;
    r.bandwidth_bytes = bw.bandwidth.bytes;
    r.bandwidth_measurements = bw.measurements;
    r.fraction_of_bandwidth = bw.fraction.of_bandwidth;
    r.bandwidth_unreliable_reason = bw.fraction.unreliable_reason;
  }
  if (c.check) r.check = CheckSamples(c, mask, samples, c.threads_per_rank * (c.mpi ? 1 : n));
  return r;
}

BenchResult RunBenchThreads(const BenchConfig& c) {
  CommOptions copt;
  copt.timeout_s = c.comm_timeout;
  BenchResult result;
  RunThreadRanks(c.ranks, copt, [&](Communicator& comm) {
    BenchResult r = RunBenchOnRank(comm, c);
    if (comm.rank() == 0) result = std::move(r);
  });
  return result;
}

}  // namespace ringsplash::cli

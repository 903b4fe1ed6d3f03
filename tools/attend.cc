// `ringsplash attend`: reads .npy inputs, runs attention on one device, a
// ring of threads or an MPI ring, and writes .npy outputs atomically.
#include "tools/attend.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <memory>
#include <span>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tools/attend_inputs.h"
#include "tools/cli_common.h"
#include "tools/npy.h"
#include "tools/pending_outputs.h"
#include "tools/progress.h"
#include "tools/random_fill.h"

namespace ringsplash::cli {
namespace {

// The prefix of its messages, progress line and signal line.
constexpr char kCommand[] = "ringsplash attend";

// --ulysses must divide the ring size (the heads' rules are the library's
// Errors: docs/CONTEXT_PARALLEL.md).
void CheckUlysses(const AttendArgs& args, int ranks) {
  if (ranks % args.ulysses != 0) {
    Usage("--ulysses ", args.ulysses, " must divide the ", ranks,
          " ranks (groups of U ranks, a ring of ranks/U groups)");
  }
}

// Results of one run, global (threads) or this rank's shard (MPI); all f32,
// indexed by OutputKind.
struct Results {
  Tensor out, lse, dq, dk, dv, dsinks;
  const Tensor& Of(OutputKind kind) const {
    switch (kind) {
      case OutputKind::kOut:
        return out;
      case OutputKind::kLse:
        return lse;
      case OutputKind::kDq:
        return dq;
      case OutputKind::kDk:
        return dk;
      case OutputKind::kDv:
        return dv;
      case OutputKind::kDsinks:
        break;
    }
    return dsinks;
  }
};

TensorView ViewOrEmpty(const Tensor& t) { return t.data() ? t.view() : TensorView{}; }

// The rows `q_pos` / `kv_pos` of every input (all rows on one process, the
// shard under MPI), converted to the compute dtype, and result buffers for
// them.
struct Loaded {
  Tensor q, k, v, dout, sinks, q_seg, kv_seg;
  AttentionInputs inputs;
  Results results;
};

Loaded LoadInputs(const AttendFiles& files, const AttendPlan& plan, std::span<const int64_t> q_pos,
                  std::span<const int64_t> kv_pos) {
  Loaded l;
  l.q = files.q.LoadRows(plan.dtype, q_pos, "q");
  l.k = files.k.LoadRows(plan.dtype, kv_pos, "k");
  l.v = files.v.LoadRows(plan.dtype, kv_pos, "v");
  if (plan.backward) l.dout = files.dout.LoadRows(plan.dtype, q_pos, "dout");
  if (!files.sinks.path().empty()) l.sinks = files.sinks.Load(DType::kF32, "sinks");
  if (!files.q_segments.path().empty()) {
    l.q_seg = files.q_segments.LoadRows(DType::kI32, q_pos, "q segment ids");
    l.kv_seg = files.kv_segments.LoadRows(DType::kI32, kv_pos, "kv segment ids");
  }
  l.inputs.q = l.q.view();
  l.inputs.k = l.k.view();
  l.inputs.v = l.v.view();
  l.inputs.sinks = ViewOrEmpty(l.sinks);
  l.inputs.q_segments = ViewOrEmpty(l.q_seg);
  l.inputs.kv_segments = ViewOrEmpty(l.kv_seg);

  const Dims& d = files.dims;
  const auto nq = static_cast<int64_t>(q_pos.size());
  const auto nkv = static_cast<int64_t>(kv_pos.size());
  Results& r = l.results;
  r.out = Tensor(DType::kF32, {d.b, nq, d.h, d.dv});
  r.lse = Tensor(DType::kF32, {d.b, d.h, nq});
  if (plan.backward) {
    r.dq = Tensor(DType::kF32, {d.b, nq, d.h, d.d});
    r.dk = Tensor(DType::kF32, {d.b, nkv, d.hkv, d.d});
    r.dv = Tensor(DType::kF32, {d.b, nkv, d.hkv, d.dv});
    if (l.sinks.data()) r.dsinks = Tensor(DType::kF32, {d.h});
  }
  return l;
}

AttentionOptions MakeAttentionOptions(const AttendArgs& args, const Mask& mask) {
  AttentionOptions opt;
  opt.mask = mask;
  if (args.scale) opt.scale = static_cast<float>(*args.scale);
  if (args.softcap) opt.softcap = static_cast<float>(*args.softcap);
  opt.num_threads = args.threads_per_rank;
  return opt;
}

// Writes the rows `pos` (increasing) of `spec`'s output, held as a local
// [batch, pos.size(), inner] f32 buffer, at their global offsets;
// consecutive positions coalesce into one write.
void WriteRows(npy::NpyOutputFile& file, const OutputSpec& spec, const float* local,
               std::span<const int64_t> pos) {
  const auto n = static_cast<int64_t>(pos.size());
  for (int64_t b = 0; b < spec.batch; ++b) {
    for (int64_t i = 0; i < n;) {
      int64_t j = i + 1;
      while (j < n && pos[j] == pos[j - 1] + 1) ++j;
      file.Write((b * spec.seq + pos[i]) * spec.inner, local + (b * n + i) * spec.inner,
                 (j - i) * spec.inner);
      i = j;
    }
  }
}

void RunAttendThreads(const AttendArgs& args, const AttendPlan& plan) {
  InstallSignalHandlers(kCommand);
  Progress progress(kCommand, true);
  progress.Phase("reading inputs");
  const int ranks = args.ranks.value_or(1);
  CheckUlysses(args, ranks);
  CheckEnvironment(ranks, plan.backward);
  AttendFiles files = OpenInputs(args, plan);
  CheckDivisible(files, plan.layout, ranks);
  const Mask mask = BuildMask(files, plan);

  // Create every output first, so an unwritable destination fails before
  // the compute rather than after it.
  PendingOutputs pending(static_cast<uint64_t>(::getpid()), /*owner=*/true);
  const std::vector<OutputSpec> specs = PlanOutputs(args, files.dims);
  std::vector<npy::NpyOutputFile> outputs;
  for (const OutputSpec& s : specs) {
    outputs.push_back(
        npy::NpyOutputFile::Create(pending.Add(s.path), npy::NpyType::kF32, s.shape, s.path));
  }

  Loaded l = LoadInputs(files, plan, Iota(files.dims.sq), Iota(files.dims.skv));
  const AttentionOptions opt = MakeAttentionOptions(args, mask);
  Results& r = l.results;
  progress.Phase(plan.backward ? "forward + backward" : "forward");
  if (ranks == 1) {
    AttentionForward(l.inputs, opt, r.out.view(), r.lse.view());
    if (plan.backward) {
      AttentionBackward(l.inputs, opt, r.out.view(), r.lse.view(), l.dout.view(), r.dq.view(),
                        r.dk.view(), r.dv.view(), ViewOrEmpty(r.dsinks));
    }
  } else if (args.ulysses > 1) {
    ContextParallelRun run;
    run.num_ranks = ranks;
    run.options.ulysses = args.ulysses;
    run.options.ring.attention = opt;
    run.options.ring.layout = plan.layout;
    run.comm.timeout_s = args.comm_timeout;
    ContextParallelThreads(run, l.inputs, r.out.view(), r.lse.view(), ViewOrEmpty(l.dout),
                           ViewOrEmpty(r.dq), ViewOrEmpty(r.dk), ViewOrEmpty(r.dv),
                           ViewOrEmpty(r.dsinks));
  } else {
    RingRun run;
    run.num_ranks = ranks;
    run.options.attention = opt;
    run.options.layout = plan.layout;
    run.comm.timeout_s = args.comm_timeout;
    RingAttentionThreads(run, l.inputs, r.out.view(), r.lse.view(), ViewOrEmpty(l.dout),
                         ViewOrEmpty(r.dq), ViewOrEmpty(r.dk), ViewOrEmpty(r.dv),
                         ViewOrEmpty(r.dsinks));
  }

  progress.Phase("writing outputs");
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor& t = r.Of(specs[i].kind);
    outputs[i].Write(0, t.data(), t.numel());
    outputs[i].Close();
  }
  pending.Commit();
}

// One MPI rank: reads only its shard's rows (memory-mapped), runs its part
// of the ring, and writes its rows into temporaries rank 0 created; rank 0
// renames them once every rank has finished writing.
void RunAttendMpiRank(Communicator& comm, const AttendArgs& args, const AttendPlan& plan,
                      bool& ring_started) {
  const int n = comm.size();
  const int rank = comm.rank();
  if (args.ranks && *args.ranks != n) {
    Usage("--ranks ", *args.ranks, " does not match the ", n, " MPI processes (mpirun -np ", n,
          ")");
  }
  CheckUlysses(args, n);
  CheckEnvironment(n, plan.backward);
  Progress progress(kCommand, rank == 0);
  progress.Phase("reading inputs");
  AttendFiles files = OpenInputs(args, plan);
  CheckDivisible(files, plan.layout, n);
  const Dims& d = files.dims;

  // Every rank must name the same temporaries: use rank 0's process id.
  const uint64_t token = Broadcast(comm, static_cast<uint64_t>(::getpid()));
  PendingOutputs pending(token, /*owner=*/rank == 0);
  const std::vector<OutputSpec> specs = PlanOutputs(args, d);
  std::vector<std::string> temps;
  for (const OutputSpec& s : specs) temps.push_back(pending.Add(s.path));
  if (rank == 0) {
    for (size_t i = 0; i < specs.size(); ++i) {
      npy::NpyOutputFile::Create(temps[i], npy::NpyType::kF32, specs[i].shape, specs[i].path)
          .Close();
    }
  }
  comm.Barrier();
  ring_started = true;

  const std::vector<int64_t> q_pos =
      LayoutPositions(plan.layout, d.sq, rank, n, "q sequence length");
  const std::vector<int64_t> kv_pos =
      LayoutPositions(plan.layout, d.skv, rank, n, "kv sequence length");
  Loaded l = LoadInputs(files, plan, q_pos, kv_pos);
  const Mask mask = BuildMaskRows(files, plan, q_pos);
  RingOptions ro;
  ro.attention = MakeAttentionOptions(args, mask);
  if (ro.attention.num_threads == 0) {
    ro.attention.num_threads = DefaultThreadsPerRank(comm);
  }
  ro.layout = plan.layout;
  Results& r = l.results;
  progress.Phase(plan.backward ? "forward + backward" : "forward");
  // Each rank's rows are the 1-D ring's whatever --ulysses: U = 1 runs the
  // ring itself.
  ContextParallelOptions cpo;
  cpo.ring = ro;
  cpo.ulysses = args.ulysses;
  ContextParallelGroups groups(comm, cpo.ulysses, cpo.ring.layout);
  ContextParallelForward(groups, l.inputs, cpo, r.out.view(), r.lse.view());
  if (plan.backward) {
    ContextParallelBackward(groups, l.inputs, cpo, r.out.view(), r.lse.view(), l.dout.view(),
                            r.dq.view(), r.dk.view(), r.dv.view(), ViewOrEmpty(r.dsinks));
  }

  progress.Phase("writing outputs");
  // Opened only now: if a peer fails during the ring, rank 0 removes the
  // temporaries while unwinding, and a slow rank must then report that
  // failure, not "cannot open for writing".
  std::vector<npy::NpyOutputFile> outputs;
  for (size_t i = 0; i < specs.size(); ++i) {
    outputs.push_back(
        npy::NpyOutputFile::OpenExisting(temps[i], npy::NpyType::kF32, specs[i].shape));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const OutputSpec& s = specs[i];
    const float* data = r.Of(s.kind).data_as<float>();
    if (s.rows == RowsOf::kNone) {
      // dsinks: the same global gradient on every rank; rank 0 writes it.
      if (rank == 0) outputs[i].Write(0, data, s.inner);
    } else {
      WriteRows(outputs[i], s, data, s.rows == RowsOf::kQuery ? q_pos : kv_pos);
    }
    outputs[i].Close();
  }
  comm.Barrier();  // every rank's rows are on disk
  pending.Commit();
}

void RunAttendMpi(const AttendArgs& args, const AttendPlan& plan) {
  CommOptions copt;
  copt.timeout_s = args.comm_timeout;
  std::unique_ptr<Communicator> comm = MakeMpiCommunicator(copt);
  bool ring_started = false;
  try {
    // Making the communicator is collective, and a rank may still be inside
    // it when a peer has already failed a check: once every rank is past
    // this barrier, a peer's failure reaches it here, where it stays silent.
    comm->Barrier();
    RunAttendMpiRank(*comm, args, plan, ring_started);
  } catch (const std::exception& e) {
    comm->Abort(FailureReason(e));
    // Before the ring every rank checks the same things and fails alike:
    // rank 0 alone reports. Later a failure may be local to one rank.
    if (comm->rank() == 0) throw;
    if (!ring_started) throw SilentFailure();
    Fail("rank ", comm->rank(), ": ", FailureReason(e));
  }
}

}  // namespace

CLI::App* AddAttendCommand(CLI::App& app, AttendArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "attend",
      "Run attention on arrays saved by NumPy (.npy): forward, and backward with --dout.");
  cmd->add_option("--q", a.q, "queries [B, Sq, H, D], D <= 256, float32 or float16")
      ->required()
      ->type_name("FILE");
  cmd->add_option("--k", a.k, "keys [B, Skv, Hkv, D]; H % Hkv == 0 (GQA/MQA)")
      ->required()
      ->type_name("FILE");
  cmd->add_option("--v", a.v, "values [B, Skv, Hkv, Dv], Dv <= 256")->required()->type_name("FILE");
  cmd->add_option("--out", a.out, "output [B, Sq, H, Dv], float32")->required()->type_name("FILE");
  cmd->add_option("--lse", a.lse, "log-sum-exp [B, H, Sq], float32")->type_name("FILE");
  cmd->add_option("--mask", a.mask,
                  "mask text: full, causal[:OFF], local:L,R[,OFF], chunked:C, joined with & "
                  "and |, grouped with ( ) (default full)")
      ->type_name("TEXT");
  cmd->add_option("--dense-mask", a.dense_mask,
                  "bool [Sq, Skv] or [H, Sq, Skv] (uint8/int accepted), ANDed with --mask")
      ->type_name("FILE");
  cmd->add_option_function<double>(
         "--softcap", [&a](const double& c) { a.softcap = c; },
         "soft cap C > 0: s = C * tanh(s / C)")
      ->type_name("C");
  cmd->add_option_function<double>(
         "--scale", [&a](const double& s) { a.scale = s; }, "score scale (default 1/sqrt(D))")
      ->type_name("S");
  cmd->add_option("--sinks", a.sinks, "attention sink logits [H], float32 or float16")
      ->type_name("FILE");
  cmd->add_option("--q-segments", a.q_segments, "segment ids [B, Sq], int32 or int64")
      ->type_name("FILE");
  cmd->add_option("--kv-segments", a.kv_segments, "segment ids [B, Skv], int32 or int64")
      ->type_name("FILE");
  cmd->add_option("--dout", a.dout, "gradient of out [B, Sq, H, Dv]: runs the backward pass")
      ->type_name("FILE");
  cmd->add_option("--dq", a.dq, "writes dq [B, Sq, H, D] (needs --dout)")->type_name("FILE");
  cmd->add_option("--dk", a.dk, "writes dk [B, Skv, Hkv, D] (needs --dout)")->type_name("FILE");
  cmd->add_option("--dv", a.dv, "writes dv [B, Skv, Hkv, Dv] (needs --dout)")->type_name("FILE");
  cmd->add_option("--dsinks", a.dsinks, "writes dsinks [H] (needs --dout and --sinks)")
      ->type_name("FILE");
  cmd->add_option_function<int>(
         "--ranks", [&a](const int& n) { a.ranks = n; },
         "ring size, 1 to 4096 (threads backend; default 1 = single device; under mpirun: the "
         "number of processes)")
      ->type_name("N");
  cmd->add_option("--layout", a.layout, "sequence layout over ranks: contiguous|zigzag|striped")
      ->type_name("NAME")
      ->capture_default_str();
  cmd->add_option("--ulysses", a.ulysses,
                  "2-D context parallelism: ranks per Ulysses group U, dividing the ranks and H "
                  "(Hkv a multiple or divisor of U); the ring runs over ranks/U groups. 1: the "
                  "ring alone (docs/CONTEXT_PARALLEL.md)")
      ->type_name("U")
      ->capture_default_str();
  cmd->add_option("--backend", a.backend, "threads (one process) | mpi (under mpirun)")
      ->type_name("NAME")
      ->capture_default_str();
  cmd->add_option("--dtype", a.dtype, "compute dtype: f32 | bf16 (f32 accumulation)")
      ->type_name("NAME")
      ->capture_default_str();
  cmd->add_option("--threads-per-rank", a.threads_per_rank, kThreadsPerRankHelp)->type_name("T");
  cmd->add_option("--comm-timeout", a.comm_timeout,
                  "seconds a rank waits for a peer before failing")
      ->type_name("SECONDS")
      ->capture_default_str();
  cmd->footer(
      "\nExample:\n  ringsplash attend --q q.npy --k k.npy --v v.npy --out out.npy --mask causal "
      "--ranks 4\n\nOutputs are written to temporary files and renamed when complete; on any "
      "error none is left. See docs/CLI.md.");
  return cmd;
}

void RunAttend(const AttendArgs& args) {
  const AttendPlan plan = CheckArgs(args);
  if (plan.backend == Backend::kMpi) {
    RunAttendMpi(args, plan);
  } else {
    RunAttendThreads(args, plan);
  }
}

}  // namespace ringsplash::cli

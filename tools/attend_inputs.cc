// Command-line and input-file checks of `ringsplash attend`.
#include "tools/attend_inputs.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <system_error>
#include <utility>

#include "ringsplash/error.h"
#include "tools/cli_common.h"

namespace ringsplash::cli {
namespace {

// "k.npy: expected 4 dims [B, Skv, Hkv, D], got [4, 16]".
void ExpectRank(const npy::NpyArray& a, int ndim, const char* names) {
  Check(a.ndim() == ndim, a.path(), ": expected ", ndim, " dim", ndim == 1 ? "" : "s", " ", names,
        ", got ", npy::ShapeString(a.shape()));
}

// "v.npy: dim 1 (Skv) is 15, but k.npy has Skv = 16".
void ExpectDim(const npy::NpyArray& a, int dim, int64_t want, const char* name,
               const std::string& source) {
  Check(a.shape()[dim] == want, a.path(), ": dim ", dim, " (", name, ") is ", a.shape()[dim],
        ", but ", source, " has ", name, " = ", want);
}

void ExpectFloat(const npy::NpyArray& a, const char* what) {
  Check(npy::IsFloat(a.type()), a.path(), ": ", what, " must be float32 or float16, got '",
        npy::Descr(a.type()), "'");
}

void ExpectInteger(const npy::NpyArray& a, const char* what) {
  Check(a.type() == npy::NpyType::kI32 || a.type() == npy::NpyType::kI64, a.path(), ": ", what,
        " must be int32 (or int64), got '", npy::Descr(a.type()), "'");
}

npy::NpyArray OpenIf(const std::string& path) {
  return path.empty() ? npy::NpyArray() : npy::NpyArray::Open(path);
}

// The directory entry an output path names, independent of spelling
// ("o.npy", "./o.npy", "/abs/dir/o.npy", a directory reached through a
// symbolic link): the resolved directory plus the file name. Outputs are
// renamed into place (pending_outputs.h), so it is the entry that counts:
// a symbolic or hard link to another output is a different entry, replaced
// rather than written through. A directory that does not exist cannot be
// resolved; the lexical form stands in (creating the output fails later).
std::filesystem::path OutputEntry(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec);
  if (ec) return std::filesystem::path(path).lexically_normal();
  const std::filesystem::path dir = std::filesystem::canonical(abs.parent_path(), ec);
  if (ec) return abs.lexically_normal();
  return dir / abs.filename();
}

}  // namespace

AttendPlan CheckArgs(const AttendArgs& args) {
  AttendPlan plan;
  try {
    plan.layout = ParseLayout(args.layout);
  } catch (const Error&) {
    Usage("--layout: expected contiguous, zigzag or striped, got '", args.layout, "'");
  }
  if (args.backend == "threads") {
    plan.backend = Backend::kThreads;
  } else if (args.backend == "mpi") {
    plan.backend = Backend::kMpi;
  } else {
    Usage("--backend: expected threads or mpi, got '", args.backend, "'");
  }
  if (args.dtype == "f32") {
    plan.dtype = DType::kF32;
  } else if (args.dtype == "bf16") {
    plan.dtype = DType::kBF16;
  } else {
    Usage("--dtype: expected f32 or bf16, got '", args.dtype, "'");
  }
  try {
    plan.text_mask = Mask::Parse(args.mask);
  } catch (const Error& e) {
    Usage("--mask: ", e.what());
  }
  if (args.softcap && !(std::isfinite(*args.softcap) && *args.softcap > 0)) {
    Usage("--softcap: expected a finite number > 0, got ", *args.softcap);
  }
  if (args.scale && !(std::isfinite(*args.scale) && *args.scale > 0)) {
    Usage("--scale: expected a finite number > 0, got ", *args.scale);
  }
  if (args.ranks && (*args.ranks < 1 || *args.ranks > 4096)) {
    Usage("--ranks: expected 1 to 4096, got ", *args.ranks);
  }
  if (args.ulysses < 1 || args.ulysses > 4096) {
    Usage("--ulysses: expected 1 to 4096, got ", args.ulysses);
  }
  CheckThreadsPerRank(args.threads_per_rank);
  if (!(std::isfinite(args.comm_timeout) && args.comm_timeout > 0)) {
    Usage("--comm-timeout: expected a number of seconds > 0, got ", args.comm_timeout);
  }
  if (args.q_segments.empty() != args.kv_segments.empty()) {
    Usage(args.q_segments.empty() ? "--kv-segments needs --q-segments"
                                  : "--q-segments needs --kv-segments",
          " (segment ids come in pairs)");
  }
  plan.backward = !args.dout.empty();
  const std::pair<const char*, const std::string*> grads[] = {
      {"--dq", &args.dq}, {"--dk", &args.dk}, {"--dv", &args.dv}, {"--dsinks", &args.dsinks}};
  bool any_grad = false;
  for (const auto& [flag, path] : grads) {
    if (path->empty()) continue;
    any_grad = true;
    if (!plan.backward) Usage(flag, " needs --dout (the gradient of out that drives backward)");
  }
  if (plan.backward && !any_grad) {
    Usage("--dout needs at least one of --dq, --dk, --dv, --dsinks to write");
  }
  if (!args.dsinks.empty() && args.sinks.empty()) Usage("--dsinks needs --sinks");
  // Two outputs naming one file would silently lose one of them (or, spelt
  // differently, collide on their temporaries): compare the directory
  // entries named, not the strings.
  const std::pair<const char*, const std::string*> outs[] = {
      {"--out", &args.out}, {"--lse", &args.lse}, {"--dq", &args.dq},
      {"--dk", &args.dk},   {"--dv", &args.dv},   {"--dsinks", &args.dsinks}};
  for (size_t i = 0; i < std::size(outs); ++i) {
    const auto& [flag, path] = outs[i];
    if (path->empty()) continue;
    for (size_t j = 0; j < i; ++j) {
      const auto& [first_flag, first_path] = outs[j];
      if (first_path->empty() || OutputEntry(*first_path) != OutputEntry(*path)) continue;
      if (*first_path == *path) {
        Usage(first_flag, " and ", flag, " name the same file '", *path, "'");
      }
      Usage(first_flag, " and ", flag, " name the same file ('", *first_path, "' and '", *path,
            "')");
    }
  }
  // An output written over an input would replace the user's data (after it
  // was read: outputs are renamed into place at the end).
  const std::pair<const char*, const std::string*> ins[] = {{"--q", &args.q},
                                                            {"--k", &args.k},
                                                            {"--v", &args.v},
                                                            {"--dout", &args.dout},
                                                            {"--sinks", &args.sinks},
                                                            {"--dense-mask", &args.dense_mask},
                                                            {"--q-segments", &args.q_segments},
                                                            {"--kv-segments", &args.kv_segments}};
  for (const auto& [flag, path] : outs) {
    if (path->empty()) continue;
    for (const auto& [in_flag, in_path] : ins) {
      if (in_path->empty()) continue;
      // The input's own entry, or the file it links to (replacing that
      // entry would replace the data the link reads).
      std::error_code ec;
      const std::filesystem::path target = std::filesystem::canonical(*in_path, ec);
      const std::filesystem::path out_entry = OutputEntry(*path);
      if (OutputEntry(*in_path) != out_entry && (ec || target != out_entry)) continue;
      Usage(flag, " '", *path, "' would overwrite the input ", in_flag, " '", *in_path, "'");
    }
  }
  return plan;
}

AttendFiles OpenInputs(const AttendArgs& args, const AttendPlan& plan) {
  AttendFiles f;
  f.q = npy::NpyArray::Open(args.q);
  f.k = npy::NpyArray::Open(args.k);
  f.v = npy::NpyArray::Open(args.v);
  ExpectRank(f.q, 4, "[B, Sq, H, D]");
  ExpectRank(f.k, 4, "[B, Skv, Hkv, D]");
  ExpectRank(f.v, 4, "[B, Skv, Hkv, Dv]");
  ExpectFloat(f.q, "q");
  ExpectFloat(f.k, "k");
  ExpectFloat(f.v, "v");
  for (const npy::NpyArray* a : {&f.q, &f.k, &f.v}) {
    for (int64_t d : a->shape()) {
      Check(d > 0, a->path(), ": every dimension must be > 0, got ", npy::ShapeString(a->shape()));
    }
  }
  Dims& d = f.dims;
  d.b = f.q.shape()[0];
  d.sq = f.q.shape()[1];
  d.h = f.q.shape()[2];
  d.d = f.q.shape()[3];
  d.skv = f.k.shape()[1];
  d.hkv = f.k.shape()[2];
  d.dv = f.v.shape()[3];
  // The kernels' limit, checked here so that the message names the file.
  Check(d.d <= kMaxHeadDim, args.q, ": head dim D = ", d.d, " is above ", kMaxHeadDim,
        ", the largest the kernels support, in ", npy::ShapeString(f.q.shape()));
  Check(d.dv <= kMaxHeadDim, args.v, ": value head dim Dv = ", d.dv, " is above ", kMaxHeadDim,
        ", the largest the kernels support, in ", npy::ShapeString(f.v.shape()));
  ExpectDim(f.k, 0, d.b, "B", args.q);
  ExpectDim(f.k, 3, d.d, "D", args.q);
  Check(d.h % d.hkv == 0, args.k, ": key/value heads Hkv = ", d.hkv,
        " must divide the query heads H = ", d.h, " of ", args.q);
  ExpectDim(f.v, 0, d.b, "B", args.k);
  ExpectDim(f.v, 1, d.skv, "Skv", args.k);
  ExpectDim(f.v, 2, d.hkv, "Hkv", args.k);

  if (plan.backward) {
    f.dout = npy::NpyArray::Open(args.dout);
    ExpectRank(f.dout, 4, "[B, Sq, H, Dv] (the shape of out)");
    ExpectFloat(f.dout, "dout");
    ExpectDim(f.dout, 0, d.b, "B", args.q);
    ExpectDim(f.dout, 1, d.sq, "Sq", args.q);
    ExpectDim(f.dout, 2, d.h, "H", args.q);
    ExpectDim(f.dout, 3, d.dv, "Dv", args.v);
  }
  f.sinks = OpenIf(args.sinks);
  if (!args.sinks.empty()) {
    ExpectRank(f.sinks, 1, "[H]");
    ExpectFloat(f.sinks, "sinks");
    ExpectDim(f.sinks, 0, d.h, "H", args.q);
    // [H] values, read once here so that a bad one names the file (the
    // library would say only "sinks[h]", and from inside a rank).
    const Tensor sinks = f.sinks.Load(DType::kF32, "sinks");
    for (int64_t h = 0; h < d.h; ++h) {
      const float s = sinks.data_as<float>()[h];
      // -inf: no sink for that head (the library's rule, attention.h).
      Check(!std::isnan(s) && s != std::numeric_limits<float>::infinity(), args.sinks, ": sinks[",
            h, "] is ", s, "; sink logits must be finite or -inf (no sink)");
    }
  }
  f.q_segments = OpenIf(args.q_segments);
  f.kv_segments = OpenIf(args.kv_segments);
  if (!args.q_segments.empty()) {
    ExpectRank(f.q_segments, 2, "[B, Sq]");
    ExpectRank(f.kv_segments, 2, "[B, Skv]");
    ExpectInteger(f.q_segments, "q segment ids");
    ExpectInteger(f.kv_segments, "kv segment ids");
    ExpectDim(f.q_segments, 0, d.b, "B", args.q);
    ExpectDim(f.q_segments, 1, d.sq, "Sq", args.q);
    ExpectDim(f.kv_segments, 0, d.b, "B", args.k);
    ExpectDim(f.kv_segments, 1, d.skv, "Skv", args.k);
  }
  f.dense_mask = OpenIf(args.dense_mask);
  if (!args.dense_mask.empty()) {
    const npy::NpyArray& m = f.dense_mask;
    Check(!npy::IsFloat(m.type()), m.path(), ": a dense mask must be bool (or integer), got '",
          npy::Descr(m.type()), "'");
    Check(m.ndim() == 2 || m.ndim() == 3, m.path(), ": expected 2 dims [Sq, Skv] or 3 dims ",
          "[H, Sq, Skv], got ", npy::ShapeString(m.shape()));
    const int o = m.ndim() - 2;
    if (o == 1) ExpectDim(m, 0, d.h, "H", args.q);
    ExpectDim(m, o, d.sq, "Sq", args.q);
    ExpectDim(m, o + 1, d.skv, "Skv", args.k);
  }
  return f;
}

void CheckDivisible(const AttendFiles& files, Layout layout, int ranks) {
  if (ranks <= 1) return;
  const int64_t div = layout == Layout::kZigzag ? 2 * int64_t{ranks} : ranks;
  const char* how = layout == Layout::kZigzag ? " (2 x ranks for --layout zigzag)" : "";
  Check(files.dims.sq % div == 0, files.q.path(), ": sequence length Sq = ", files.dims.sq,
        " does not divide by ", div, how, " with ", ranks, " ranks");
  Check(files.dims.skv % div == 0, files.k.path(), ": sequence length Skv = ", files.dims.skv,
        " does not divide by ", div, how, " with ", ranks, " ranks");
}

Mask BuildMask(const AttendFiles& files, const AttendPlan& plan) {
  const npy::NpyArray& m = files.dense_mask;
  if (m.path().empty()) return plan.text_mask;
  // Mask::Dense takes bytes, non-zero = allowed: one-byte files copy as they
  // are; wider integers are reduced to 0/1 (no second full-size copy).
  std::vector<uint8_t> values(static_cast<size_t>(m.numel()));
  if (npy::ItemSize(m.type()) == 1) {
    std::memcpy(values.data(), m.data(), values.size());
  } else {
    Tensor t = m.Load(DType::kBool, "dense mask");
    std::memcpy(values.data(), t.data(), values.size());
  }
  const int64_t heads = m.ndim() == 3 ? m.shape()[0] : 0;
  return plan.text_mask & Mask::Dense(std::move(values), heads, files.dims.sq, files.dims.skv);
}

Mask BuildMaskRows(const AttendFiles& files, const AttendPlan& plan,
                   const std::vector<int64_t>& q_rows) {
  const npy::NpyArray& m = files.dense_mask;
  if (m.path().empty()) return plan.text_mask;
  // Only this rank's rows of the (memory-mapped) file are read and kept:
  // Sq/N x Skv bytes per head instead of the whole Sq x Skv.
  const int64_t heads = m.ndim() == 3 ? m.shape()[0] : 0;
  const int64_t sq = files.dims.sq, skv = files.dims.skv;
  const size_t item = npy::ItemSize(m.type());
  std::vector<uint8_t> values(static_cast<size_t>(std::max<int64_t>(heads, 1)) * q_rows.size() *
                              static_cast<size_t>(skv));
  uint8_t* out = values.data();
  for (int64_t h = 0; h < std::max<int64_t>(heads, 1); ++h) {
    for (const int64_t row : q_rows) {
      const auto* src = reinterpret_cast<const uint8_t*>(m.data()) +
                        static_cast<size_t>((h * sq + row) * skv) * item;
      for (int64_t j = 0; j < skv; ++j, ++out) {
        // Non-zero = allowed, whatever the integer width.
        bool any = false;
        for (size_t b = 0; b < item; ++b) any |= src[static_cast<size_t>(j) * item + b] != 0;
        *out = any ? 1 : 0;
      }
    }
  }
  return plan.text_mask & Mask::DenseRows(std::move(values), heads, q_rows, skv);
}

std::vector<OutputSpec> PlanOutputs(const AttendArgs& args, const Dims& d) {
  std::vector<OutputSpec> outs;
  auto add = [&](OutputKind kind, const std::string& path, std::vector<int64_t> shape, RowsOf rows,
                 int64_t batch, int64_t seq, int64_t inner) {
    if (!path.empty()) outs.push_back({kind, path, std::move(shape), rows, batch, seq, inner});
  };
  using enum OutputKind;
  add(kOut, args.out, {d.b, d.sq, d.h, d.dv}, RowsOf::kQuery, d.b, d.sq, d.h * d.dv);
  add(kLse, args.lse, {d.b, d.h, d.sq}, RowsOf::kQuery, d.b * d.h, d.sq, 1);
  add(kDq, args.dq, {d.b, d.sq, d.h, d.d}, RowsOf::kQuery, d.b, d.sq, d.h * d.d);
  add(kDk, args.dk, {d.b, d.skv, d.hkv, d.d}, RowsOf::kKeyValue, d.b, d.skv, d.hkv * d.d);
  add(kDv, args.dv, {d.b, d.skv, d.hkv, d.dv}, RowsOf::kKeyValue, d.b, d.skv, d.hkv * d.dv);
  add(kDsinks, args.dsinks, {d.h}, RowsOf::kNone, 1, 1, d.h);
  return outs;
}

}  // namespace ringsplash::cli

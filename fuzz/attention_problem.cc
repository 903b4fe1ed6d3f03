// Decoding fuzzer bytes into an attention call (see attention_problem.h).
#include "fuzz/attention_problem.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "ringsplash/error.h"
#include "ringsplash/mask.h"

namespace ringsplash::fuzz {
namespace {

using Rng = std::mt19937_64;

// How a tensor argument's memory is laid out behind its logical shape.
enum class Storage {
  kContiguous,
  kTransposed,  // dims 1 and 2 swapped in memory ([B, H, S, D] viewed as [B, S, H, D])
  kPadded,      // gaps between rows and/or an element step of 2
  kBroadcast,   // one dim with stride 0 (inputs only: every index reads one row)
  kNegative,    // one dim walks memory backwards (data points at its last row)
};

// The ways a call is deliberately broken. Each one is invalid (or, where the
// contract is silent, uncertain) and names the argument a message must start
// with.
enum class Mut {
  kNone,
  kKDtype,
  kVDtype,
  kHkvNotDividing,
  kKBatch,
  kKHeadDim,
  kVSeq,
  kVHeads,
  kQNdim,
  kZeroDim,
  kQIntDtype,
  kHeadDimTooLarge,
  kOutShape,
  kOutDtype,
  kLseDtype,
  kLseShape,
  kNullQ,
  kNullOut,
  kNegativeStride,
  kOneSegment,
  kSegDtype,
  kSegShape,
  kSinksDtype,
  kSinksShape,
  kPosCount,
  kPosNegative,
  kMaskHeads,
  kDenseExtent,
  kScale,
  kSoftcap,
  kBlockSize,
  kThreads,
  // Backward-only arguments.
  kDoutShape,
  kDqShape,
  kDkDtype,
  kDvNull,
  kDsinksMissing,
  kDsinksExtra,
  kCount,
};

std::array<int64_t, kMaxDims> COrder(const std::vector<int64_t>& shape) {
  std::array<int64_t, kMaxDims> s{};
  int64_t acc = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= std::max<int64_t>(shape[i], 1);
  }
  return s;
}

// A fresh argument of logical `shape` stored as `st`; `pick` chooses the
// affected dim / padding.
Arg BuildArg(DType dtype, const std::vector<int64_t>& shape, Storage st, int pick) {
  Arg a;
  TensorView v;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  bool empty = false;
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape[i];
    empty = empty || shape[i] <= 0;
  }
  const int n = v.ndim;
  if (empty || n == 0) st = Storage::kContiguous;
  int64_t start = 0;  // element offset of index (0, 0, 0, 0)
  switch (st) {
    case Storage::kContiguous:
      v.stride = COrder(shape);
      break;
    case Storage::kTransposed: {
      if (n < 3) {
        v.stride = COrder(shape);
        break;
      }
      std::vector<int64_t> stored = shape;
      std::swap(stored[1], stored[2]);
      v.stride = COrder(stored);
      std::swap(v.stride[1], v.stride[2]);
      break;
    }
    case Storage::kPadded: {
      const int64_t step = 1 + pick % 2;
      const int64_t pad = 1 + pick % 3;
      v.stride[n - 1] = step;
      for (int i = n - 2; i >= 0; --i) v.stride[i] = v.stride[i + 1] * shape[i + 1] + pad;
      break;
    }
    case Storage::kBroadcast: {
      const int k = pick % n;
      std::vector<int64_t> one = shape;
      one[k] = 1;
      v.stride = COrder(one);
      v.stride[k] = 0;
      break;
    }
    case Storage::kNegative: {
      const int k = pick % n;
      v.stride = COrder(shape);
      start = (shape[k] - 1) * v.stride[k];
      v.stride[k] = -v.stride[k];
      break;
    }
  }
  int64_t max_off = 0;
  if (!empty) {
    for (int i = 0; i < n; ++i) max_off += (shape[i] - 1) * std::abs(v.stride[i]);
  }
  a.storage = Tensor(dtype, {max_off + 1});
  v.data = static_cast<char*>(a.storage.data()) + start * static_cast<int64_t>(DTypeSize(dtype));
  a.view = v;
  return a;
}

bool IsFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// Fills the whole storage (so every element a view can reach is defined):
// floats uniform in [lo, hi] (rounded to the dtype), i32 uniform integers,
// bool 0/1.
void Fill(Arg& a, Rng& rng, double lo, double hi) {
  const int64_t n = a.storage.numel();
  const TensorView flat = a.storage.view();
  if (IsFloat(flat.dtype)) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < n; ++i) StoreFromF32(flat, i, static_cast<float>(dist(rng)));
  } else if (flat.dtype == DType::kI32) {
    std::uniform_int_distribution<int32_t> dist(static_cast<int32_t>(lo), static_cast<int32_t>(hi));
    for (int64_t i = 0; i < n; ++i) a.storage.data_as<int32_t>()[i] = dist(rng);
  } else {
    for (int64_t i = 0; i < n; ++i) a.storage.data_as<uint8_t>()[i] = rng() & 1;
  }
}

// Outputs start as NaN so an element the API forgets to write is caught.
void FillNaN(Arg& a) {
  const TensorView flat = a.storage.view();
  if (!IsFloat(flat.dtype)) return;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    StoreFromF32(flat, i, std::numeric_limits<float>::quiet_NaN());
  }
}

Storage InputStorage(ByteReader& r) {
  const Storage kinds[] = {Storage::kContiguous, Storage::kContiguous, Storage::kTransposed,
                           Storage::kPadded, Storage::kBroadcast};
  return r.Pick(kinds);
}

Storage OutputStorage(ByteReader& r) {
  const Storage kinds[] = {Storage::kContiguous, Storage::kContiguous, Storage::kTransposed,
                           Storage::kPadded};
  return r.Pick(kinds);
}

// Outputs never get broadcast or backward storage: overlapping outputs are
// not a meaningful request.
enum class Role { kInput, kOutput };

// Reads the storage choice from `r` (in a fixed order: C++ leaves the order
// of evaluating function arguments open, and the decoding must not depend on
// the compiler) and builds the argument; `force` overrides the choice.
Arg MakeArg(ByteReader& r, DType dtype, const std::vector<int64_t>& shape, Role role,
            std::optional<Storage> force = std::nullopt) {
  const Storage chosen = role == Role::kInput ? InputStorage(r) : OutputStorage(r);
  const int pick = r.U8();
  return BuildArg(dtype, shape, force.value_or(chosen), pick);
}

std::vector<int64_t> GenPositions(ByteReader& r, int64_t n, Rng& rng) {
  std::vector<int64_t> pos;
  const int kind = static_cast<int>(r.Range(0, 5));
  if (kind <= 1) return pos;  // default 0..n-1
  const int64_t base = r.Range(0, 60);
  const int64_t step = r.Range(2, 4);
  for (int64_t i = 0; i < n; ++i) {
    switch (kind) {
      case 2:
        pos.push_back(base + i);
        break;
      case 3:
        pos.push_back(base + step * i + 1);
        break;
      case 4:  // two chunks, as the zigzag layout deals them
        pos.push_back(i < (n + 1) / 2 ? base + i : base + 2 * n + i);
        break;
      default:  // any order, repeats allowed
        pos.push_back(static_cast<int64_t>(rng() % 120));
        break;
    }
  }
  return pos;
}

struct MaskContext {
  int64_t h = 1;
  int64_t dense_sq = 1, dense_skv = 1;  // extents Dense leaves cover
  int64_t dense_heads_extra = 0;        // 1: Dense leaves built for H + 1 heads
  Rng* rng = nullptr;
};

Mask GenMask(ByteReader& r, const MaskContext& c, int depth, bool head_dependent_ok) {
  const int64_t top = depth >= 2 ? 4 : (head_dependent_ok ? 7 : 6);
  switch (r.Range(0, top)) {
    case 0:
      return Mask::Full();
    case 1:
      return Mask::Causal(r.Range(-20, 20));
    case 2: {
      std::optional<int64_t> left, right;
      if (r.Range(0, 3) != 0) left = r.Range(0, 20);
      if (r.Range(0, 3) != 0) right = r.Range(0, 20);
      return Mask::Local(left, right, r.Range(-10, 10));
    }
    case 3:
      return Mask::ChunkedCausal(r.Range(1, 20));
    case 4: {
      const int64_t heads =
          head_dependent_ok && r.Bool() ? c.h + c.dense_heads_extra : c.dense_heads_extra;
      const uint64_t density = r.Range(0, 4);  // allowed with probability density / 4
      std::vector<uint8_t> values(
          static_cast<size_t>(std::max<int64_t>(heads, 1) * c.dense_sq * c.dense_skv));
      for (uint8_t& x : values) x = ((*c.rng)() % 4) < density ? 1 : 0;
      return Mask::Dense(std::move(values), heads, c.dense_sq, c.dense_skv);
    }
    case 5: {
      const Mask a = GenMask(r, c, depth + 1, head_dependent_ok);
      const Mask b = GenMask(r, c, depth + 1, head_dependent_ok);
      return a & b;
    }
    case 6: {
      const Mask a = GenMask(r, c, depth + 1, head_dependent_ok);
      const Mask b = GenMask(r, c, depth + 1, head_dependent_ok);
      return a | b;
    }
    default: {
      std::vector<Mask> heads;
      for (int64_t i = 0; i < c.h; ++i) heads.push_back(GenMask(r, c, depth + 1, false));
      return Mask::PerHead(std::move(heads));
    }
  }
}

int64_t MaxOr(const std::vector<int64_t>& pos, int64_t n) {
  return pos.empty() ? n - 1 : *std::max_element(pos.begin(), pos.end());
}

double MaxAbsFloat(const TensorView& t) {
  double m = 0;
  if (!t.defined() || !IsFloat(t.dtype)) return 0;
  // Over the storage a view reaches is enough for a bound; walk the view.
  for (int64_t i0 = 0; i0 < (t.ndim > 0 ? t.shape[0] : 1); ++i0)
    for (int64_t i1 = 0; i1 < (t.ndim > 1 ? t.shape[1] : 1); ++i1)
      for (int64_t i2 = 0; i2 < (t.ndim > 2 ? t.shape[2] : 1); ++i2)
        for (int64_t i3 = 0; i3 < (t.ndim > 3 ? t.shape[3] : 1); ++i3)
          m = std::max(m, std::fabs(static_cast<double>(LoadAsF32(t, t.Offset(i0, i1, i2, i3)))));
  return m;
}

std::string Dims(const TensorView& t) {
  if (!t.defined()) return "none";
  std::ostringstream os;
  os << t.Describe() << " strides (";
  for (int i = 0; i < t.ndim; ++i) os << (i ? ", " : "") << t.stride[i];
  os << ")";
  return os.str();
}

}  // namespace

std::string Verdict::Describe() const {
  std::ostringstream os;
  os << (invalid ? "invalid" : uncertain ? "uncertain" : "valid");
  for (const std::string& r : reasons) os << "; " << r;
  return os.str();
}

std::string FuzzProblem::Describe() const {
  std::ostringstream os;
  os << "q " << Dims(in.q) << ", k " << Dims(in.k) << ", v " << Dims(in.v) << ", sinks "
     << Dims(in.sinks) << ", q_segments " << Dims(in.q_segments) << ", kv_segments "
     << Dims(in.kv_segments) << ", q_positions " << in.q_positions.size() << ", kv_positions "
     << in.kv_positions.size() << ", out " << Dims(out.view) << ", lse " << Dims(lse.view)
     << "; mask " << opt.mask.ToString() << ", scale "
     << (opt.scale ? std::to_string(*opt.scale) : "default") << ", softcap "
     << (opt.softcap ? std::to_string(*opt.softcap) : "none") << ", blocks " << opt.block_sizes.q
     << "x" << opt.block_sizes.kv << ", threads " << opt.num_threads << ", kernel "
     << KernelPathName(opt.kernel_path) << "; forward " << forward.Describe();
  if (backward) {
    os << "; backward: dout " << Dims(dout.view) << ", dq " << Dims(dq.view) << ", dk "
       << Dims(dk.view) << ", dv " << Dims(dv.view) << ", dsinks " << Dims(dsinks.view) << "; "
       << backward_verdict.Describe();
  }
  return os.str();
}

FuzzProblem DecodeProblem(ByteReader& r) {
  FuzzProblem p;
  Rng rng(r.U32());

  // Up to two deliberate breakages.
  Mut muts[2] = {Mut::kNone, Mut::kNone};
  const uint8_t how_many = r.U8();
  const int nmut = how_many < 150 ? 0 : how_many < 230 ? 1 : 2;
  for (int i = 0; i < nmut; ++i) {
    muts[i] = static_cast<Mut>(r.Range(1, static_cast<int64_t>(Mut::kCount) - 1));
  }
  auto has = [&](Mut m) { return muts[0] == m || muts[1] == m; };

  // Sizes.
  const int64_t b = r.Range(1, 2);
  const int64_t sq = r.Range(1, 40);
  const int64_t skv = r.Range(1, 40);
  const int64_t h = r.Range(1, 4);
  std::vector<int64_t> divisors;
  for (int64_t x = 1; x <= h; ++x) {
    if (h % x == 0) divisors.push_back(x);
  }
  int64_t hkv =
      divisors[static_cast<size_t>(r.Range(0, static_cast<int64_t>(divisors.size()) - 1))];
  int64_t d = r.Range(1, 40);
  const int64_t dv = r.Range(1, 40);
  const DType dtypes[] = {DType::kF32, DType::kF32, DType::kBF16, DType::kF16};
  const DType dt = r.Pick(dtypes);
  const double qk_ranges[] = {1.0, 1.0, 4.0, 20.0};
  const double qk_range = r.Pick(qk_ranges);
  const bool want_sinks = r.Range(0, 3) == 0;
  const bool want_segments = r.Range(0, 3) == 0;
  p.backward = r.Bool();

  Verdict& fv = p.forward;
  Verdict& bv = p.backward_verdict;
  if (has(Mut::kHkvNotDividing)) {
    hkv = h + 1;
    fv.Invalid("Hkv does not divide H", {"k"});
  }
  if (has(Mut::kHeadDimTooLarge)) {
    d = r.Range(257, 300);
    fv.Uncertain("head dim above the kernels' maximum");
  }

  // q, k, v.
  std::vector<int64_t> qs = {b, sq, h, d}, ks = {b, skv, hkv, d}, vs = {b, skv, hkv, dv};
  DType qdt = dt, kdt = dt, vdt = dt;
  if (has(Mut::kKDtype)) {
    kdt = dt == DType::kF32 ? DType::kBF16 : DType::kF32;
    fv.Invalid("k dtype differs from q", {"k"});
  }
  if (has(Mut::kVDtype)) {
    vdt = dt == DType::kF16 ? DType::kF32 : DType::kF16;
    fv.Invalid("v dtype differs from q", {"v"});
  }
  if (has(Mut::kQIntDtype)) {
    qdt = kdt = vdt = DType::kI32;
    fv.Invalid("q is not a float tensor", {"q"});
  }
  if (has(Mut::kKBatch)) {
    ks[0] += 1;
    fv.Invalid("k batch differs from q", {"k"});
  }
  if (has(Mut::kKHeadDim)) {
    ks[3] += 1;
    fv.Invalid("k head dim differs from q", {"k"});
  }
  if (has(Mut::kVSeq)) {
    vs[1] += 1;
    fv.Invalid("v sequence length differs from k", {"v"});
  }
  if (has(Mut::kVHeads)) {
    vs[2] += 1;
    fv.Invalid("v heads differ from k", {"v"});
  }
  if (has(Mut::kQNdim)) {
    qs.pop_back();
    fv.Invalid("q has 3 dims", {"q"});
  }
  if (has(Mut::kZeroDim)) {
    std::vector<int64_t>* shapes[] = {&qs, &ks, &vs};
    std::vector<int64_t>& s = *shapes[r.Range(0, 2)];
    s[static_cast<size_t>(r.Range(0, static_cast<int64_t>(s.size()) - 1))] = 0;
    fv.Uncertain("an empty dimension");
  }
  const int negative_arg = has(Mut::kNegativeStride) ? static_cast<int>(r.Range(0, 2)) : -1;
  auto force = [&](int which) {
    return which == negative_arg ? std::optional<Storage>(Storage::kNegative) : std::nullopt;
  };
  p.q = MakeArg(r, qdt, qs, Role::kInput, force(0));
  p.k = MakeArg(r, kdt, ks, Role::kInput, force(1));
  p.v = MakeArg(r, vdt, vs, Role::kInput, force(2));
  if (negative_arg >= 0) fv.Uncertain("a negative stride in an input");
  Fill(p.q, rng, -qk_range, qk_range);
  Fill(p.k, rng, -qk_range, qk_range);
  Fill(p.v, rng, -1.0, 1.0);
  p.in.q = p.q.view;
  p.in.k = p.k.view;
  p.in.v = p.v.view;
  if (has(Mut::kNullQ)) {
    p.in.q.data = nullptr;
    fv.Invalid("q has no data", {"q"});
  }

  // Sinks and segment ids.
  double max_sink = 0;
  if (want_sinks || has(Mut::kSinksDtype) || has(Mut::kSinksShape)) {
    const DType sdt = has(Mut::kSinksDtype) ? DType::kBF16 : DType::kF32;
    const int64_t sh = has(Mut::kSinksShape) ? h + 1 : h;
    p.sinks = MakeArg(r, sdt, {sh}, Role::kInput);
    const double ranges[] = {2.0, 2.0, 50.0};
    max_sink = r.Pick(ranges);
    Fill(p.sinks, rng, -max_sink, max_sink);
    p.in.sinks = p.sinks.view;
    if (has(Mut::kSinksDtype)) fv.Invalid("sinks are not f32", {"sinks"});
    if (has(Mut::kSinksShape)) fv.Invalid("sinks have H + 1 entries", {"sinks"});
  }
  if (want_segments || has(Mut::kOneSegment) || has(Mut::kSegDtype) || has(Mut::kSegShape)) {
    const DType sdt = has(Mut::kSegDtype) ? DType::kF32 : DType::kI32;
    const int64_t qlen = has(Mut::kSegShape) ? sq + 1 : sq;
    p.q_seg = MakeArg(r, sdt, {b, qlen}, Role::kInput);
    p.kv_seg = MakeArg(r, sdt, {b, skv}, Role::kInput);
    // kv ids 1..4 against q ids 0..3: rows with id 0 have no key at all.
    Fill(p.q_seg, rng, 0, 3);
    Fill(p.kv_seg, rng, 1, 4);
    p.in.q_segments = p.q_seg.view;
    p.in.kv_segments = p.kv_seg.view;
    if (has(Mut::kOneSegment)) {
      p.in.kv_segments = TensorView();
      fv.Invalid("q segment ids without kv segment ids", {"q_segments", "kv_segments"});
    }
    if (has(Mut::kSegDtype)) fv.Invalid("segment ids are not i32", {"q_segments", "kv_segments"});
    if (has(Mut::kSegShape)) fv.Invalid("q segment ids have Sq + 1 columns", {"q_segments"});
  }

  // Positions.
  p.in.q_positions = GenPositions(r, sq, rng);
  p.in.kv_positions = GenPositions(r, skv, rng);
  if (has(Mut::kPosCount)) {
    p.in.q_positions.resize(static_cast<size_t>(sq + 1), 0);
    fv.Invalid("Sq + 1 query positions", {"q_positions"});
  }
  if (has(Mut::kPosNegative)) {
    if (p.in.kv_positions.empty()) {
      for (int64_t i = 0; i < skv; ++i) p.in.kv_positions.push_back(i);
    }
    const int64_t at = r.Range(0, skv - 1);
    p.in.kv_positions[static_cast<size_t>(at)] = -1 - r.Range(0, 5);
    fv.Invalid("a negative kv position", {"kv_positions"});
  }

  // Mask.
  MaskContext mc;
  mc.h = h;
  mc.rng = &rng;
  // At least 1: with a negative kv position (kPosNegative) the largest one
  // may be negative too.
  mc.dense_sq = std::max<int64_t>(1, MaxOr(p.in.q_positions, sq) + 1 + r.Range(0, 3));
  mc.dense_skv = std::max<int64_t>(1, MaxOr(p.in.kv_positions, skv) + 1 + r.Range(0, 3));
  if (has(Mut::kDenseExtent)) mc.dense_sq = std::max<int64_t>(1, MaxOr(p.in.q_positions, sq));
  if (has(Mut::kMaskHeads)) mc.dense_heads_extra = 1;
  try {
    p.opt.mask = GenMask(r, mc, 0, true);
  } catch (const Error&) {
    // A combination the mask algebra itself refuses (e.g. head counts that
    // disagree): not this target's subject.
    p.opt.mask = Mask::Full();
  }
  if (p.opt.mask.has_dense() && MaxOr(p.in.q_positions, sq) >= p.opt.mask.dense_sq()) {
    fv.Invalid("a dense mask smaller than the positions", {"mask"});
  }
  if (p.opt.mask.num_heads() != 0 && p.opt.mask.num_heads() != h) {
    fv.Invalid("a mask built for another number of heads", {"mask"});
  }

  // Options.
  const int64_t scale_kind = r.Range(0, 3);
  if (scale_kind == 1) {
    // 1e-30 stands for a zero scale (uniform attention): the f64 reference
    // reads scale 0 as "default 1/sqrt(D)".
    const float scales[] = {0.01f, 0.1f, 0.5f, 1.0f, 2.0f, -1.0f, 1e-30f, 3.0f};
    p.opt.scale = r.Pick(scales);
  }
  if (has(Mut::kScale)) {
    const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    p.opt.scale = r.Pick(bad);
    fv.Invalid("a non-finite scale", {"scale"});
  }
  if (r.Range(0, 3) == 0) {
    const float caps[] = {0.5f, 5.0f, 30.0f};
    p.opt.softcap = r.Pick(caps);
  }
  if (has(Mut::kSoftcap)) {
    const float bad[] = {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()};
    p.opt.softcap = r.Pick(bad);
    fv.Invalid("a soft cap that is not finite and > 0", {"softcap"});
  }
  const int64_t blocks[] = {16, 32, 48, 64, 128};
  p.opt.block_sizes.q = r.Pick(blocks);
  p.opt.block_sizes.kv = r.Pick(blocks);
  if (has(Mut::kBlockSize)) {
    const int64_t bad[] = {0, -16, 8, 17, 24};
    if (r.Bool()) {
      p.opt.block_sizes.q = r.Pick(bad);
      fv.Invalid("block_sizes.q not a positive multiple of 16", {"block_sizes.q"});
    } else {
      p.opt.block_sizes.kv = r.Pick(bad);
      fv.Invalid("block_sizes.kv not a positive multiple of 16", {"block_sizes.kv"});
    }
  }
  p.opt.num_threads = static_cast<int>(r.Range(0, 4));
  if (has(Mut::kThreads)) {
    p.opt.num_threads = -static_cast<int>(r.Range(1, 3));
    fv.Invalid("a negative thread count", {"num_threads"});
  }
  const std::vector<KernelPath> paths = SupportedKernelPaths();
  p.opt.kernel_path =
      r.Bool() ? KernelPath::kAuto
               : paths[static_cast<size_t>(r.Range(0, static_cast<int64_t>(paths.size()) - 1))];

  // Forward outputs.
  const int64_t osq = qs.size() == 4 ? qs[1] : sq;
  std::vector<int64_t> os = {b, osq, h, dv}, ls = {b, h, osq};
  DType odt = r.Bool() ? DType::kF32 : dt;
  DType ldt = DType::kF32;
  if (has(Mut::kOutShape)) {
    os[static_cast<size_t>(r.Range(0, 3))] += 1;
    fv.Invalid("out has the wrong shape", {"out"});
  }
  if (has(Mut::kOutDtype) && dt != DType::kF16) {
    odt = DType::kF16;
    fv.Invalid("out dtype is neither q's nor f32", {"out"});
  }
  if (has(Mut::kLseDtype)) {
    ldt = DType::kBF16;
    fv.Invalid("lse is not f32", {"lse"});
  }
  if (has(Mut::kLseShape)) {
    ls[static_cast<size_t>(r.Range(0, 2))] += 1;
    fv.Invalid("lse has the wrong shape", {"lse"});
  }
  p.out = MakeArg(r, odt, os, Role::kOutput);
  p.lse = MakeArg(r, ldt, ls, Role::kOutput);
  FillNaN(p.out);
  FillNaN(p.lse);
  if (has(Mut::kNullOut)) {
    p.out.view.data = nullptr;
    fv.Invalid("out has no data", {"out"});
  }

  // Backward arguments.
  if (p.backward) {
    std::vector<int64_t> dos = os;
    if (has(Mut::kDoutShape)) {
      dos[1] += 1;
      bv.Invalid("dout has the wrong shape", {"dout"});
    }
    const DType dout_dt = r.Bool() ? DType::kF32 : dt;
    p.dout = MakeArg(r, dout_dt, dos, Role::kInput);
    Fill(p.dout, rng, -1.0, 1.0);
    std::vector<int64_t> dqs = qs;
    if (has(Mut::kDqShape)) {
      dqs[0] += 1;
      bv.Invalid("dq has the wrong shape", {"dq"});
    }
    DType dkdt = r.Bool() ? DType::kF32 : dt;
    if (has(Mut::kDkDtype) && dt != DType::kF16) {
      dkdt = DType::kF16;
      bv.Invalid("dk dtype is neither q's nor f32", {"dk"});
    }
    const DType gdt = r.Bool() ? DType::kF32 : dt;
    p.dq = MakeArg(r, gdt, dqs, Role::kOutput);
    p.dk = MakeArg(r, dkdt, ks, Role::kOutput);
    p.dv = MakeArg(r, gdt, vs, Role::kOutput);
    FillNaN(p.dq);
    FillNaN(p.dk);
    FillNaN(p.dv);
    if (has(Mut::kDvNull)) {
      p.dv.view.data = nullptr;
      bv.Invalid("dv has no data", {"dv"});
    }
    const bool sinks_given = p.in.sinks.defined();
    if (sinks_given && !has(Mut::kDsinksMissing)) {
      p.dsinks = MakeArg(r, DType::kF32, {h}, Role::kOutput);
      FillNaN(p.dsinks);
    } else if (sinks_given) {
      bv.Invalid("no dsinks although sinks were given", {"dsinks"});
    } else if (has(Mut::kDsinksExtra)) {
      p.dsinks = BuildArg(DType::kF32, {h}, Storage::kContiguous, 0);
      bv.Invalid("dsinks without sinks", {"dsinks"});
    }
  }

  // Bound on |logit| (tolerances grow with it).
  const double scale = p.opt.scale ? std::fabs(*p.opt.scale) : 1.0 / std::sqrt(double(d));
  double bound = scale * static_cast<double>(d) * MaxAbsFloat(p.q.view) * MaxAbsFloat(p.k.view);
  if (p.opt.softcap && *p.opt.softcap > 0) bound = std::min<double>(bound, *p.opt.softcap);
  p.max_logit = std::max(bound, max_sink);
  return p;
}

}  // namespace ringsplash::fuzz

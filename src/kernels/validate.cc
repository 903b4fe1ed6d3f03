// Argument checks of the single-device entry points. Messages follow one
// pattern: "<argument>: expected <what>, got <given>", e.g.
//   "k: expected shape [B=2, Skv, Hkv, D=64] with Hkv dividing H=8, got [2, 128, 3, 64] f32".
#include "src/kernels/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash {

namespace kernels {

namespace {

bool IsFloatLike(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// Common to every tensor argument: non-null data, `ndim` dims, positive
// sizes, non-negative strides.
template <typename Expected>  // streamable: a string, or a Lazy part
void CheckBasic(const TensorView& t, const char* name, int ndim, const Expected& expected) {
  Check(t.data != nullptr, name, ": expected ", expected, ", got no data (null pointer)");
  Check(t.ndim == ndim, name, ": expected ", expected, " (", ndim, " dims), got ", t);
  for (int i = 0; i < t.ndim; ++i) {
    Check(t.shape[i] > 0, name, ": expected ", expected, " with positive sizes, got ", t);
    Check(t.stride[i] >= 0, name, ": expected non-negative strides, got stride ", t.stride[i],
          " in dim ", i, " of ", t);
  }
}

// Outputs are written element by element in parallel, so two indices must
// never share an element: refuse a stride of 0 on a dim of size > 1 and two
// such dims with the same stride (each certainly aliases). Other
// self-overlapping stride patterns are not detected.
void CheckOutputNoOverlap(const TensorView& t, const char* name) {
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 1) continue;
    Check(t.stride[i] != 0, name,
          ": expected an output view whose elements do not overlap, got stride 0 in dim ", i,
          " of size ", t.shape[i], " (", t, ")");
    for (int j = 0; j < i; ++j) {
      Check(t.shape[j] <= 1 || t.stride[j] != t.stride[i], name,
            ": expected an output view whose elements do not overlap, got the same stride ",
            t.stride[i], " in dims ", j, " and ", i, " (", t, ")");
    }
  }
}

template <typename Expected>
void CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> want,
                const Expected& expected) {
  int i = 0;
  for (int64_t w : want) {
    Check(t.shape[i] == w, name, ": expected shape ", expected, ", got ", t);
    ++i;
  }
}

// A float tensor that must have the input dtype or f32 (outputs, gradients).
void CheckOutDType(const TensorView& t, const char* name, DType q_dtype) {
  if (t.dtype == q_dtype || t.dtype == DType::kF32) return;
  if (q_dtype == DType::kF32) {
    Fail(name, ": expected dtype f32 (the dtype of q), got ", t);
  }
  Fail(name, ": expected dtype ", DTypeName(q_dtype), " (the dtype of q) or f32, got ", t);
}

std::string Shape4(const char* a, int64_t av, const char* b, int64_t bv, const char* c, int64_t cv,
                   const char* d, int64_t dv) {
  std::ostringstream os;
  os << '[';
  auto one = [&os](const char* n, int64_t v, bool last) {
    if (v >= 0) {
      os << n << '=' << v;
    } else {
      os << n;
    }
    if (!last) os << ", ";
  };
  one(a, av, false);
  one(b, bv, false);
  one(c, cv, false);
  one(d, dv, true);
  os << ']';
  return os.str();
}

void CheckPositions(const std::vector<int64_t>& pos, int64_t n, const char* name,
                    const char* len_name) {
  if (pos.empty()) return;
  Check(static_cast<int64_t>(pos.size()) == n, name, ": expected ", n, " positions (", len_name,
        "), got ", pos.size());
  for (size_t i = 0; i < pos.size(); ++i) {
    Check(pos[i] >= 0, name, ": expected non-negative global positions, got ", pos[i], " at index ",
          i);
  }
}

int64_t MaxPosition(const std::vector<int64_t>& pos, int64_t n) {
  if (pos.empty()) return n - 1;
  return *std::max_element(pos.begin(), pos.end());
}

void CheckBlockSize(int64_t value, const char* name) {
  Check(value > 0 && value % 16 == 0, name, ": expected a positive multiple of 16, got ", value);
}

}  // namespace

AttentionDims ValidateInputsAndOptions(const AttentionInputs& in, const AttentionOptions& opt,
                                       bool dense_positions) {
  AttentionDims d;
  const TensorView& q = in.q;
  CheckBasic(q, "q", 4, "[B, Sq, H, D]");
  Check(IsFloatLike(q.dtype), "q: expected dtype f32, bf16 or f16, got ", q);
  d.b = q.shape[0];
  d.sq = q.shape[1];
  d.h = q.shape[2];
  d.d = q.shape[3];
  Check(d.d <= kMaxHeadDim, "q: expected head dim D in 1..", kMaxHeadDim, ", got ", q);

  const TensorView& k = in.k;
  const auto k_expect = Lazy([&] {
    return Shape4("B", d.b, "Skv", -1, "Hkv", -1, "D", d.d) +
           " with Hkv dividing H=" + std::to_string(d.h);
  });
  CheckBasic(k, "k", 4, k_expect);
  Check(k.shape[0] == d.b && k.shape[3] == d.d && d.h % k.shape[2] == 0, "k: expected shape ",
        k_expect, ", got ", k);
  Check(k.dtype == q.dtype, "k: expected dtype ", DTypeName(q.dtype), " (the dtype of q), got ", k);
  d.skv = k.shape[1];
  d.hkv = k.shape[2];

  const TensorView& v = in.v;
  const auto v_expect = Lazy([&] {
    return Shape4("B", d.b, "Skv", d.skv, "Hkv", d.hkv, "Dv", -1) + " with Dv in 1.." +
           std::to_string(kMaxHeadDim);
  });
  CheckBasic(v, "v", 4, v_expect);
  Check(
      v.shape[0] == d.b && v.shape[1] == d.skv && v.shape[2] == d.hkv && v.shape[3] <= kMaxHeadDim,
      "v: expected shape ", v_expect, ", got ", v);
  Check(v.dtype == q.dtype, "v: expected dtype ", DTypeName(q.dtype), " (the dtype of q), got ", v);
  d.dv = v.shape[3];

  if (in.sinks.defined() || in.sinks.ndim != 0) {
    const auto e = Lazy([&] { return "[H=" + std::to_string(d.h) + "] f32"; });
    CheckBasic(in.sinks, "sinks", 1, e);
    Check(in.sinks.shape[0] == d.h && in.sinks.dtype == DType::kF32, "sinks: expected ", e,
          ", got ", in.sinks);
    // -inf is "no sink for this head" (SPEC §2.4: exp(-inf) = 0 joins the
    // denominator; combine.cc keeps such heads free of -inf - -inf). A NaN
    // sink would make its whole head NaN and +inf its out 0 and its
    // gradients NaN (dsinks = -sum exp(sink - lse) * D with lse = +inf):
    // refused here, O(H), rather than returned as poisoned results.
    for (int64_t h = 0; h < d.h; ++h) {
      const float s = LoadAsF32(in.sinks, h * in.sinks.stride[0]);
      Check(std::isfinite(s) || s == -std::numeric_limits<float>::infinity(), "sinks[", h,
            "]: expected a finite value or -inf (no sink for this head), got ", s);
    }
  }

  const bool has_qs = in.q_segments.defined();
  const bool has_kvs = in.kv_segments.defined();
  Check(has_qs == has_kvs, has_qs ? "kv_segments" : "q_segments",
        ": expected segment ids for both q and k/v or for neither, got only ",
        has_qs ? "q_segments" : "kv_segments");
  if (has_qs) {
    const auto eq = Lazy(
        [&] { return "[B=" + std::to_string(d.b) + ", Sq=" + std::to_string(d.sq) + "] i32"; });
    CheckBasic(in.q_segments, "q_segments", 2, eq);
    Check(in.q_segments.shape[0] == d.b && in.q_segments.shape[1] == d.sq &&
              in.q_segments.dtype == DType::kI32,
          "q_segments: expected ", eq, ", got ", in.q_segments);
    const auto ek = Lazy(
        [&] { return "[B=" + std::to_string(d.b) + ", Skv=" + std::to_string(d.skv) + "] i32"; });
    CheckBasic(in.kv_segments, "kv_segments", 2, ek);
    Check(in.kv_segments.shape[0] == d.b && in.kv_segments.shape[1] == d.skv &&
              in.kv_segments.dtype == DType::kI32,
          "kv_segments: expected ", ek, ", got ", in.kv_segments);
  }

  CheckPositions(in.q_positions, d.sq, "q_positions", "one per query row, Sq");
  CheckPositions(in.kv_positions, d.skv, "kv_positions", "one per key/value row, Skv");

  const Mask& mask = opt.mask;
  Check(mask.num_heads() == 0 || mask.num_heads() == d.h,
        "mask: expected a head-independent mask or one built for H=", d.h,
        " query heads, got one built for ", mask.num_heads(), " heads (",
        Lazy([&] { return mask.ToString(); }), ")");
  if (mask.has_dense() && dense_positions) {
    const int64_t max_q = MaxPosition(in.q_positions, d.sq);
    const int64_t max_kv = MaxPosition(in.kv_positions, d.skv);
    Check(max_q < mask.dense_sq() && max_kv < mask.dense_skv(),
          "mask: expected a dense mask covering every position (q positions up to ", max_q,
          ", kv positions up to ", max_kv, "), got a dense extent of [", mask.dense_sq(), ", ",
          mask.dense_skv(), "]");
    // A DenseRows leaf holds only its listed rows below its extent.
    std::vector<int64_t> q_pos = in.q_positions;
    if (q_pos.empty()) {
      q_pos.resize(static_cast<size_t>(d.sq));
      std::iota(q_pos.begin(), q_pos.end(), int64_t{0});
    }
    const std::optional<int64_t> missing = mask.FirstUncoveredQuery(q_pos);
    Check(!missing, "mask: expected a dense mask holding a row for every query position, got one (",
          Lazy([&] { return mask.ToString(); }), ") with no row for query position ",
          missing.value_or(0));
  }

  if (opt.softcap) {
    Check(std::isfinite(*opt.softcap) && *opt.softcap > 0,
          "softcap: expected a finite value > 0, got ", *opt.softcap);
  }
  if (opt.scale) {
    Check(std::isfinite(*opt.scale), "scale: expected a finite value, got ", *opt.scale);
  }
  CheckBlockSize(opt.block_sizes.q, "block_sizes.q");
  CheckBlockSize(opt.block_sizes.kv, "block_sizes.kv");
  Check(opt.num_threads >= 0 && opt.num_threads <= kMaxThreads,
        "num_threads: expected 0 (all hardware threads) to ", kMaxThreads, ", got ",
        opt.num_threads);

  const KernelPath path = ResolveKernelPath(opt.kernel_path);
  const std::vector<KernelPath> supported = SupportedKernelPaths();
  if (std::find(supported.begin(), supported.end(), path) == supported.end()) {
    std::ostringstream os;
    for (size_t i = 0; i < supported.size(); ++i)
      os << (i ? ", " : "") << KernelPathName(supported[i]);
    Fail("kernel_path: expected one this CPU supports (", os.str(), "), got ",
         KernelPathName(path));
  }
  return d;
}

namespace {

// out and lse of the forward, as the forward writes and the backward reads
// them: shapes, dtypes, no self-overlap.
void CheckOutAndLse(const AttentionDims& d, DType q_dtype, const TensorView& out,
                    const TensorView& lse) {
  const auto eo = Lazy([&] { return Shape4("B", d.b, "Sq", d.sq, "H", d.h, "Dv", d.dv); });
  CheckBasic(out, "out", 4, eo);
  CheckShape(out, "out", {d.b, d.sq, d.h, d.dv}, eo);
  CheckOutputNoOverlap(out, "out");
  CheckOutDType(out, "out", q_dtype);
  const auto el = Lazy([&] {
    return "[B=" + std::to_string(d.b) + ", H=" + std::to_string(d.h) +
           ", Sq=" + std::to_string(d.sq) + "] f32";
  });
  CheckBasic(lse, "lse", 3, el);
  CheckShape(lse, "lse", {d.b, d.h, d.sq}, el);
  CheckOutputNoOverlap(lse, "lse");
  Check(lse.dtype == DType::kF32, "lse: expected ", el, ", got ", lse);
}

}  // namespace

void ValidateForwardOutputs(const AttentionDims& d, const AttentionInputs& in,
                            const TensorView& out, const TensorView& lse) {
  CheckOutAndLse(d, in.q.dtype, out, lse);
  CheckNoAliasing({{"out", out}, {"lse", lse}}, {{"q", in.q},
                                                 {"k", in.k},
                                                 {"v", in.v},
                                                 {"sinks", in.sinks},
                                                 {"q_segments", in.q_segments},
                                                 {"kv_segments", in.kv_segments}});
}

void ValidateBackwardArgs(const AttentionDims& d, const AttentionInputs& in, const TensorView& out,
                          const TensorView& lse, const TensorView& dout, const TensorView& dq,
                          const TensorView& dk, const TensorView& dv, const TensorView& dsinks) {
  const DType qd = in.q.dtype;
  CheckOutAndLse(d, qd, out, lse);
  const auto eo =
      Lazy([&] { return Shape4("B", d.b, "Sq", d.sq, "H", d.h, "Dv", d.dv) + " (shape of out)"; });
  CheckBasic(dout, "dout", 4, eo);
  CheckShape(dout, "dout", {d.b, d.sq, d.h, d.dv}, eo);
  CheckOutDType(dout, "dout", qd);

  const auto eq =
      Lazy([&] { return Shape4("B", d.b, "Sq", d.sq, "H", d.h, "D", d.d) + " (shape of q)"; });
  CheckBasic(dq, "dq", 4, eq);
  CheckShape(dq, "dq", {d.b, d.sq, d.h, d.d}, eq);
  CheckOutputNoOverlap(dq, "dq");
  CheckOutDType(dq, "dq", qd);
  const auto ek = Lazy(
      [&] { return Shape4("B", d.b, "Skv", d.skv, "Hkv", d.hkv, "D", d.d) + " (shape of k)"; });
  CheckBasic(dk, "dk", 4, ek);
  CheckShape(dk, "dk", {d.b, d.skv, d.hkv, d.d}, ek);
  CheckOutputNoOverlap(dk, "dk");
  CheckOutDType(dk, "dk", qd);
  const auto ev = Lazy(
      [&] { return Shape4("B", d.b, "Skv", d.skv, "Hkv", d.hkv, "Dv", d.dv) + " (shape of v)"; });
  CheckBasic(dv, "dv", 4, ev);
  CheckShape(dv, "dv", {d.b, d.skv, d.hkv, d.dv}, ev);
  CheckOutputNoOverlap(dv, "dv");
  CheckOutDType(dv, "dv", qd);

  const bool has_sinks = in.sinks.defined();
  if (has_sinks) {
    const auto e = Lazy([&] { return "[H=" + std::to_string(d.h) + "] f32 (sinks were given)"; });
    CheckBasic(dsinks, "dsinks", 1, e);
    Check(dsinks.shape[0] == d.h && dsinks.dtype == DType::kF32, "dsinks: expected ", e, ", got ",
          dsinks);
    CheckOutputNoOverlap(dsinks, "dsinks");
  } else {
    Check(!dsinks.defined(), "dsinks: expected none (no sinks were given), got ", dsinks);
  }
  CheckNoAliasing({{"dq", dq}, {"dk", dk}, {"dv", dv}, {"dsinks", dsinks}},
                  {{"q", in.q},
                   {"k", in.k},
                   {"v", in.v},
                   {"sinks", in.sinks},
                   {"q_segments", in.q_segments},
                   {"kv_segments", in.kv_segments},
                   {"out", out},
                   {"lse", lse},
                   {"dout", dout}});
}

namespace {

// One dimension of the overlap search: coef * z for an integer z in [lo, hi]
// (coef > 0, in bytes).
struct OverlapTerm {
  int64_t coef, lo, hi;
};

int64_t FloorDiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t CeilDiv(int64_t a, int64_t b) { return -FloorDiv(-a, b); }

// Whether integers z_k in [terms[k].lo, terms[k].hi] for k >= `k` make
// `base` + sum coef_k z_k land in [lo, hi]. rmin/rmax[k]: the least and
// greatest sum of terms k.. . Terms come by decreasing coef, so each level
// only tries the z whose remaining terms can still reach [lo, hi]: one or
// two per level when strides nest. `budget` counts the calls left; at 0
// the answer is "yes" (undecided counts as overlapping).
bool ReachesRange(const std::vector<OverlapTerm>& terms, const std::vector<int64_t>& rmin,
                  const std::vector<int64_t>& rmax, size_t k, int64_t base, int64_t lo, int64_t hi,
                  int64_t& budget) {
  if (k == terms.size()) return lo <= base && base <= hi;
  if (--budget < 0) return true;
  const OverlapTerm& t = terms[k];
  const int64_t z0 = std::max(t.lo, CeilDiv(lo - base - rmax[k + 1], t.coef));
  const int64_t z1 = std::min(t.hi, FloorDiv(hi - base - rmin[k + 1], t.coef));
  for (int64_t z = z0; z <= z1; ++z) {
    if (ReachesRange(terms, rmin, rmax, k + 1, base + t.coef * z, lo, hi, budget)) return true;
  }
  return false;
}

}  // namespace

bool ViewsOverlap(const TensorView& a, const TensorView& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  const auto ea = static_cast<int64_t>(DTypeSize(a.dtype));
  const auto eb = static_cast<int64_t>(DTypeSize(b.dtype));
  // Element i of a covers bytes [pa + ea * sum i_k sa_k, ... + ea), element j
  // of b likewise; they share a byte iff addr_a(i) - addr_b(j) lies in
  // [-(ea - 1), eb - 1]. That difference is base + sum over a's dims of
  // (ea sa_k) i_k - sum over b's dims of (eb sb_k) j_k. Dims of one byte
  // stride in both views merge into one term: z = i_k - j_k takes every
  // value between, so two views of the same strides (slices of one packed
  // buffer) need a few steps instead of one per row.
  std::vector<OverlapTerm> terms;
  auto add = [&terms](int64_t coef, int64_t lo, int64_t hi) {
    if (coef < 0) {  // a negative stride: coef z = (-coef)(-z)
      coef = -coef;
      lo = -std::exchange(hi, -lo);
    }
    for (OverlapTerm& t : terms) {
      if (t.coef == coef) {
        t.lo += lo;
        t.hi += hi;
        return;
      }
    }
    terms.push_back({coef, lo, hi});
  };
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] > 1 && a.stride[i] != 0) add(a.stride[i] * ea, 0, a.shape[i] - 1);
  }
  for (int i = 0; i < b.ndim; ++i) {
    if (b.shape[i] > 1 && b.stride[i] != 0) add(b.stride[i] * eb, 1 - b.shape[i], 0);
  }
  std::sort(terms.begin(), terms.end(),
            [](const OverlapTerm& x, const OverlapTerm& y) { return x.coef > y.coef; });
  std::vector<int64_t> rmin(terms.size() + 1, 0), rmax(terms.size() + 1, 0);
  for (size_t k = terms.size(); k-- > 0;) {
    rmin[k] = rmin[k + 1] + terms[k].coef * terms[k].lo;
    rmax[k] = rmax[k + 1] + terms[k].coef * terms[k].hi;
  }
  const int64_t base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data)) -
                       static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data));
  int64_t budget = int64_t{1} << 17;
  return ReachesRange(terms, rmin, rmax, 0, base, 1 - ea, eb - 1, budget);
}

void CheckNoAliasing(std::initializer_list<NamedView> outputs,
                     std::initializer_list<NamedView> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    auto check = [&o](const NamedView& other) {
      Check(!ViewsOverlap(o->view, other.view), o->name,
            ": expected memory shared with no input or other output, got a view overlapping ",
            other.name, " (", o->name, " ", o->view, " at ", o->view.data, ", ", other.name, " ",
            other.view, " at ", other.view.data, ")");
    };
    for (const NamedView& in : inputs) check(in);
    for (auto p = outputs.begin(); p != o; ++p) check(*p);
  }
}

bool StridesNest(const TensorView& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims of size > 1
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] > 1) dims.emplace_back(t.stride[i], t.shape[i]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the dims so far
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return false;
    extent = stride * (size - 1) + extent;
  }
  return true;
}

}  // namespace kernels

void ValidateAttentionInputs(const AttentionInputs& in, const AttentionOptions& opt) {
  kernels::ValidateInputsAndOptions(in, opt);
}

}  // namespace ringsplash

// Non-finite input handling around the flash kernels: see poison.h.
#include "src/kernels/poison.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/kernels/micro/micro.h"
#include "src/kernels/thread_pool.h"

namespace ringsplash::kernels {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// An exponent of all ones is an infinity or a NaN in every float format.
bool NonFiniteBits(DType dtype, const void* data, int64_t offset) {
  switch (dtype) {
    case DType::kF32: {
      uint32_t bits;
      std::memcpy(&bits, static_cast<const uint32_t*>(data) + offset, sizeof bits);
      return (bits & 0x7F800000u) == 0x7F800000u;
    }
    case DType::kBF16:
      return (static_cast<const uint16_t*>(data)[offset] & 0x7F80u) == 0x7F80u;
    case DType::kF16:
      return (static_cast<const uint16_t*>(data)[offset] & 0x7C00u) == 0x7C00u;
    default:
      return false;
  }
}

void ZeroAt(const TensorView& t, int64_t offset) {
  const size_t es = DTypeSize(t.dtype);
  std::memset(static_cast<char*>(t.data) + offset * static_cast<int64_t>(es), 0, es);
}

int32_t SegmentAt(const TensorView& s, int64_t b, int64_t i) {
  return static_cast<const int32_t*>(s.data)[s.Offset(b, i)];
}

// Whether a row of n elements from `base` (inner stride t.stride[3]) holds a
// NaN or an infinity. Unit strides take a branch-free loop over the bits that
// compilers vectorise: |bits| >= the infinity pattern means exponent all ones.
template <typename Bits>
bool RowNonFiniteBits(const Bits* row, int64_t n, Bits magnitude, Bits inf) {
  unsigned bad = 0;
  for (int64_t e = 0; e < n; ++e) bad |= static_cast<unsigned>((row[e] & magnitude) >= inf);
  return bad != 0;
}

bool RowNonFinite(const TensorView& t, int64_t base, int64_t n) {
  if (t.stride[3] == 1) {
    switch (t.dtype) {
      case DType::kF32:
        return RowNonFiniteBits<uint32_t>(static_cast<const uint32_t*>(t.data) + base, n,
                                          0x7FFFFFFFu, 0x7F800000u);
      case DType::kBF16:
        return RowNonFiniteBits<uint16_t>(static_cast<const uint16_t*>(t.data) + base, n, 0x7FFF,
                                          0x7F80);
      case DType::kF16:
        return RowNonFiniteBits<uint16_t>(static_cast<const uint16_t*>(t.data) + base, n, 0x7FFF,
                                          0x7C00);
      default:
        return false;
    }
  }
  bool bad = false;
  for (int64_t e = 0; e < n; ++e) bad |= NonFiniteBits(t.dtype, t.data, base + e * t.stride[3]);
  return bad;
}

// Rows of a 4-D float view [B, S, Heads, X]: flags[(b * S + s) * Heads + head]
// |= `bit` when that row holds a non-finite element. `flags` is resized (to
// zeros) when empty. Returns whether any row was flagged. With a pool, large
// views are scanned by all its workers (the scan is memory-bound: one pass
// over every input byte of every call).
bool ScanRows(const TensorView& t, char bit, std::vector<char>& flags, ThreadPool* pool = nullptr) {
  const int64_t b = t.shape[0], s = t.shape[1], heads = t.shape[2], x = t.shape[3];
  if (flags.empty()) flags.assign(static_cast<size_t>(b * s * heads), 0);
  // Tasks of kChunk (batch, position) pairs; each writes only its own rows'
  // flags, and whether it flagged any into its own slot.
  constexpr int64_t kChunk = 256;
  const int64_t positions = b * s;
  const int64_t tasks = (positions + kChunk - 1) / kChunk;
  std::vector<char> task_any(static_cast<size_t>(tasks), 0);
  auto scan = [&](int64_t task, int) {
    const int64_t end = std::min(positions, (task + 1) * kChunk);
    for (int64_t p = task * kChunk; p < end; ++p) {
      const int64_t ib = p / s, is = p % s;
      for (int64_t ih = 0; ih < heads; ++ih) {
        const int64_t base = t.Offset(ib, is, ih);
        if (!RowNonFinite(t, base, x)) continue;
        flags[static_cast<size_t>(p * heads + ih)] |= bit;
        task_any[static_cast<size_t>(task)] = 1;
      }
    }
  };
  // Small tensors are not worth waking the pool for.
  if (pool != nullptr && pool->size() > 1 && positions * heads * x >= (int64_t{1} << 16)) {
    pool->ParallelFor(tasks, scan);
  } else {
    for (int64_t task = 0; task < tasks; ++task) scan(task, 0);
  }
  return std::find(task_any.begin(), task_any.end(), 1) != task_any.end();
}

// A contiguous copy of the 4-D float view `t`, same dtype, with every
// non-finite element replaced by 0.
Tensor CleanCopy(const TensorView& t) {
  Tensor c(t.dtype, {t.shape[0], t.shape[1], t.shape[2], t.shape[3]});
  const TensorView cv = c.view();
  const size_t es = DTypeSize(t.dtype);
  for (int64_t i0 = 0; i0 < t.shape[0]; ++i0) {
    for (int64_t i1 = 0; i1 < t.shape[1]; ++i1) {
      for (int64_t i2 = 0; i2 < t.shape[2]; ++i2) {
        for (int64_t i3 = 0; i3 < t.shape[3]; ++i3) {
          const int64_t src = t.Offset(i0, i1, i2, i3);
          if (NonFiniteAt(t, src)) continue;  // the copy is zero-filled
          std::memcpy(static_cast<char*>(cv.data) + cv.Offset(i0, i1, i2, i3) * es,
                      static_cast<const char*>(t.data) + src * static_cast<int64_t>(es), es);
        }
      }
    }
  }
  return c;
}

// Replaces every non-finite element of the contiguous float view `t` by 0.
void CleanInPlace(const TensorView& t) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (NonFiniteAt(t, i)) ZeroAt(t, i);
  }
}

}  // namespace

bool NonFiniteAt(const TensorView& t, int64_t offset) {
  return NonFiniteBits(t.dtype, t.data, offset);
}

bool AnyNonFinite(const TensorView& t, int64_t b, int64_t s0, int64_t rows, int64_t head,
                  const micro::MicroKernels* mk) {
  const int64_t x = t.shape[3];
  const bool half = t.dtype == DType::kBF16 || t.dtype == DType::kF16;
  if (mk != nullptr && mk->any_non_finite16 != nullptr && half && t.stride[3] == 1 && rows > 0) {
    return mk->any_non_finite16(static_cast<const uint16_t*>(t.data) + t.Offset(b, s0, head),
                                t.stride[1], rows, x, t.dtype == DType::kBF16 ? 0x7F80 : 0x7C00);
  }
  // Strided rows (other heads in between) defeat the hardware prefetchers,
  // and row after row each miss would be waited for in turn: ask for every
  // line first, so the misses overlap.
  if (t.stride[3] == 1) {
    const int64_t bytes = x * static_cast<int64_t>(DTypeSize(t.dtype));
    for (int64_t s = s0; s < s0 + rows; ++s) {
      const char* row = static_cast<const char*>(t.data) +
                        t.Offset(b, s, head) * static_cast<int64_t>(DTypeSize(t.dtype));
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o);
    }
  }
  bool bad = false;
  for (int64_t s = s0; s < s0 + rows; ++s) bad |= RowNonFinite(t, t.Offset(b, s, head), x);
  return bad;
}

bool PairRule::Allowed(int64_t b, int64_t head, int64_t i, int64_t j) const {
  if (!mask->Allowed(head, q_pos[i], kv_pos[j])) return false;
  return !q_segments.defined() || SegmentAt(q_segments, b, i) == SegmentAt(kv_segments, b, j);
}

namespace {

// Forward dependencies on one set of key/value rows (`d.skv` long): a row
// [B, H, Sq] gets lse_p when it allows a row flagged kKeyBad, or when q_bad
// ([B, Sq, H], may be null) flags it and it allows any row; out_p when it
// allows a row flagged kValueBad. `kv_flags` [B, Skv, Hkv] may be null.
void MarkForward(const PairRule& rule, const AttentionDims& d, const char* kv_flags,
                 const char* q_bad, char* lse_p, char* out_p) {
  const int64_t group = d.h / d.hkv;
  if (kv_flags != nullptr) {
    for (int64_t b = 0; b < d.b; ++b) {
      for (int64_t j = 0; j < d.skv; ++j) {
        for (int64_t g = 0; g < d.hkv; ++g) {
          const char f = kv_flags[(b * d.skv + j) * d.hkv + g];
          if (f == 0) continue;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            for (int64_t i = 0; i < d.sq; ++i) {
              if (!rule.Allowed(b, h, i, j)) continue;
              const int64_t r = (b * d.h + h) * d.sq + i;
              if (f & kKeyBad) lse_p[r] = 1;
              if (f & kValueBad) out_p[r] = 1;
            }
          }
        }
      }
    }
  }
  if (q_bad == nullptr) return;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t i = 0; i < d.sq; ++i) {
      for (int64_t h = 0; h < d.h; ++h) {
        const int64_t r = (b * d.h + h) * d.sq + i;
        if (q_bad[(b * d.sq + i) * d.h + h] == 0 || lse_p[r] != 0) continue;
        for (int64_t j = 0; j < d.skv; ++j) {
          if (rule.Allowed(b, h, i, j)) {
            lse_p[r] = 1;
            break;
          }
        }
      }
    }
  }
}

// Backward dependencies on one set of key/value rows: dk_p[b,j,g] when a row
// of `pr` ([B, H, Sq]) allows j, dv_p[b,j,g] when a row of `dv_src` allows j.
// Outputs [B, Skv, Hkv].
void MarkBackward(const PairRule& rule, const AttentionDims& d, const char* pr, const char* dv_src,
                  char* dk_p, char* dv_p) {
  const int64_t group = d.h / d.hkv;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < d.sq; ++i) {
        const int64_t r = (b * d.h + h) * d.sq + i;
        if (pr[r] == 0 && dv_src[r] == 0) continue;
        for (int64_t j = 0; j < d.skv; ++j) {
          if (!rule.Allowed(b, h, i, j)) continue;
          const int64_t kr = (b * d.skv + j) * d.hkv + g;
          if (pr[r] != 0) dk_p[kr] = 1;
          if (dv_src[r] != 0) dv_p[kr] = 1;
        }
      }
    }
  }
}

// lse rows [B, H, Sq] (a [B, H, Sq] view) that are NaN or +inf get
// flags[r] = 1 (-inf is an empty row, not poison). Returns whether any did.
bool ScanLse(const AttentionDims& d, const TensorView& lse, char* flags) {
  bool any = false;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      for (int64_t i = 0; i < d.sq; ++i) {
        const float x = LoadAsF32(lse, lse.Offset(b, h, i));
        if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
          flags[(b * d.h + h) * d.sq + i] = 1;
          any = true;
        }
      }
    }
  }
  return any;
}

// Backward poison sets of rows [B, H, Sq] (the table above poison.h):
//   pr[r]     = lse_p | out_p | out_bad | dout_bad   (dq, dk, dsinks)
//   dv_src[r] = lse_p | dout_bad                     (dv)
// out_p may be null; out_bad and dout_bad are ScanRows flags [B, Sq, H]
// (empty: none bad).
void BackwardSets(const AttentionDims& d, const char* lse_p, const char* out_p,
                  const std::vector<char>& out_bad, const std::vector<char>& dout_bad, char* pr,
                  char* dv_src) {
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      for (int64_t i = 0; i < d.sq; ++i) {
        const int64_t r = (b * d.h + h) * d.sq + i;
        const auto t = static_cast<size_t>((b * d.sq + i) * d.h + h);
        const bool dout_poisoned = !dout_bad.empty() && dout_bad[t] != 0;
        const bool out_poisoned =
            (out_p != nullptr && out_p[r] != 0) || (!out_bad.empty() && out_bad[t] != 0);
        pr[r] = lse_p[r] != 0 || out_poisoned || dout_poisoned;
        dv_src[r] = lse_p[r] != 0 || dout_poisoned;
      }
    }
  }
}

// NaN over the rows flagged in `rows_bhs` ([B, H, Sq]) of an f32 contiguous
// [B, Sq, H, X] buffer (out, dq).
void FillQueryRows(float* buf, const AttentionDims& d, int64_t x, const char* rows_bhs) {
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      for (int64_t i = 0; i < d.sq; ++i) {
        if (rows_bhs[(b * d.h + h) * d.sq + i] == 0) continue;
        float* row = buf + ((b * d.sq + i) * d.h + h) * x;
        for (int64_t e = 0; e < x; ++e) row[e] = kNaN;
      }
    }
  }
}

// NaN over the rows flagged in `flags` ([rows]) of an f32 contiguous
// [rows, X] buffer (lse, dk, dv).
void FillRows(float* buf, int64_t rows, int64_t x, const char* flags) {
  for (int64_t r = 0; r < rows; ++r) {
    if (flags[r] == 0) continue;
    for (int64_t e = 0; e < x; ++e) buf[r * x + e] = kNaN;
  }
}

}  // namespace

bool CleanKeyValuesInPlace(const TensorView& k, const TensorView& v, std::vector<char>& flags) {
  flags.clear();
  bool any = ScanRows(k, kKeyBad, flags);
  any = ScanRows(v, kValueBad, flags) || any;
  if (any) {
    CleanInPlace(k);
    CleanInPlace(v);
  }
  return any;
}

KeyValueScan::KeyValueScan(const TensorView& k, const TensorView& v, ThreadPool* pool)
    : k_(k), v_(v) {
  any_ = ScanRows(k, kKeyBad, flags_, pool);
  any_ = ScanRows(v, kValueBad, flags_, pool) || any_;
  if (!any_) return;
  k_own_ = CleanCopy(k);
  v_own_ = CleanCopy(v);
  k_ = k_own_.view();
  v_ = v_own_.view();
}

ForwardPoison::ForwardPoison(const AttentionDims& d, const TensorView& q, ThreadPool* pool)
    : d_(d), q_(q) {
  any_q_ = ScanRows(q, 1, q_bad_, pool);
  if (!any_q_) return;
  q_own_ = CleanCopy(q);
  q_ = q_own_.view();
}

void ForwardPoison::AddKeys(const PairRule& rule, const char* kv_flags) {
  if (kv_flags == nullptr && !any_q_) return;
  if (lse_p_.empty()) {
    lse_p_.assign(static_cast<size_t>(d_.b * d_.h * d_.sq), 0);
    out_p_.assign(lse_p_.size(), 0);
  }
  MarkForward(rule, d_, kv_flags, any_q_ ? q_bad_.data() : nullptr, lse_p_.data(), out_p_.data());
  // A row whose lse is poisoned has a poisoned out.
  for (size_t r = 0; r < lse_p_.size(); ++r) out_p_[r] |= lse_p_[r];
}

void ForwardPoison::Fill(float* out, float* lse) const {
  if (!any()) return;
  FillQueryRows(out, d_, d_.dv, out_p_.data());
  FillRows(lse, static_cast<int64_t>(lse_p_.size()), 1, lse_p_.data());
}

BackwardPoison::BackwardPoison(const AttentionDims& d, const TensorView& q, const TensorView& out,
                               const TensorView& lse, const TensorView& dout, ThreadPool* pool,
                               const ForwardPoison* forward)
    : d_(d), q_(q), dout_(dout) {
  std::vector<char> q_bad, out_bad, dout_bad;
  const bool any_q = forward != nullptr ? forward->any_q() : ScanRows(q, 1, q_bad, pool);
  const bool any_dout = ScanRows(dout, 1, dout_bad, pool);
  const bool any_out = ScanRows(out, 1, out_bad, pool);
  const auto rows = static_cast<size_t>(d.b * d.h * d.sq);
  lse_p_.assign(rows, 0);
  const bool any_lse = ScanLse(d, lse, lse_p_.data());
  const bool any_forward = forward != nullptr && forward->any();
  any_ = any_q || any_dout || any_out || any_lse || any_forward;
  if (!any_) {
    lse_p_.clear();
    return;
  }
  const char* out_p = nullptr;
  if (any_forward) {
    for (size_t r = 0; r < rows; ++r) lse_p_[r] |= forward->lse_rows()[r];
    out_p = forward->out_rows().data();
  }
  pr_.assign(rows, 0);
  dv_src_.assign(rows, 0);
  BackwardSets(d, lse_p_.data(), out_p, out_bad, dout_bad, pr_.data(), dv_src_.data());
  if (any_q) {
    if (forward != nullptr) {
      q_ = forward->q();
    } else {
      q_own_ = CleanCopy(q);
      q_ = q_own_.view();
    }
  }
  if (any_dout) {
    dout_own_ = CleanCopy(dout);
    dout_ = dout_own_.view();
  }
}

void BackwardPoison::Sanitize(float* lse32, float* delta) const {
  if (!any_) return;
  for (size_t r = 0; r < lse_p_.size(); ++r) {
    if (!std::isfinite(delta[r])) delta[r] = 0.0f;
    if (lse_p_[r] != 0) lse32[r] = -std::numeric_limits<float>::infinity();
  }
}

void BackwardPoison::FillKeys(const PairRule& rule, float* dk, float* dv) const {
  if (!any_) return;
  const auto keys = static_cast<size_t>(d_.b * d_.skv * d_.hkv);
  std::vector<char> dk_p(keys, 0), dv_p(keys, 0);
  MarkBackward(rule, d_, pr_.data(), dv_src_.data(), dk_p.data(), dv_p.data());
  FillRows(dk, static_cast<int64_t>(keys), d_.d, dk_p.data());
  FillRows(dv, static_cast<int64_t>(keys), d_.dv, dv_p.data());
}

void BackwardPoison::FillQueries(float* dq) const {
  if (any_) FillQueryRows(dq, d_, d_.d, pr_.data());
}

void BackwardPoison::FillDSinks(float* ds) const {
  if (!any_) return;
  for (int64_t r = 0; r < d_.b * d_.h * d_.sq; ++r) {
    if (pr_[static_cast<size_t>(r)] != 0) ds[r / d_.sq % d_.h] = kNaN;
  }
}

}  // namespace ringsplash::kernels

// Non-finite input handling around the flash kernels: see poison.h.
#include "src/kernels/poison.h"

#include <cmath>
#include <cstring>
#include <limits>

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

}  // namespace

bool NonFiniteAt(const TensorView& t, int64_t offset) {
  return NonFiniteBits(t.dtype, t.data, offset);
}

bool ScanRows(const TensorView& t, char bit, std::vector<char>& flags) {
  const int64_t b = t.shape[0], s = t.shape[1], heads = t.shape[2], x = t.shape[3];
  if (flags.empty()) flags.assign(static_cast<size_t>(b * s * heads), 0);
  bool any = false;
  for (int64_t ib = 0; ib < b; ++ib) {
    for (int64_t is = 0; is < s; ++is) {
      for (int64_t ih = 0; ih < heads; ++ih) {
        const int64_t base = t.Offset(ib, is, ih);
        bool bad = false;
        for (int64_t e = 0; e < x; ++e) bad |= NonFiniteAt(t, base + e * t.stride[3]);
        if (bad) {
          flags[static_cast<size_t>((ib * s + is) * heads + ih)] |= bit;
          any = true;
        }
      }
    }
  }
  return any;
}

InputScan ScanInputs(const TensorView& q, const TensorView& k, const TensorView& v,
                     const std::vector<float>& sinks) {
  InputScan s;
  s.any_q = ScanRows(q, 1, s.q);
  if (k.defined()) {
    s.any_kv = ScanRows(k, kKeyBad, s.kv);
    s.any_kv = ScanRows(v, kValueBad, s.kv) || s.any_kv;
  }
  s.sinks.assign(sinks.size(), 0);
  for (size_t h = 0; h < sinks.size(); ++h) {
    if (!std::isfinite(sinks[h])) s.sinks[h] = s.any_sinks = true;
  }
  return s;
}

void CleanSinks(std::vector<float>& sinks) {
  for (float& x : sinks) {
    if (!std::isfinite(x)) x = 0.0f;
  }
}

void MarkSinks(const AttentionDims& d, const std::vector<char>& sink_bad, char* lse_p) {
  if (sink_bad.empty()) return;
  for (int64_t b = 0; b < d.b; ++b) {
    for (int64_t h = 0; h < d.h; ++h) {
      if (sink_bad[static_cast<size_t>(h)] == 0) continue;
      std::memset(lse_p + (b * d.h + h) * d.sq, 1, static_cast<size_t>(d.sq));
    }
  }
}

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

void CleanInPlace(const TensorView& t) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (NonFiniteAt(t, i)) ZeroAt(t, i);
  }
}

bool PairRule::Allowed(int64_t b, int64_t head, int64_t i, int64_t j) const {
  if (!mask->Allowed(head, q_pos[i], kv_pos[j])) return false;
  return !q_segments.defined() || SegmentAt(q_segments, b, i) == SegmentAt(kv_segments, b, j);
}

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

void FillRows(float* buf, int64_t rows, int64_t x, const char* flags) {
  for (int64_t r = 0; r < rows; ++r) {
    if (flags[r] == 0) continue;
    for (int64_t e = 0; e < x; ++e) buf[r * x + e] = kNaN;
  }
}

}  // namespace ringsplash::kernels

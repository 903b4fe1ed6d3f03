// PoisonMap: the dependency rule of poison.h, computed literally.
#include "tests/reliability/poison.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace ringsplash::testing {
namespace {

// True when any element of row `row` (a [outer, rows, inner] C-order slice
// of the doubles) is non-finite.
bool RowBad(const std::vector<double>& v, int64_t first, int64_t count) {
  for (int64_t e = 0; e < count; ++e) {
    if (!std::isfinite(v[static_cast<size_t>(first + e)])) return true;
  }
  return false;
}

Tensor Cleaned(const TensorView& t) {
  std::vector<double> v = ToDoubles(t);
  for (double& x : v) {
    if (!std::isfinite(x)) x = 0;
  }
  std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
  return TensorFromDoubles(v, t.dtype, shape);
}

}  // namespace

PoisonMap PoisonMap::Of(const AttentionInputs& in, const AttentionOptions& opt,
                        const Tensor* dout) {
  PoisonMap m;
  m.b = in.q.shape[0];
  m.sq = in.q.shape[1];
  m.h = in.q.shape[2];
  m.skv = in.k.shape[1];
  m.hkv = in.k.shape[2];
  const int64_t d = in.q.shape[3], dv = in.v.shape[3];
  const std::vector<double> q = ToDoubles(in.q), k = ToDoubles(in.k), v = ToDoubles(in.v);
  const std::vector<double> qs =
      in.q_segments.defined() ? ToDoubles(in.q_segments) : std::vector<double>{};
  const std::vector<double> ks =
      in.kv_segments.defined() ? ToDoubles(in.kv_segments) : std::vector<double>{};
  const std::vector<double> go = dout ? ToDoubles(dout->view()) : std::vector<double>{};
  auto qpos = [&](int64_t i) { return in.q_positions.empty() ? i : in.q_positions[i]; };
  auto kvpos = [&](int64_t j) { return in.kv_positions.empty() ? j : in.kv_positions[j]; };

  const size_t rows = static_cast<size_t>(m.b * m.h * m.sq);
  const size_t keys = static_cast<size_t>(m.b * m.skv * m.hkv);
  m.lse.assign(rows, 0);
  m.out.assign(rows, 0);
  m.dq.assign(rows, 0);
  m.dk.assign(keys, 0);
  m.dv.assign(keys, 0);
  m.dsinks.assign(static_cast<size_t>(m.h), 0);
  const int64_t group = m.h / m.hkv;
  for (int64_t b = 0; b < m.b; ++b) {
    for (int64_t h = 0; h < m.h; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < m.sq; ++i) {
        const size_t r = static_cast<size_t>((b * m.h + h) * m.sq + i);
        const bool q_bad = RowBad(q, ((b * m.sq + i) * m.h + h) * d, d);
        const bool dout_bad = dout && RowBad(go, ((b * m.sq + i) * m.h + h) * dv, dv);
        bool any_allowed = false, k_bad = false, v_bad = false;
        std::vector<int64_t> allowed;
        for (int64_t j = 0; j < m.skv; ++j) {
          if (!opt.mask.Allowed(h, qpos(i), kvpos(j))) continue;
          if (!qs.empty() &&
              qs[static_cast<size_t>(b * m.sq + i)] != ks[static_cast<size_t>(b * m.skv + j)]) {
            continue;
          }
          any_allowed = true;
          allowed.push_back(j);
          k_bad = k_bad || RowBad(k, ((b * m.skv + j) * m.hkv + g) * d, d);
          v_bad = v_bad || RowBad(v, ((b * m.skv + j) * m.hkv + g) * dv, dv);
        }
        m.lse[r] = (q_bad && any_allowed) || k_bad;
        m.out[r] = m.lse[r] || v_bad;
        m.dq[r] = dout && (m.out[r] || dout_bad);
        if (!dout) continue;
        for (int64_t j : allowed) {
          const size_t kr = static_cast<size_t>((b * m.skv + j) * m.hkv + g);
          m.dk[kr] = m.dk[kr] || m.dq[r];
          m.dv[kr] = m.dv[kr] || m.lse[r] || dout_bad;
        }
        m.dsinks[static_cast<size_t>(h)] = m.dsinks[static_cast<size_t>(h)] || m.dq[r];
      }
    }
  }
  return m;
}

int64_t PoisonMap::count_out() const { return std::count(out.begin(), out.end(), 1); }

OwnedInputs CleanCopy(const OwnedInputs& in) {
  OwnedInputs c = ConvertInputs(in, in.q.dtype());
  c.q = Cleaned(in.q.view());
  c.k = Cleaned(in.k.view());
  c.v = Cleaned(in.v.view());
  return c;
}

Tensor CleanCopy(const Tensor& t) { return Cleaned(t.view()); }

}  // namespace ringsplash::testing

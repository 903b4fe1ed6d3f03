// The f64 dense reference: SPEC §2 written out literally, one (b, h, i) row at
// a time, no blocking, no online softmax. Deliberately simple so that it can
// be trusted by reading; reference_test.cc checks its backward against finite
// differences of its forward.
#include "tests/support/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ringsplash::testing {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

int64_t QPos(const RefProblem& p, int64_t i) { return p.q_pos.empty() ? i : p.q_pos[i]; }
int64_t KvPos(const RefProblem& p, int64_t j) { return p.kv_pos.empty() ? j : p.kv_pos[j]; }

double Scale(const RefProblem& p) {
  return p.scale != 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.d));
}

// Offsets into the C-order arrays.
int64_t QIdx(const RefProblem& p, int64_t b, int64_t i, int64_t h) {
  return ((b * p.sq + i) * p.h + h) * p.d;
}
int64_t KIdx(const RefProblem& p, int64_t b, int64_t j, int64_t g) {
  return ((b * p.skv + j) * p.hkv + g) * p.d;
}
int64_t VIdx(const RefProblem& p, int64_t b, int64_t j, int64_t g) {
  return ((b * p.skv + j) * p.hkv + g) * p.dv;
}
int64_t OIdx(const RefProblem& p, int64_t b, int64_t i, int64_t h) {
  return ((b * p.sq + i) * p.h + h) * p.dv;
}
int64_t LIdx(const RefProblem& p, int64_t b, int64_t h, int64_t i) {
  return (b * p.h + h) * p.sq + i;
}

bool Allowed(const RefProblem& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!p.mask.Allowed(h, QPos(p, i), KvPos(p, j))) return false;
  if (!p.q_seg.empty() && p.q_seg[b * p.sq + i] != p.kv_seg[b * p.skv + j]) return false;
  return true;
}

// Logits of one row: raw[j] = scale * q_i . k_j; s[j] = softcap(raw[j]);
// allowed[j] as above.
struct Row {
  std::vector<double> raw, s;
  std::vector<char> allowed;
};

void ComputeRow(const RefProblem& p, int64_t b, int64_t h, int64_t i, Row& row) {
  const int64_t g = h / (p.h / p.hkv);
  const double scale = Scale(p);
  row.raw.assign(p.skv, 0.0);
  row.s.assign(p.skv, 0.0);
  row.allowed.assign(p.skv, 0);
  const double* q = &p.q[QIdx(p, b, i, h)];
  for (int64_t j = 0; j < p.skv; ++j) {
    const double* k = &p.k[KIdx(p, b, j, g)];
    double dot = 0;
    for (int64_t d = 0; d < p.d; ++d) dot += q[d] * k[d];
    row.raw[j] = scale * dot;
    row.s[j] = p.softcap > 0 ? p.softcap * std::tanh(row.raw[j] / p.softcap) : row.raw[j];
    row.allowed[j] = Allowed(p, b, h, i, j) ? 1 : 0;
  }
}

// lse_i = log(sum_{j allowed} exp(s_ij) + exp(sink)), -inf if nothing at all.
double RowLse(const RefProblem& p, int64_t h, const Row& row) {
  const bool has_sink = !p.sinks.empty();
  double m = has_sink ? p.sinks[h] : kNegInf;
  for (int64_t j = 0; j < p.skv; ++j) {
    if (row.allowed[j]) m = std::max(m, row.s[j]);
  }
  if (m == kNegInf) return kNegInf;
  double sum = has_sink ? std::exp(p.sinks[h] - m) : 0.0;
  for (int64_t j = 0; j < p.skv; ++j) {
    if (row.allowed[j]) sum += std::exp(row.s[j] - m);
  }
  return m + std::log(sum);
}

}  // namespace

RefForward ReferenceForward(const RefProblem& p) {
  RefForward f;
  f.out.assign(static_cast<size_t>(p.b * p.sq * p.h * p.dv), 0.0);
  f.lse.assign(static_cast<size_t>(p.b * p.h * p.sq), kNegInf);
  Row row;
  for (int64_t b = 0; b < p.b; ++b) {
    for (int64_t h = 0; h < p.h; ++h) {
      const int64_t g = h / (p.h / p.hkv);
      for (int64_t i = 0; i < p.sq; ++i) {
        ComputeRow(p, b, h, i, row);
        const double lse = RowLse(p, h, row);
        f.lse[LIdx(p, b, h, i)] = lse;
        if (lse == kNegInf) continue;  // out stays 0
        double* o = &f.out[OIdx(p, b, i, h)];
        for (int64_t j = 0; j < p.skv; ++j) {
          if (!row.allowed[j]) continue;
          const double pij = std::exp(row.s[j] - lse);
          const double* v = &p.v[VIdx(p, b, j, g)];
          for (int64_t e = 0; e < p.dv; ++e) o[e] += pij * v[e];
        }
      }
    }
  }
  return f;
}

RefBackward ReferenceBackward(const RefProblem& p, const std::vector<double>& dout) {
  const RefForward f = ReferenceForward(p);
  RefBackward g;
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  g.dq_terms.assign(p.q.size(), 0.0);
  g.dk_terms.assign(p.k.size(), 0.0);
  g.dv_terms.assign(p.v.size(), 0.0);
  g.dq_ds_terms.assign(p.q.size(), 0.0);
  g.dk_ds_terms.assign(p.k.size(), 0.0);
  if (!p.sinks.empty()) {
    g.dsinks.assign(static_cast<size_t>(p.h), 0.0);
    g.dsinks_terms.assign(static_cast<size_t>(p.h), 0.0);
  }
  const double scale = Scale(p);
  Row row;
  for (int64_t b = 0; b < p.b; ++b) {
    for (int64_t h = 0; h < p.h; ++h) {
      const int64_t kvh = h / (p.h / p.hkv);
      for (int64_t i = 0; i < p.sq; ++i) {
        const double lse = f.lse[LIdx(p, b, h, i)];
        if (lse == kNegInf) continue;  // empty row: zero gradients
        ComputeRow(p, b, h, i, row);
        const double* o = &f.out[OIdx(p, b, i, h)];
        const double* dO = &dout[OIdx(p, b, i, h)];
        double di = 0;      // D_i = dout_i . out_i
        double di_abs = 0;  // its terms' magnitudes
        for (int64_t e = 0; e < p.dv; ++e) {
          di += dO[e] * o[e];
          di_abs += std::abs(dO[e] * o[e]);
        }
        if (!p.sinks.empty()) {
          const double term = std::exp(p.sinks[h] - lse) * di;
          g.dsinks[h] -= term;
          g.dsinks_terms[h] += std::abs(term);
        }
        const double* q = &p.q[QIdx(p, b, i, h)];
        double* dq = &g.dq[QIdx(p, b, i, h)];
        double* dq_terms = &g.dq_terms[QIdx(p, b, i, h)];
        double* dq_ds_terms = &g.dq_ds_terms[QIdx(p, b, i, h)];
        for (int64_t j = 0; j < p.skv; ++j) {
          if (!row.allowed[j]) continue;
          const double pij = std::exp(row.s[j] - lse);
          const double* v = &p.v[VIdx(p, b, j, kvh)];
          double dp = 0, dp_abs = 0;  // dout_i . v_j and its terms' magnitudes
          for (int64_t e = 0; e < p.dv; ++e) {
            dp += dO[e] * v[e];
            dp_abs += std::abs(dO[e] * v[e]);
          }
          double ds = pij * (dp - di);
          double ds_abs = pij * (dp_abs + di_abs);
          if (p.softcap > 0) {
            const double t = std::tanh(row.raw[j] / p.softcap);
            ds *= 1.0 - t * t;
            ds_abs *= 1.0 - t * t;
          }
          const double* k = &p.k[KIdx(p, b, j, kvh)];
          double* dk = &g.dk[KIdx(p, b, j, kvh)];
          double* dv = &g.dv[VIdx(p, b, j, kvh)];
          double* dk_terms = &g.dk_terms[KIdx(p, b, j, kvh)];
          double* dk_ds_terms = &g.dk_ds_terms[KIdx(p, b, j, kvh)];
          for (int64_t d = 0; d < p.d; ++d) {
            dq[d] += scale * ds * k[d];
            dk[d] += scale * ds * q[d];
            dq_terms[d] += std::abs(scale * ds_abs * k[d]);
            dk_terms[d] += std::abs(scale * ds_abs * q[d]);
            dq_ds_terms[d] += std::abs(scale * ds * k[d]);
            dk_ds_terms[d] += std::abs(scale * ds * q[d]);
          }
          double* dv_terms = &g.dv_terms[VIdx(p, b, j, kvh)];
          for (int64_t e = 0; e < p.dv; ++e) {
            dv[e] += pij * dO[e];
            dv_terms[e] += pij * std::abs(dO[e]);
          }
        }
      }
    }
  }
  return g;
}

}  // namespace ringsplash::testing

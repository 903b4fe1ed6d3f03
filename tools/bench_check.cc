// Sampled rows of ring results vs the single-device kernel.
#include "tools/bench_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "ringsplash/attention.h"
#include "tools/cli_common.h"
#include "tools/random_fill.h"

namespace ringsplash::cli {
namespace {

// Index of `pos` in the sorted `positions`, or -1.
int64_t LocalIndex(std::span<const int64_t> positions, int64_t pos) {
  const auto it = std::lower_bound(positions.begin(), positions.end(), pos);
  return it != positions.end() && *it == pos ? it - positions.begin() : -1;
}

// Copies rows (dim 1) of a local [B, n, inner] tensor at the sampled global
// rows it holds into a [B, R, inner] sample buffer.
void CopySampledRows(const Tensor& local, std::span<const int64_t> positions,
                     std::span<const int64_t> sample, std::vector<float>& dst) {
  const std::vector<int64_t>& shape = local.shape();
  const int64_t batch = shape[0], n = shape[1];
  int64_t inner = 1;
  for (size_t i = 2; i < shape.size(); ++i) inner *= shape[i];
  const auto r = static_cast<int64_t>(sample.size());
  dst.assign(static_cast<size_t>(batch * r * inner), 0.0f);
  const float* src = local.data_as<float>();
  for (int64_t s = 0; s < r; ++s) {
    const int64_t li = LocalIndex(positions, sample[s]);
    if (li < 0) continue;
    for (int64_t b = 0; b < batch; ++b) {
      std::memcpy(&dst[static_cast<size_t>((b * r + s) * inner)], src + (b * n + li) * inner,
                  static_cast<size_t>(inner) * sizeof(float));
    }
  }
}

// max |got - want| / max |want| over all entries. Entries equal in value
// (including both -inf: fully masked rows) agree; a non-finite mismatch is
// an infinite error.
double RelErr(std::span<const float> got, std::span<const float> want) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) {
      if (std::isfinite(want[i])) max_ref = std::max(max_ref, std::fabs(double{want[i]}));
      continue;
    }
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) {
      return std::numeric_limits<double>::infinity();
    }
    max_diff = std::max(max_diff, std::fabs(double{got[i]} - double{want[i]}));
    max_ref = std::max(max_ref, std::fabs(double{want[i]}));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

std::span<const float> Span(const Tensor& t) {
  return {t.data_as<float>(), static_cast<size_t>(t.numel())};
}

}  // namespace

std::vector<int64_t> SampleRows(int64_t n, int64_t count) {
  count = std::min(count, n);
  if (count <= 1) return {0};
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = i * (n - 1) / (count - 1);
    if (rows.empty() || rows.back() != r) rows.push_back(r);
  }
  return rows;
}

SampledResults GatherSamples(Communicator& comm, const BenchConfig& c, const LocalResults& l) {
  SampledResults s;
  s.q_rows = SampleRows(c.q_seq, c.check_rows);
  CopySampledRows(*l.out, l.q_pos, s.q_rows, s.out);
  // lse is [B, H, n]: rows of a [B * H, n, 1] view.
  const Tensor& lse = *l.lse;
  const int64_t bh = c.batch * c.heads;
  const int64_t nq = static_cast<int64_t>(l.q_pos.size());
  const auto rq = static_cast<int64_t>(s.q_rows.size());
  s.lse.assign(static_cast<size_t>(bh * rq), 0.0f);
  for (int64_t i = 0; i < rq; ++i) {
    const int64_t li = LocalIndex(l.q_pos, s.q_rows[i]);
    if (li < 0) continue;
    for (int64_t r = 0; r < bh; ++r) s.lse[r * rq + i] = lse.data_as<float>()[r * nq + li];
  }
  SumInto(comm, s.out);
  SumInto(comm, s.lse);
  if (l.dq != nullptr) {
    s.kv_rows = SampleRows(c.seq, c.check_rows);
    CopySampledRows(*l.dq, l.q_pos, s.q_rows, s.dq);
    CopySampledRows(*l.dk, l.kv_pos, s.kv_rows, s.dk);
    CopySampledRows(*l.dv, l.kv_pos, s.kv_rows, s.dv);
    SumInto(comm, s.dq);
    SumInto(comm, s.dk);
    SumInto(comm, s.dv);
  }
  return s;
}

CheckResult CheckSamples(const BenchConfig& c, const Mask& mask, const SampledResults& s,
                         int threads) {
  CheckResult result;
  const int64_t b = c.batch, h = c.heads, hkv = c.kv_heads, d = c.head_dim, dv = c.v_head_dim;
  const auto rq = static_cast<int64_t>(s.q_rows.size());
  result.q_rows = rq;
  AttentionOptions opt;
  opt.mask = mask;
  opt.block_sizes = c.blocks;
  opt.num_threads = threads;

  const std::vector<int64_t> all_kv = Iota(c.seq);
  Tensor k(c.dtype, {b, c.seq, hkv, d}), v(c.dtype, {b, c.seq, hkv, dv});
  FillRandom(k, c.seed, RandomStream::kK, all_kv, c.seq);
  FillRandom(v, c.seed, RandomStream::kV, all_kv, c.seq);
  Tensor q_s(c.dtype, {b, rq, h, d});
  FillRandom(q_s, c.seed, RandomStream::kQ, s.q_rows, c.q_seq);

  AttentionInputs in;
  in.q = q_s.view();
  in.k = k.view();
  in.v = v.view();
  in.q_positions = s.q_rows;
  Tensor out(DType::kF32, {b, rq, h, dv}), lse(DType::kF32, {b, h, rq});
  AttentionForward(in, opt, out.view(), lse.view());
  result.errors.emplace_back("out", RelErr(s.out, Span(out)));
  result.errors.emplace_back("lse", RelErr(s.lse, Span(lse)));

  if (!s.dq.empty()) {
    Tensor dout_s(c.dtype, {b, rq, h, dv});
    FillRandom(dout_s, c.seed, RandomStream::kDout, s.q_rows, c.q_seq);
    Tensor dq(DType::kF32, {b, rq, h, d});
    Tensor dk_unused(DType::kF32, {b, c.seq, hkv, d}), dv_unused(DType::kF32, {b, c.seq, hkv, dv});
    AttentionBackward(in, opt, out.view(), lse.view(), dout_s.view(), dq.view(), dk_unused.view(),
                      dv_unused.view(), {});
    result.errors.emplace_back("dq", RelErr(s.dq, Span(dq)));

    // dk/dv rows need every query row's final lse and out: one full forward.
    const std::vector<int64_t> all_q = Iota(c.q_seq);
    Tensor q(c.dtype, {b, c.q_seq, h, d}), dout(c.dtype, {b, c.q_seq, h, dv});
    FillRandom(q, c.seed, RandomStream::kQ, all_q, c.q_seq);
    FillRandom(dout, c.seed, RandomStream::kDout, all_q, c.q_seq);
    AttentionInputs full;
    full.q = q.view();
    full.k = k.view();
    full.v = v.view();
    Tensor out_full(DType::kF32, {b, c.q_seq, h, dv}), lse_full(DType::kF32, {b, h, c.q_seq});
    AttentionForward(full, opt, out_full.view(), lse_full.view());

    const auto rkv = static_cast<int64_t>(s.kv_rows.size());
    result.kv_rows = rkv;
    Tensor k_s(c.dtype, {b, rkv, hkv, d}), v_s(c.dtype, {b, rkv, hkv, dv});
    FillRandom(k_s, c.seed, RandomStream::kK, s.kv_rows, c.seq);
    FillRandom(v_s, c.seed, RandomStream::kV, s.kv_rows, c.seq);
    AttentionInputs cols;
    cols.q = q.view();
    cols.k = k_s.view();
    cols.v = v_s.view();
    cols.kv_positions = s.kv_rows;
    Tensor dq_unused(DType::kF32, {b, c.q_seq, h, d});
    Tensor dk_ref(DType::kF32, {b, rkv, hkv, d}), dv_ref(DType::kF32, {b, rkv, hkv, dv});
    AttentionBackward(cols, opt, out_full.view(), lse_full.view(), dout.view(), dq_unused.view(),
                      dk_ref.view(), dv_ref.view(), {});
    result.errors.emplace_back("dk", RelErr(s.dk, Span(dk_ref)));
    result.errors.emplace_back("dv", RelErr(s.dv, Span(dv_ref)));
  }
  for (const auto& [name, err] : result.errors) {
    result.max_rel_err = std::max(result.max_rel_err, err);
  }
  return result;
}

}  // namespace ringsplash::cli

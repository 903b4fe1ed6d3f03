// StackedHeads (decode/stacked_heads.h): the stacked problem's inputs.
#include "src/kernels/decode/stacked_heads.h"

#include <cstring>

#include "src/kernels/tiling/tiles.h"

namespace ringsplash::kernels {

StackedHeads::StackedHeads(const FlashParams& p, ThreadPool& pool) : params_(p) {
  const TensorView& q = p.q;
  const int64_t b = q.shape[0], sq = q.shape[1], h = q.shape[2], d = q.shape[3];
  const int64_t hkv = p.k.shape[2];
  group_ = h / hkv;
  const int64_t rows = sq * group_;
  q_ = Tensor(q.dtype, {b, rows, hkv, d});
  const size_t elem = DTypeSize(q.dtype);
  const auto* src = static_cast<const char*>(q.data);
  auto* dst = static_cast<char*>(q_.data());
  pool.ParallelFor(b * sq, [&](int64_t task, int) {
    const int64_t bi = task / sq, i = task % sq;
    for (int64_t hh = 0; hh < group_; ++hh) {
      for (int64_t kh = 0; kh < hkv; ++kh) {
        const char* from = src + q.Offset(bi, i, kh * group_ + hh) * static_cast<int64_t>(elem);
        char* to = dst + (((bi * rows + i * group_ + hh) * hkv + kh) * d) * elem;
        if (q.stride[3] == 1) {
          std::memcpy(to, from, static_cast<size_t>(d) * elem);
        } else {
          for (int64_t c = 0; c < d; ++c) {
            std::memcpy(to + c * elem, from + c * q.stride[3] * static_cast<int64_t>(elem), elem);
          }
        }
      }
    }
  });
  q_pos_.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t hh = 0; hh < group_; ++hh) {
      q_pos_[i * group_ + hh] = p.q_pos != nullptr ? p.q_pos[i] : i;
    }
  }
  params_.q = q_.view();
  params_.row_map = nullptr;  // other rows and positions: maps of their own
  params_.column_map = nullptr;
  params_.q_pos = q_pos_.data();
  if (p.q_segments.defined()) {
    q_segments_ = Tensor(DType::kI32, {b, rows});
    const auto* seg = static_cast<const int32_t*>(p.q_segments.data);
    auto* out = q_segments_.data_as<int32_t>();
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t i = 0; i < sq; ++i) {
        const int32_t s = seg[bi * p.q_segments.stride[0] + i * p.q_segments.stride[1]];
        for (int64_t hh = 0; hh < group_; ++hh) out[bi * rows + i * group_ + hh] = s;
      }
    }
    params_.q_segments = q_segments_.view();
  }
}

}  // namespace ringsplash::kernels

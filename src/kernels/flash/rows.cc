// Finished rows of the forward (flash/rows.h).
#include "src/kernels/flash/rows.h"

#if defined(__x86_64__)
#include <immintrin.h>  // SSE2 non-temporal stores (x86-64 baseline)
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ringsplash/tensor.h"
#include "src/kernels/combine.h"

namespace ringsplash::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row i (dv values, already scaled, in a) as bf16 into dst, vectorised
// (F32ToBF16Row): a scalar loop took ~2.5 µs per computed tile of a
// bf16-out sliding-window forward, whose q blocks finish after ~5 tiles each.
void StoreRowBf16(const float* a, int64_t dv, uint16_t* dst, std::atomic<bool>* overflow) {
  if (F32ToBF16Row(a, dst, dv)) overflow->store(true, std::memory_order_relaxed);
}

}  // namespace

void ScaleRow(float* dst, const float* src, int64_t n, float s, bool stream) {
#if defined(__x86_64__)
  if (stream && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    const __m128 vs = _mm_set1_ps(s);
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) _mm_stream_ps(dst + c, _mm_mul_ps(_mm_loadu_ps(src + c), vs));
    for (; c < n; ++c) dst[c] = src[c] * s;
    return;
  }
#else
  (void)stream;
#endif
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c] * s;
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

RowAt Place(const Geometry& g, const OutRows& out, int64_t row, int64_t h) {
  if (out.stack_group == 0) return {row, h, g.sq, g.h};
  return {row / out.stack_group, h * out.stack_group + row % out.stack_group, out.sq, out.h};
}

void EmitRow(const Geometry& g, int64_t b, int64_t row, int64_t h, float* part, float part_lse,
             bool merge, const OutRows& out, float* lse, bool in_place) {
  const RowAt to = Place(g, out, row, h);
  const int64_t at = ((b * to.sq + to.row) * to.h + to.head) * g.dv;
  float* l_out = lse + (b * to.h + to.head) * to.sq + to.row;
  if (merge) {
    MergePartial(RowShape{1, 1, 1, g.dv}, out.f32 + at, l_out, part, &part_lse);
  } else if (out.bf16.data != nullptr) {
    if (out.bf16.sinks != nullptr) {
      ApplySinks(RowShape{1, 1, 1, g.dv}, part, &part_lse, out.bf16.sinks + to.head);
    }
    *l_out = part_lse;
    StoreRowBf16(part, g.dv, out.Bf16Row(b, to.row, to.head), out.overflow);
  } else {
    *l_out = part_lse;
    if (!in_place) std::memcpy(out.f32 + at, part, static_cast<size_t>(g.dv) * sizeof(float));
  }
}

void FinishRows(const Geometry& g, int64_t b, int64_t h, int64_t qb, int64_t m, const RowState& ws,
                bool merge, bool stream, const OutRows& out, float* lse) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = qb * g.bq + i;
    float* a = ws.acc + i * g.ld_dv;
    // The row's partial result; in place of its accumulator when merging or
    // rounding to bf16.
    const bool in_place = !merge && out.bf16.data == nullptr;
    const RowAt to = Place(g, out, row, h);
    float* part = in_place ? out.f32 + ((b * to.sq + to.row) * to.h + to.head) * g.dv : a;
    float part_lse = kNegInf;
    const float l = ws.row_sum[i];
    if (l > 0.0f) {
      ScaleRow(part, a, g.dv, 1.0f / l, stream);
      part_lse = ws.row_max[i] + std::log(l);
    } else {
      std::memset(part, 0, static_cast<size_t>(g.dv) * sizeof(float));
    }
    EmitRow(g, b, row, h, part, part_lse, merge, out, lse, in_place);
  }
}

}  // namespace ringsplash::kernels

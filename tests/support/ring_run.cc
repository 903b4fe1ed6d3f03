// See ring_run.h.
#include "tests/support/ring_run.h"

#include <cstdint>
#include <vector>

#include "ringsplash/comm.h"

namespace ringsplash::testing {

namespace {

// A [B, S/N, ...] f32 tensor for a shard of `global` (dim 1 the sequence).
Tensor LocalLike(const TensorView& global, int ranks, DType dtype) {
  std::vector<int64_t> shape(global.shape.begin(), global.shape.begin() + global.ndim);
  shape[1] /= ranks;
  return Tensor(dtype, shape);
}

// Rank r's shard of `global` (undefined stays undefined).
Tensor Shard(const Tensor& global, int r, int ranks, Layout layout) {
  if (global.data() == nullptr) return Tensor();
  Tensor local = LocalLike(global.view(), ranks, global.dtype());
  ShardSequence(layout, r, ranks, global.view(), local.view());
  return local;
}

TensorView ViewOrNone(const Tensor& t) { return t.data() != nullptr ? t.view() : TensorView(); }

}  // namespace

ApiResult RunRingSharded(const OwnedInputs& in, const Tensor& dout, int ranks, Layout layout,
                         const std::function<RingOptions(int rank)>& options_of) {
  const TensorView q = in.q.view(), k = in.k.view(), v = in.v.view();
  const int64_t b = q.shape[0], s = q.shape[1], h = q.shape[2], dv_dim = v.shape[3];
  const bool sinks = in.sinks.data() != nullptr;
  Tensor out(DType::kF32, {b, s, h, dv_dim}), lse(DType::kF32, {b, h, s});
  Tensor dq(DType::kF32, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
  Tensor dk(DType::kF32, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]});
  Tensor dv(DType::kF32, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
  Tensor dsinks(DType::kF32, {h});
  RunThreadRanks(ranks, CommOptions{}, [&](Communicator& comm) {
    const int r = comm.rank();
    const RingOptions options = options_of(r);
    const Tensor lq = Shard(in.q, r, ranks, layout), lk = Shard(in.k, r, ranks, layout);
    const Tensor lv = Shard(in.v, r, ranks, layout), ldout = Shard(dout, r, ranks, layout);
    const Tensor qs = Shard(in.q_seg, r, ranks, layout), ks = Shard(in.kv_seg, r, ranks, layout);
    AttentionInputs local;
    local.q = lq.view();
    local.k = lk.view();
    local.v = lv.view();
    local.sinks = ViewOrNone(in.sinks);
    local.q_segments = ViewOrNone(qs);
    local.kv_segments = ViewOrNone(ks);
    Tensor lo = LocalLike(out.view(), ranks, DType::kF32);
    Tensor ll(DType::kF32, {b, h, s / ranks});
    Tensor ldq = LocalLike(q, ranks, DType::kF32), ldk = LocalLike(k, ranks, DType::kF32);
    Tensor ldv = LocalLike(v, ranks, DType::kF32);
    Tensor lds(DType::kF32, {h});
    RingAttentionForward(comm, local, options, lo.view(), ll.view());
    RingAttentionBackward(comm, local, options, lo.view(), ll.view(), ldout.view(), ldq.view(),
                          ldk.view(), ldv.view(), sinks ? lds.view() : TensorView());
    GatherSequence(layout, r, ranks, lo.view(), out.view());
    GatherSequence(layout, r, ranks, ll.view(), lse.view(), /*seq_dim=*/2);
    GatherSequence(layout, r, ranks, ldq.view(), dq.view());
    GatherSequence(layout, r, ranks, ldk.view(), dk.view());
    GatherSequence(layout, r, ranks, ldv.view(), dv.view());
    if (r == 0 && sinks) CopyConvert(lds.view(), dsinks.view());
  });
  ApiResult res;
  res.out = ToDoubles(out.view());
  res.lse = ToDoubles(lse.view());
  res.dq = ToDoubles(dq.view());
  res.dk = ToDoubles(dk.view());
  res.dv = ToDoubles(dv.view());
  if (sinks) res.dsinks = ToDoubles(dsinks.view());
  return res;
}

}  // namespace ringsplash::testing

// 2-D context parallelism on one rank (include/ringsplash/context_parallel.h):
// all-to-all within the Ulysses group, ring.h's ring across the groups,
// all-to-all back.
//
// Data on rank (group g, member j) of N = P x U, c = local Sq (ck = local Skv):
//   caller's shards   q [B, c, H, D], k/v [B, ck, Hkv, D|Dv]   (N-rank layout)
//   all-to-all in     block to member m: q heads of m [B, c, H/U, D], k/v kv
//                     heads of m [B, ck, Hkv_l, D|Dv], segment ids [B, c|ck]
//                     (to every m); the backward adds out, dout [B, c, H/U, Dv]
//                     and lse [B, H/U, c] of m's heads
//   ring inputs       q_r [B, U c, H/U, D], k_r/v_r [B, U ck, Hkv_l, D|Dv]:
//                     the group's rows in the order of rank g of the same
//                     layout over P ranks (GroupRows), on the ring of the
//                     members j of every group (ring rank g)
//   ring outputs      out_r [B, U c, H/U, Dv] (out's dtype), lse_r [B, H/U, U c];
//                     backward dq_r (dq's dtype), dk_r/dv_r (their dtypes, or
//                     f32 when kv heads are replicated: summed on arrival),
//                     dsinks_r [H/U]
//   all-to-all back   block to member m: the rows of m's shard, j's heads
//   (Mask::DenseRows   each leaf's rows of m's heads go to m in one more
//    all-to-all before the first: GatherDenseRows)
// Every copy in and out is a bit copy (MoveRows), so the only arithmetic
// beyond the ring's is the f32 sum of replicated kv heads' dk/dv and the
// assembly of dsinks (adding zeros, exact).
#include "ringsplash/context_parallel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "src/kernels/validate.h"
#include "src/mask/mask_node.h"
#include "src/ring/ring_internal.h"
#include "src/ring/ulysses_internal.h"

namespace ringsplash {

namespace {

using ulysses_internal::BlockLayout;
using ulysses_internal::HeadSplit;
using ulysses_internal::MoveRows;
using Clock = std::chrono::steady_clock;

// An argument error every rank detects alike from agreed values, after the
// last collective of the checks: nobody waits for anybody, so it is thrown
// without Communicator::Abort and the communicators stay usable.
class AgreedError : public Error {
 public:
  using Error::Error;
};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Zero-filled bytes, 64-byte aligned (Tensor's allocation).
Tensor Bytes(size_t bytes) {
  return Tensor(DType::kBool, {static_cast<int64_t>(std::max<size_t>(bytes, 1))});
}

TensorView ViewOrEmpty(const Tensor& t) { return t.data() != nullptr ? t.view() : TensorView{}; }

// Everything fixed for one call on this rank.
struct CallSetup {
  kernels::AttentionDims dims;  // the caller's local sizes
  HeadSplit heads;
  ContextParallelCoordinates at;
  int u = 1;
  // [member][local row] -> row of the ring inputs (ulysses_internal::GroupRows)
  std::vector<std::vector<int64_t>> q_rows, kv_rows;
  RingOptions ring;  // mask restricted to this member's heads, fault mapped, threads set
  TensorView sinks;  // this member's heads of the sinks (undefined without)
  // The caller's Mask::DenseRows leaves (each rank's own rows): the ring's
  // mask is made only once their rows are gathered over the group
  // (GatherDenseRows; ring.attention.mask is unset until then).
  std::vector<const mask_detail::Node*> dense_rows;
};

// The checks of both passes and the setup; `check_outputs` validates the
// pass's outputs given the local sizes. Local argument errors propagate as
// they are (the caller aborts the job: peers may be waiting in the
// agreement below); disagreements and the U rules throw RanksDisagree or
// AgreedError on every rank alike.
CallSetup Prepare(const ContextParallelGroups& groups, const AttentionInputs& local,
                  const ContextParallelOptions& options, bool backward,
                  const std::function<void(const kernels::AttentionDims&)>& check_outputs) {
  Communicator& comm = groups.comm();
  Check(options.ulysses == groups.ulysses(), "ulysses: options.ulysses = ", options.ulysses,
        " but the ContextParallelGroups were made for U = ", groups.ulysses());
  Check(options.ring.layout == groups.layout(), "layout: options.ring.layout is '",
        LayoutName(options.ring.layout), "' but the ContextParallelGroups were made for '",
        LayoutName(groups.layout()), "' (the grouping of ranks depends on the layout)");
  Check(local.q_positions.empty() && local.kv_positions.empty(),
        "context parallel: q_positions and kv_positions must be empty (global positions follow "
        "from the layout), got ",
        local.q_positions.size(), " and ", local.kv_positions.size());
  Check(options.ring.plan == nullptr,
        "context parallel: RingOptions::plan must be null with U = ", groups.ulysses(),
        " > 1 (a RingPlan is made for one ring's rows, heads and mask; the ring of Ulysses "
        "groups runs on the group's rows and this rank's heads)");
  const AttentionOptions& opt = options.ring.attention;
  CallSetup s;
  // Positions against dense masks are checked on global positions below
  // (and by the ring), as PrepareRing does.
  s.dims = kernels::ValidateInputsAndOptions(local, opt, /*dense_positions=*/false);
  check_outputs(s.dims);
  const float scale = opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(s.dims.d));
  ring_internal::CheckRanksAgree(comm, local, options.ring, s.dims, scale, backward);

  // From here on every value checked agrees across ranks.
  const int n = comm.size();
  s.u = groups.ulysses();
  s.at = groups.coordinates();
  try {
    s.heads = ulysses_internal::SplitHeads(s.dims.h, s.dims.hkv, s.u);
    s.q_rows = ulysses_internal::GroupRows(options.ring.layout, s.dims.sq * n, s.at.group, n, s.u,
                                           "global q sequence length (local Sq x ranks)");
    s.kv_rows = ulysses_internal::GroupRows(options.ring.layout, s.dims.skv * n, s.at.group, n, s.u,
                                            "global kv sequence length (local Skv x ranks)");
    s.dense_rows = ulysses_internal::DenseRowsLeaves(opt.mask);
    if (opt.mask.has_dense()) {
      // A global Dense leaf must cover the global sequence (the same on every
      // rank); DenseRows leaves hold each rank's own rows, checked when they
      // are gathered (GatherDenseRows), and their key extent is agreed.
      Check((!s.dense_rows.empty() || s.dims.sq * n <= opt.mask.dense_sq()) &&
                s.dims.skv * n <= opt.mask.dense_skv(),
            "mask: expected a dense mask covering the global sequence [", s.dims.sq * n, ", ",
            s.dims.skv * n, "] (local lengths x ", n, " ranks), got a dense extent of [",
            opt.mask.dense_sq(), ", ", opt.mask.dense_skv(), "]");
    }
  } catch (const AgreedError&) {
    throw;
  } catch (const Error& e) {
    throw AgreedError(e.what());
  }

  // The ring's options: this member's heads, and the fault (which names a
  // rank of `comm` and a step of the ring of groups) given only to its rank.
  const int64_t first = s.heads.FirstHead(s.at.member);
  s.ring = options.ring;
  if (s.dense_rows.empty()) {
    s.ring.attention.mask = ulysses_internal::MaskForHeads(opt.mask, first, s.heads.local_heads);
  }
  if (local.sinks.defined()) s.sinks = local.sinks.Narrowed(0, first, s.heads.local_heads);
  const std::optional<FaultSpec> fault =
      options.ring.fault ? options.ring.fault : FaultSpec::FromEnv();
  s.ring.fault = FaultSpec{};
  if (fault && fault->rank >= 0 && fault->step >= 0) {
    const char* what = options.ring.fault ? "options.ring.fault" : "RINGSPLASH_FAULT";
    const int p = n / s.u;
    Check(fault->rank < n, what, ": rank ", fault->rank, " is not one of the ", n,
          " ranks (expected RANK in 0..", n - 1, ")");
    Check(fault->step < p, what, ": step ", fault->step, " is past the last step of the ring of ",
          p, " Ulysses groups (expected STEP in 0..", p - 1, ")");
    if (fault->rank == comm.rank()) {
      s.ring.fault = FaultSpec{s.at.group, fault->step, fault->backward};
    }
  }
  // The ring would share the cores by its own size (N/U), but all N ranks
  // compute at once.
  if (s.ring.attention.num_threads == 0) s.ring.attention.num_threads = comm.DefaultThreads();
  return s;
}

// One all-to-all of `layout` blocks on the group communicator, timed.
void Exchange(Communicator& group, const BlockLayout& layout, const Tensor& send, Tensor& recv,
              double* seconds, int64_t* bytes) {
  const Clock::time_point t0 = Clock::now();
  group.AllToAll(send.data(), recv.data(), layout.bytes());
  *seconds += SecondsSince(t0);
  *bytes += static_cast<int64_t>(layout.bytes()) * (group.size() - 1);
}

// The ring's mask when the caller's has Mask::DenseRows leaves: each rank
// holds the dense rows of its own query positions (of the N-rank layout),
// the ring runs the group's, so every leaf's rows of this member's heads
// (all of them for a head-independent leaf) travel to it in one all-to-all
// ([heads, local Sq, Skv] bytes per leaf and destination) and become a
// DenseRows leaf over the ring's positions (LayoutPositions of the group
// over N/U ranks). Collective over the group.
Mask GatherDenseRows(Communicator& group, const CallSetup& s, const Mask& mask, Layout layout,
                     int rank, int num_ranks, double* seconds, int64_t* bytes) {
  const HeadSplit& hs = s.heads;
  const int64_t c = s.dims.sq, hl = hs.local_heads, rows = c * s.u;
  const int64_t sq_global = c * num_ranks;
  const std::vector<int64_t> mine =
      LayoutPositions(layout, sq_global, rank, num_ranks, "global q sequence length");
  BlockLayout layout_b;
  std::vector<int> at;
  for (const mask_detail::Node* leaf : s.dense_rows) {
    const int64_t heads = leaf->dense_heads == 0 ? 1 : hl;
    at.push_back(layout_b.Add(DType::kBool, {heads, c, leaf->skv}));
  }
  Tensor send = Bytes(layout_b.bytes() * static_cast<size_t>(s.u));
  Tensor recv = Bytes(layout_b.bytes() * static_cast<size_t>(s.u));
  for (size_t i = 0; i < s.dense_rows.size(); ++i) {
    const mask_detail::Node& leaf = *s.dense_rows[i];
    std::vector<int64_t> matrix_row(static_cast<size_t>(c));
    for (int64_t l = 0; l < c; ++l) {
      matrix_row[static_cast<size_t>(l)] = mask_detail::DenseRow(leaf, mine[l]);
      Check(matrix_row[static_cast<size_t>(l)] >= 0,
            "mask: expected a dense mask holding a row for each of this rank's query positions "
            "(rank ",
            rank, " of ", num_ranks, ", layout ", LayoutName(layout),
            "), got one with no row for global position ", mine[l],
            " (Mask::DenseRows(values, heads, LayoutPositions(layout, Sq, rank, N), Skv))");
    }
    const int64_t heads = leaf.dense_heads == 0 ? 1 : hl;
    for (int m = 0; m < s.u; ++m) {
      auto* dst = static_cast<uint8_t*>(layout_b.View(send.data(), m, at[i]).data);
      for (int64_t h = 0; h < heads; ++h) {
        const uint8_t* matrix = leaf.DenseMatrix(leaf.dense_heads == 0 ? 0 : hs.FirstHead(m) + h);
        for (int64_t l = 0; l < c; ++l) {
          std::memcpy(dst + (h * c + l) * leaf.skv,
                      matrix + matrix_row[static_cast<size_t>(l)] * leaf.skv,
                      static_cast<size_t>(leaf.skv));
        }
      }
    }
  }
  Exchange(group, layout_b, send, recv, seconds, bytes);
  send = Tensor();
  std::vector<ulysses_internal::LeafReplacement> replacements;
  for (size_t i = 0; i < s.dense_rows.size(); ++i) {
    const mask_detail::Node& leaf = *s.dense_rows[i];
    const int64_t heads = leaf.dense_heads == 0 ? 1 : hl;
    std::vector<uint8_t> values(static_cast<size_t>(heads * rows * leaf.skv));
    for (int j = 0; j < s.u; ++j) {
      const auto* src = static_cast<const uint8_t*>(layout_b.View(recv.data(), j, at[i]).data);
      const std::vector<int64_t>& qr = s.q_rows[static_cast<size_t>(j)];
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t l = 0; l < c; ++l) {
          std::memcpy(values.data() + (h * rows + qr[static_cast<size_t>(l)]) * leaf.skv,
                      src + (h * c + l) * leaf.skv, static_cast<size_t>(leaf.skv));
        }
      }
    }
    replacements.push_back(
        {&leaf, Mask::DenseRows(std::move(values), leaf.dense_heads == 0 ? 0 : hl,
                                LayoutPositions(layout, sq_global, s.at.group, num_ranks / s.u),
                                leaf.skv)});
  }
  return ulysses_internal::MaskForHeads(mask, hs.FirstHead(s.at.member), hl, replacements);
}

// The ring's inputs, and what came with them, on this rank.
struct RingInputs {
  Tensor q, k, v, q_seg, kv_seg;
  Tensor out, dout, lse;  // backward only
  AttentionInputs View(const TensorView& sinks) const {
    AttentionInputs in;
    in.q = q.view();
    in.k = k.view();
    in.v = v.view();
    in.sinks = sinks;
    in.q_segments = ViewOrEmpty(q_seg);
    in.kv_segments = ViewOrEmpty(kv_seg);
    return in;
  }
};

// The first all-to-all: each member's heads of this rank's rows out, this
// member's heads of the group's rows in, reordered for the ring. With
// `backward`, out, dout and lse travel too.
RingInputs HeadsIn(Communicator& group, const CallSetup& s, const AttentionInputs& local,
                   const TensorView* out, const TensorView* dout, const TensorView* lse,
                   double* seconds, int64_t* bytes) {
  const kernels::AttentionDims& d = s.dims;
  const HeadSplit& hs = s.heads;
  const int64_t hl = hs.local_heads, kl = hs.local_kv;
  const bool backward = dout != nullptr;
  const bool segments = local.q_segments.defined();
  BlockLayout layout;
  const int q_at = layout.Add(local.q.dtype, {d.b, d.sq, hl, d.d});
  const int k_at = layout.Add(local.k.dtype, {d.b, d.skv, kl, d.d});
  const int v_at = layout.Add(local.v.dtype, {d.b, d.skv, kl, d.dv});
  const int qs_at = segments ? layout.Add(DType::kI32, {d.b, d.sq}) : -1;
  const int kvs_at = segments ? layout.Add(DType::kI32, {d.b, d.skv}) : -1;
  const int o_at = backward ? layout.Add(out->dtype, {d.b, d.sq, hl, d.dv}) : -1;
  const int do_at = backward ? layout.Add(dout->dtype, {d.b, d.sq, hl, d.dv}) : -1;
  const int l_at = backward ? layout.Add(DType::kF32, {d.b, hl, d.sq}) : -1;

  RingInputs r;
  {
    Tensor send = Bytes(layout.bytes() * static_cast<size_t>(s.u));
    Tensor recv = Bytes(layout.bytes() * static_cast<size_t>(s.u));
    for (int m = 0; m < s.u; ++m) {
      void* base = send.data();
      MoveRows(local.q.Narrowed(2, hs.FirstHead(m), hl), layout.View(base, m, q_at), 1, {}, {});
      MoveRows(local.k.Narrowed(2, hs.FirstKvHead(m), kl), layout.View(base, m, k_at), 1, {}, {});
      MoveRows(local.v.Narrowed(2, hs.FirstKvHead(m), kl), layout.View(base, m, v_at), 1, {}, {});
      if (segments) {
        MoveRows(local.q_segments, layout.View(base, m, qs_at), 1, {}, {});
        MoveRows(local.kv_segments, layout.View(base, m, kvs_at), 1, {}, {});
      }
      if (backward) {
        MoveRows(out->Narrowed(2, hs.FirstHead(m), hl), layout.View(base, m, o_at), 1, {}, {});
        MoveRows(dout->Narrowed(2, hs.FirstHead(m), hl), layout.View(base, m, do_at), 1, {}, {});
        MoveRows(lse->Narrowed(1, hs.FirstHead(m), hl), layout.View(base, m, l_at), 2, {}, {});
      }
    }
    Exchange(group, layout, send, recv, seconds, bytes);
    send = Tensor();

    const int64_t rq = d.sq * s.u, rkv = d.skv * s.u;
    r.q = Tensor(local.q.dtype, {d.b, rq, hl, d.d});
    r.k = Tensor(local.k.dtype, {d.b, rkv, kl, d.d});
    r.v = Tensor(local.v.dtype, {d.b, rkv, kl, d.dv});
    if (segments) {
      r.q_seg = Tensor(DType::kI32, {d.b, rq});
      r.kv_seg = Tensor(DType::kI32, {d.b, rkv});
    }
    if (backward) {
      r.out = Tensor(out->dtype, {d.b, rq, hl, d.dv});
      r.dout = Tensor(dout->dtype, {d.b, rq, hl, d.dv});
      r.lse = Tensor(DType::kF32, {d.b, hl, rq});
    }
    for (int j = 0; j < s.u; ++j) {
      void* base = recv.data();
      const std::vector<int64_t>& qr = s.q_rows[static_cast<size_t>(j)];
      const std::vector<int64_t>& kr = s.kv_rows[static_cast<size_t>(j)];
      MoveRows(layout.View(base, j, q_at), r.q.view(), 1, {}, qr);
      MoveRows(layout.View(base, j, k_at), r.k.view(), 1, {}, kr);
      MoveRows(layout.View(base, j, v_at), r.v.view(), 1, {}, kr);
      if (segments) {
        MoveRows(layout.View(base, j, qs_at), r.q_seg.view(), 1, {}, qr);
        MoveRows(layout.View(base, j, kvs_at), r.kv_seg.view(), 1, {}, kr);
      }
      if (backward) {
        MoveRows(layout.View(base, j, o_at), r.out.view(), 1, {}, qr);
        MoveRows(layout.View(base, j, do_at), r.dout.view(), 1, {}, qr);
        MoveRows(layout.View(base, j, l_at), r.lse.view(), 2, {}, qr);
      }
    }
  }
  return r;
}

// acc[b, i, h, x] += part[b, i, h, x], both f32 views of one shape.
void AddInto(const TensorView& part, const TensorView& acc) {
  for (int64_t b = 0; b < part.shape[0]; ++b) {
    for (int64_t i = 0; i < part.shape[1]; ++i) {
      for (int64_t h = 0; h < part.shape[2]; ++h) {
        const float* p = static_cast<const float*>(part.data) + part.Offset(b, i, h);
        float* a = static_cast<float*>(acc.data) + acc.Offset(b, i, h);
        for (int64_t x = 0; x < part.shape[3]; ++x) a[x * acc.stride[3]] += p[x * part.stride[3]];
      }
    }
  }
}

void Forward(ContextParallelGroups& groups, const CallSetup& s, const AttentionInputs& local,
             const TensorView& out, const TensorView& lse, ContextParallelStats& st) {
  Communicator& group = *groups.group_comm();
  const kernels::AttentionDims& d = s.dims;
  const HeadSplit& hs = s.heads;
  const int64_t hl = hs.local_heads;
  Tensor out_r, lse_r;
  {
    const RingInputs r = HeadsIn(group, s, local, nullptr, nullptr, nullptr,
                                 &st.forward_all_to_all_seconds, &st.forward_all_to_all_bytes);
    out_r = Tensor(out.dtype, {d.b, d.sq * s.u, hl, d.dv});
    lse_r = Tensor(DType::kF32, {d.b, hl, d.sq * s.u});
    RingAttentionForward(groups.ring_comm(), r.View(s.sinks), s.ring, out_r.view(), lse_r.view(),
                         &st.ring);
  }
  BlockLayout layout;
  const int o_at = layout.Add(out.dtype, {d.b, d.sq, hl, d.dv});
  const int l_at = layout.Add(DType::kF32, {d.b, hl, d.sq});
  Tensor send = Bytes(layout.bytes() * static_cast<size_t>(s.u));
  Tensor recv = Bytes(layout.bytes() * static_cast<size_t>(s.u));
  for (int m = 0; m < s.u; ++m) {
    const std::vector<int64_t>& qr = s.q_rows[static_cast<size_t>(m)];
    MoveRows(out_r.view(), layout.View(send.data(), m, o_at), 1, qr, {});
    MoveRows(lse_r.view(), layout.View(send.data(), m, l_at), 2, qr, {});
  }
  out_r = Tensor();
  Exchange(group, layout, send, recv, &st.forward_all_to_all_seconds, &st.forward_all_to_all_bytes);
  for (int j = 0; j < s.u; ++j) {
    MoveRows(layout.View(recv.data(), j, o_at), out.Narrowed(2, hs.FirstHead(j), hl), 1, {}, {});
    MoveRows(layout.View(recv.data(), j, l_at), lse.Narrowed(1, hs.FirstHead(j), hl), 2, {}, {});
  }
}

void Backward(ContextParallelGroups& groups, const CallSetup& s, const AttentionInputs& local,
              const TensorView& out, const TensorView& lse, const TensorView& dout,
              const TensorView& dq, const TensorView& dk, const TensorView& dv,
              const TensorView& dsinks, ContextParallelStats& st) {
  Communicator& group = *groups.group_comm();
  const kernels::AttentionDims& d = s.dims;
  const HeadSplit& hs = s.heads;
  const int64_t hl = hs.local_heads, kl = hs.local_kv;
  const bool replicated = hs.kv_replicas > 1;
  // Replicas' dk/dv are partial sums over their query heads: kept in f32
  // until summed. Otherwise the ring writes the caller's dtype (its checked
  // conversion) and the rows travel as they will be stored.
  const DType dk_type = replicated ? DType::kF32 : dk.dtype;
  const DType dv_type = replicated ? DType::kF32 : dv.dtype;
  Tensor dq_r, dk_r, dv_r;
  std::vector<float> ds(static_cast<size_t>(d.h), 0.0f);
  {
    const RingInputs r = HeadsIn(group, s, local, &out, &dout, &lse,
                                 &st.backward_all_to_all_seconds, &st.backward_all_to_all_bytes);
    dq_r = Tensor(dq.dtype, {d.b, d.sq * s.u, hl, d.d});
    dk_r = Tensor(dk_type, {d.b, d.skv * s.u, kl, d.d});
    dv_r = Tensor(dv_type, {d.b, d.skv * s.u, kl, d.dv});
    Tensor ds_r;
    if (s.sinks.defined()) ds_r = Tensor(DType::kF32, {hl});
    RingAttentionBackward(groups.ring_comm(), r.View(s.sinks), s.ring, r.out.view(), r.lse.view(),
                          r.dout.view(), dq_r.view(), dk_r.view(), dv_r.view(), ViewOrEmpty(ds_r),
                          &st.ring);
    if (s.sinks.defined()) {
      for (int64_t i = 0; i < hl; ++i) {
        ds[static_cast<size_t>(hs.FirstHead(s.at.member) + i)] = ds_r.data_as<float>()[i];
      }
    }
  }
  BlockLayout layout;
  const int q_at = layout.Add(dq.dtype, {d.b, d.sq, hl, d.d});
  const int k_at = layout.Add(dk_type, {d.b, d.skv, kl, d.d});
  const int v_at = layout.Add(dv_type, {d.b, d.skv, kl, d.dv});
  Tensor send = Bytes(layout.bytes() * static_cast<size_t>(s.u));
  Tensor recv = Bytes(layout.bytes() * static_cast<size_t>(s.u));
  for (int m = 0; m < s.u; ++m) {
    const std::vector<int64_t>& qr = s.q_rows[static_cast<size_t>(m)];
    const std::vector<int64_t>& kr = s.kv_rows[static_cast<size_t>(m)];
    MoveRows(dq_r.view(), layout.View(send.data(), m, q_at), 1, qr, {});
    MoveRows(dk_r.view(), layout.View(send.data(), m, k_at), 1, kr, {});
    MoveRows(dv_r.view(), layout.View(send.data(), m, v_at), 1, kr, {});
  }
  dq_r = Tensor();
  dk_r = Tensor();
  dv_r = Tensor();
  Exchange(group, layout, send, recv, &st.backward_all_to_all_seconds,
           &st.backward_all_to_all_bytes);
  send = Tensor();
  for (int j = 0; j < s.u; ++j) {
    MoveRows(layout.View(recv.data(), j, q_at), dq.Narrowed(2, hs.FirstHead(j), hl), 1, {}, {});
  }
  if (!replicated) {
    for (int j = 0; j < s.u; ++j) {
      const int64_t kv0 = hs.FirstKvHead(j);
      MoveRows(layout.View(recv.data(), j, k_at), dk.Narrowed(2, kv0, kl), 1, {}, {});
      MoveRows(layout.View(recv.data(), j, v_at), dv.Narrowed(2, kv0, kl), 1, {}, {});
    }
  } else {
    // Each kv head's replicas, summed in member order (deterministic).
    Tensor dk_sum(DType::kF32, {d.b, d.skv, d.hkv, d.d});
    Tensor dv_sum(DType::kF32, {d.b, d.skv, d.hkv, d.dv});
    for (int j = 0; j < s.u; ++j) {
      const int64_t kv0 = hs.FirstKvHead(j);
      AddInto(layout.View(recv.data(), j, k_at), dk_sum.view().Narrowed(2, kv0, 1));
      AddInto(layout.View(recv.data(), j, v_at), dv_sum.view().Narrowed(2, kv0, 1));
    }
    // Checked: a finite sum beyond an f16/bf16 range is an Error naming it.
    CopyConvert(dk_sum.view(), dk, "dk");
    CopyConvert(dv_sum.view(), dv, "dv");
  }
  if (s.sinks.defined()) {
    // Each member's heads, summed over the whole sequence by its ring; the
    // others' entries are 0 here, so the sum is exact and the same on every
    // rank (NaN, the poison rule's, stays NaN).
    group.AllReduceSum(ds.data(), ds.size());
    for (int64_t h = 0; h < d.h; ++h) StoreFromF32(dsinks, h * dsinks.stride[0], ds[h]);
  }
}

// Runs `body` after Prepare with the error handling of context_parallel.h:
// errors every rank throws alike propagate as they are; anything else tells
// the peers (Abort on the call's communicator fails the whole job).
template <typename CheckOutputs, typename Body>
void Guarded(ContextParallelGroups& groups, const AttentionInputs& local,
             const ContextParallelOptions& options, bool backward, ContextParallelStats* stats,
             const CheckOutputs& check_outputs, const Body& body) {
  Communicator& comm = groups.comm();
  try {
    CallSetup s = Prepare(groups, local, options, backward, check_outputs);
    ContextParallelStats own;
    ContextParallelStats& st = stats != nullptr ? *stats : own;
    st.rank = comm.rank();
    st.coordinates = s.at;
    double& a2a_seconds = backward ? st.backward_all_to_all_seconds : st.forward_all_to_all_seconds;
    int64_t& a2a_bytes = backward ? st.backward_all_to_all_bytes : st.forward_all_to_all_bytes;
    a2a_seconds = 0;
    a2a_bytes = 0;
    if (!s.dense_rows.empty()) {
      s.ring.attention.mask =
          GatherDenseRows(*groups.group_comm(), s, options.ring.attention.mask, options.ring.layout,
                          comm.rank(), comm.size(), &a2a_seconds, &a2a_bytes);
    }
    body(s, st);
  } catch (const ring_internal::RanksDisagree&) {
    throw;
  } catch (const AgreedError&) {
    throw;
  } catch (const std::exception& e) {
    comm.Abort(FailureReason(e));
    throw;
  }
}

}  // namespace

void ContextParallelForward(ContextParallelGroups& groups, const AttentionInputs& local,
                            const ContextParallelOptions& options, TensorView out, TensorView lse,
                            ContextParallelStats* stats) {
  if (groups.ulysses() == 1 && options.ulysses == 1 && options.ring.layout == groups.layout()) {
    // The 1-D ring itself (ring.h), bit for bit.
    if (stats != nullptr) {
      stats->rank = groups.comm().rank();
      stats->coordinates = groups.coordinates();
      stats->forward_all_to_all_seconds = 0;
      stats->forward_all_to_all_bytes = 0;
    }
    RingAttentionForward(groups.comm(), local, options.ring, out, lse,
                         stats != nullptr ? &stats->ring : nullptr);
    return;
  }
  Guarded(
      groups, local, options, /*backward=*/false, stats,
      [&](const kernels::AttentionDims& d) { kernels::ValidateForwardOutputs(d, local, out, lse); },
      [&](const CallSetup& s, ContextParallelStats& st) {
        Forward(groups, s, local, out, lse, st);
      });
}

void ContextParallelBackward(ContextParallelGroups& groups, const AttentionInputs& local,
                             const ContextParallelOptions& options, TensorView out, TensorView lse,
                             TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                             TensorView dsinks, ContextParallelStats* stats) {
  if (groups.ulysses() == 1 && options.ulysses == 1 && options.ring.layout == groups.layout()) {
    if (stats != nullptr) {
      stats->rank = groups.comm().rank();
      stats->coordinates = groups.coordinates();
      stats->backward_all_to_all_seconds = 0;
      stats->backward_all_to_all_bytes = 0;
    }
    RingAttentionBackward(groups.comm(), local, options.ring, out, lse, dout, dq, dk, dv, dsinks,
                          stats != nullptr ? &stats->ring : nullptr);
    return;
  }
  Guarded(
      groups, local, options, /*backward=*/true, stats,
      [&](const kernels::AttentionDims& d) {
        kernels::ValidateBackwardArgs(d, local, out, lse, dout, dq, dk, dv, dsinks);
      },
      [&](const CallSetup& s, ContextParallelStats& st) {
        Backward(groups, s, local, out, lse, dout, dq, dk, dv, dsinks, st);
      });
}

void ContextParallelForward(Communicator& comm, const AttentionInputs& local,
                            const ContextParallelOptions& options, TensorView out, TensorView lse,
                            ContextParallelStats* stats) {
  ContextParallelGroups groups(comm, options.ulysses, options.ring.layout);
  ContextParallelForward(groups, local, options, out, lse, stats);
}

void ContextParallelBackward(Communicator& comm, const AttentionInputs& local,
                             const ContextParallelOptions& options, TensorView out, TensorView lse,
                             TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                             TensorView dsinks, ContextParallelStats* stats) {
  ContextParallelGroups groups(comm, options.ulysses, options.ring.layout);
  ContextParallelBackward(groups, local, options, out, lse, dout, dq, dk, dv, dsinks, stats);
}

}  // namespace ringsplash

// Setup shared by the ring forward and backward (see ring_internal.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "ringsplash/error.h"
#include "src/kernels/combine.h"
#include "src/ring/ring_internal.h"

namespace ringsplash::ring_internal {

namespace {

size_t AlignUp(size_t n) { return (n + 63) / 64 * 64; }

}  // namespace

SliceLayout::SliceLayout(const kernels::AttentionDims& d, DType dt, bool segments)
    : dims(d), dtype(dt), has_segments(segments) {
  const size_t es = DTypeSize(dt);
  const auto rows = static_cast<size_t>(d.b * d.skv * d.hkv);
  k_offset = 0;
  v_offset = AlignUp(k_offset + rows * static_cast<size_t>(d.d) * es);
  seg_offset = AlignUp(v_offset + rows * static_cast<size_t>(d.dv) * es);
  poison_offset = AlignUp(seg_offset + (segments ? static_cast<size_t>(d.b * d.skv) * 4 : 0));
  bytes = AlignUp(poison_offset + 1 + rows);
}

TensorView SliceLayout::K(void* base) const {
  return TensorView::Contiguous(static_cast<char*>(base) + k_offset, dtype,
                                {dims.b, dims.skv, dims.hkv, dims.d});
}

TensorView SliceLayout::V(void* base) const {
  return TensorView::Contiguous(static_cast<char*>(base) + v_offset, dtype,
                                {dims.b, dims.skv, dims.hkv, dims.dv});
}

TensorView SliceLayout::Segments(void* base) const {
  if (!has_segments) return TensorView{};
  return TensorView::Contiguous(static_cast<char*>(base) + seg_offset, DType::kI32,
                                {dims.b, dims.skv});
}

bool SliceLayout::AnyPoison(const void* base) const {
  return static_cast<const char*>(base)[poison_offset] != 0;
}

const char* SliceLayout::PoisonFlags(const void* base) const {
  return AnyPoison(base) ? static_cast<const char*>(base) + poison_offset + 1 : nullptr;
}

void SliceLayout::Pack(const AttentionInputs& local, void* base) const {
  CopyElements(local.k, K(base));
  CopyElements(local.v, V(base));
  if (has_segments) CopyElements(local.kv_segments, Segments(base));
  std::vector<char> flags;
  const bool any = kernels::CleanKeyValuesInPlace(K(base), V(base), flags);
  char* poison = static_cast<char*>(base) + poison_offset;
  poison[0] = any ? 1 : 0;
  std::memcpy(poison + 1, flags.data(), flags.size());
}

Tensor ByteBuffer(size_t bytes) {
  return Tensor(DType::kBool, {static_cast<int64_t>(std::max<size_t>(bytes, 1))});
}

kernels::FlashParams RingSetup::StepParams(const SliceLayout& layout, void* slice,
                                           int source) const {
  kernels::FlashParams p = params;
  p.q_pos = q_pos.data();
  p.k = layout.K(slice);
  p.v = layout.V(slice);
  p.kv_segments = layout.Segments(slice);
  p.kv_pos = kv_pos[static_cast<size_t>(source)].data();
  if (plan != nullptr) {
    // The backward's dK/dV pass walks columns, its dQ pass rows.
    p.row_map = PlanAccess::Map(*plan, source, /*by_column=*/false);
    if (backward) p.column_map = PlanAccess::Map(*plan, source, /*by_column=*/true);
  }
  return p;
}

kernels::PairRule RingSetup::Rule(const SliceLayout& layout, void* slice, int source) const {
  kernels::PairRule rule;
  rule.mask = params.mask;
  rule.q_pos = q_pos.data();
  rule.kv_pos = kv_pos[static_cast<size_t>(source)].data();
  rule.q_segments = params.q_segments;
  rule.kv_segments = layout.Segments(slice);
  return rule;
}

RingSetup PrepareRing(Communicator& comm, const AttentionInputs& local, const RingOptions& options,
                      bool backward) {
  RingSetup s;
  s.rank = comm.rank();
  s.num_ranks = comm.size();
  Check(local.q_positions.empty() && local.kv_positions.empty(),
        "ring: q_positions and kv_positions must be empty (the ring derives global positions "
        "from the layout), got ",
        local.q_positions.size(), " and ", local.kv_positions.size());
  const AttentionOptions& opt = options.attention;
  s.dims = kernels::ValidateInputsAndOptions(local, opt, /*dense_positions=*/false);
  const float scale = opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(s.dims.d));
  // Before anything derived from this rank's own view of the global problem.
  CheckRanksAgree(comm, local, options, s.dims, scale, backward);
  const int n = s.num_ranks;
  s.sq_global = s.dims.sq * n;
  s.skv_global = s.dims.skv * n;
  s.q_pos = LayoutPositions(options.layout, s.sq_global, s.rank, n,
                            "global q sequence length (local Sq x ranks)");
  s.kv_pos.resize(static_cast<size_t>(n));
  for (int src = 0; src < n; ++src) {
    s.kv_pos[static_cast<size_t>(src)] = LayoutPositions(
        options.layout, s.skv_global, src, n, "global kv sequence length (local Skv x ranks)");
  }
  if (opt.mask.has_dense()) {
    // A global Dense leaf must cover the global sequence (the same check, and
    // Error, on every rank); DenseRows leaves hold each rank's own rows, so
    // only this rank's positions can be checked against them.
    const bool rows = opt.mask.has_dense_rows();
    Check((rows || s.sq_global <= opt.mask.dense_sq()) && s.skv_global <= opt.mask.dense_skv(),
          "mask: expected a dense mask covering the global sequence [", s.sq_global, ", ",
          s.skv_global, "] (local lengths x ", n, " ranks), got a dense extent of [",
          opt.mask.dense_sq(), ", ", opt.mask.dense_skv(), "]");
    const std::optional<int64_t> missing = opt.mask.FirstUncoveredQuery(s.q_pos);
    Check(!missing,
          "mask: expected a dense mask holding a row for each of this rank's query "
          "positions (rank ",
          s.rank, " of ", n, ", layout ", LayoutName(options.layout),
          "), got one with no row for global position ", missing.value_or(0),
          " (Mask::DenseRows(values, heads, LayoutPositions(layout, Sq, rank, N), Skv))");
  }
  kernels::FlashParams& p = s.params;
  p.q = local.q;
  p.q_segments = local.q_segments;
  p.mask = &opt.mask;
  p.scale = scale;
  p.softcap = opt.softcap ? *opt.softcap : 0.0f;
  p.blocks = opt.block_sizes;
  p.path = ResolveKernelPath(opt.kernel_path);
  if (local.sinks.defined()) {
    s.sinks.resize(static_cast<size_t>(s.dims.h));
    for (int64_t h = 0; h < s.dims.h; ++h) {
      s.sinks[static_cast<size_t>(h)] = LoadAsF32(local.sinks, h * local.sinks.stride[0]);
    }
  }
  // Default: the cores this rank may use (comm.h), not cores / ring size.
  s.num_threads = opt.num_threads > 0 ? opt.num_threads : comm.DefaultThreads();
  s.backward = backward;
  if (options.plan != nullptr) {
    PlanAccess::CheckFits(*options.plan, s, options);
    s.plan = options.plan;
  }
  s.fault = options.fault ? options.fault : FaultSpec::FromEnv();
  // A fault the ring never reaches would be skipped silently, and whoever is
  // testing failure handling would believe it was injected.
  if (s.fault) s.fault->CheckFits(n, options.fault ? "options.fault" : "RINGSPLASH_FAULT");
  return s;
}

}  // namespace ringsplash::ring_internal

// Public single-device entry points (include/ringsplash/attention.h): validate,
// run the block-sparse flash kernels into f32 buffers, add sinks, convert into
// the caller's views.
//
// Data flow of the forward:
//   FlashForward -> out32 [B, Sq, H, Dv], lse32 [B, H, Sq] (partial, no sinks)
//   ApplySinks   -> final out32, lse32
//   CopyConvert  -> the caller's out (any strides, dtype of q or f32) and lse
// except for a bf16 out of unit row stride and nesting dims, which
// FlashForwardBf16Out writes itself, sinks applied per row (out32 is then
// made only if the call is redone: a NaN/Inf input or a bf16 overflow).
// The backward mirrors it: delta = rowsum(dout * out), f32 dq/dk/dv that
// FlashBackward writes whole, CopyConvert; dsinks from (sinks, lse, delta).
// When a caller's view is already f32 and contiguous the kernels write into
// it directly (no scratch, no copy): validation refused outputs that share
// memory with an input or another output (the backward writes dq/dk/dv
// while it reads q, k, v and dout).
// Non-finite inputs (src/kernels/poison.h): the kernels check the q, k and v
// rows they read (the backward's delta and lse show a non-finite out, dout
// or lse); only when something is found do they run again, on cleaned
// copies, after which the rows that depend on a poisoned input are
// overwritten with NaN.
#include "ringsplash/attention.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "ringsplash/error.h"
#include "src/kernels/combine.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/poison.h"
#include "src/kernels/thread_pool.h"
#include "src/kernels/tiling/pack.h"
#include "src/kernels/validate.h"

namespace ringsplash {

namespace {

using kernels::AttentionDims;
using kernels::ThreadPool;

// Thread pools are kept between calls (spawning threads per call would cost
// more than a small attention). A pool is leased exclusively for one call, so
// concurrent callers (e.g. ranks of the threads communicator calling the
// single-device API) never share one; a second concurrent caller with the same
// thread count gets a second pool, which is then kept too.
class PoolCache {
 public:
  static PoolCache& Get() {
    static PoolCache cache;
    return cache;
  }

  std::unique_ptr<ThreadPool> Acquire(int num_threads) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& idle = idle_[num_threads];
      if (!idle.empty()) {
        std::unique_ptr<ThreadPool> pool = std::move(idle.back());
        idle.pop_back();
        return pool;
      }
    }
    return std::make_unique<ThreadPool>(num_threads);
  }

  void Release(int num_threads, std::unique_ptr<ThreadPool> pool) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_[num_threads].push_back(std::move(pool));
  }

  // Destroys the idle pools (joining their threads) outside the lock, so
  // concurrent calls can lease and return pools meanwhile.
  void Clear() {
    std::map<int, std::vector<std::unique_ptr<ThreadPool>>> idle;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle.swap(idle_);
    }
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<std::unique_ptr<ThreadPool>>> idle_;
};

class PoolLease {
 public:
  explicit PoolLease(int num_threads)
      : num_threads_(num_threads), pool_(PoolCache::Get().Acquire(num_threads)) {}
  ~PoolLease() { PoolCache::Get().Release(num_threads_, std::move(pool_)); }
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;
  ThreadPool& pool() { return *pool_; }

 private:
  int num_threads_;
  std::unique_ptr<ThreadPool> pool_;
};

std::vector<int64_t> PositionsOrIota(const std::vector<int64_t>& given, int64_t n) {
  if (!given.empty()) return given;
  std::vector<int64_t> pos(static_cast<size_t>(n));
  std::iota(pos.begin(), pos.end(), int64_t{0});
  return pos;
}

// Everything the kernels need besides the output buffers. Owns the position
// vectors FlashParams points into.
struct Prepared {
  AttentionDims dims;
  std::vector<int64_t> q_pos, kv_pos;
  kernels::FlashParams params;
  std::vector<float> sinks;  // [H] contiguous copy, empty without sinks
};

void Prepare(const AttentionInputs& in, const AttentionOptions& opt, const AttentionDims& dims,
             Prepared& pr) {
  pr.dims = dims;
  pr.q_pos = PositionsOrIota(in.q_positions, dims.sq);
  pr.kv_pos = PositionsOrIota(in.kv_positions, dims.skv);
  kernels::FlashParams& p = pr.params;
  p.q = in.q;
  p.k = in.k;
  p.v = in.v;
  p.q_segments = in.q_segments;
  p.kv_segments = in.kv_segments;
  p.q_pos = pr.q_pos.data();
  p.kv_pos = pr.kv_pos.data();
  p.mask = &opt.mask;
  p.scale = opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(dims.d));
  p.softcap = opt.softcap ? *opt.softcap : 0.0f;
  p.blocks = opt.block_sizes;
  p.path = ResolveKernelPath(opt.kernel_path);
  if (in.sinks.defined()) {
    pr.sinks.resize(static_cast<size_t>(dims.h));
    for (int64_t h = 0; h < dims.h; ++h) pr.sinks[h] = LoadAsF32(in.sinks, h * in.sinks.stride[0]);
  }
}

bool IsF32Contiguous(const TensorView& t) { return t.dtype == DType::kF32 && t.is_contiguous(); }

// An f32 contiguous buffer of `shape` for a result that ends up in `user`
// (the argument `what`): the user's own memory when it is already f32
// contiguous, else scratch that Finish() converts into it — throwing Error if
// a finite result does not fit in the user's f16/bf16. Its contents start
// undefined: the kernels write every element.
class F32Buffer {
 public:
  F32Buffer(const TensorView& user, std::vector<int64_t> shape, const char* what)
      : user_(user), shape_(std::move(shape)), what_(what) {
    if (IsF32Contiguous(user)) {
      ptr_ = static_cast<float*>(user.data);
    } else {
      int64_t n = 1;
      for (int64_t d : shape_) n *= d;
      scratch_.Resize(static_cast<size_t>(n), /*zero=*/false);
      ptr_ = scratch_.data();
    }
  }
  float* get() const { return ptr_; }
  void Finish() const {
    if (scratch_.size() != 0) {
      CopyConvert(TensorView::Contiguous(ptr_, DType::kF32, shape_), user_, what_);
    }
  }

 private:
  TensorView user_;
  std::vector<int64_t> shape_;
  const char* what_;
  kernels::AlignedBuffer<float> scratch_;
  float* ptr_ = nullptr;
};

kernels::RowShape RowShapeOf(const AttentionDims& d) { return {d.b, d.sq, d.h, d.dv}; }

kernels::PairRule RuleOf(const AttentionInputs& in, const AttentionOptions& opt,
                         const Prepared& pr) {
  kernels::PairRule rule;
  rule.mask = &opt.mask;
  rule.q_pos = pr.q_pos.data();
  rule.kv_pos = pr.kv_pos.data();
  rule.q_segments = in.q_segments;
  rule.kv_segments = in.kv_segments;
  return rule;
}

}  // namespace

void ReleaseCachedThreads() {
  PoolCache::Get().Clear();
  kernels::ReleaseCachedBuffers();
}

void AttentionForward(const AttentionInputs& in, const AttentionOptions& opt, TensorView out,
                      TensorView lse, KernelStats* stats) {
  const AttentionDims dims = kernels::ValidateInputsAndOptions(in, opt);
  kernels::ValidateForwardOutputs(dims, in, out, lse);
  Prepared pr;
  Prepare(in, opt, dims, pr);
  PoolLease lease(opt.num_threads);
  const std::vector<int64_t> out_shape = {dims.b, dims.sq, dims.h, dims.dv};
  // A bf16 out (rows of unit stride, elements certainly distinct) is written
  // by the kernel directly, sinks applied to each finished row: no f32 copy
  // of out (twice its bytes). The f32 scratch then exists only if the call
  // has to be redone.
  const bool direct_bf16 = out.dtype == DType::kBF16 && out.numel() > 0 &&
                           (out.shape[3] == 1 || out.stride[3] == 1) && kernels::StridesNest(out);
  std::optional<F32Buffer> out32;
  if (!direct_bf16) out32.emplace(out, out_shape, "out");
  F32Buffer lse32(lse, {dims.b, dims.h, dims.sq}, "lse");
  KernelStats local;

  // Non-finite inputs (poison.h; sinks are validated: finite or -inf).
  // Optimistically, the kernel checks the rows it reads as it computes
  // (FlashParams::non_finite) — no separate pass over the inputs. Only if it
  // met a NaN/Inf is the call redone the exact way: scan, compute on cleaned
  // copies, poison the dependent rows — in f32 scratch, also when a direct
  // bf16 result overflowed (for CopyConvert's error message).
  std::atomic<bool> met_non_finite{false};
  pr.params.non_finite = &met_non_finite;
  bool redo = false;
  if (direct_bf16) {
    const kernels::Bf16Out direct{.data = static_cast<uint16_t*>(out.data),
                                  .stride = {out.stride[0], out.stride[1], out.stride[2]},
                                  .sinks = pr.sinks.empty() ? nullptr : pr.sinks.data()};
    redo = !kernels::FlashForwardBf16Out(pr.params, lease.pool(), direct, lse32.get(), &local);
  } else {
    kernels::FlashForward(pr.params, lease.pool(), out32->get(), lse32.get(), &local);
  }
  pr.params.non_finite = nullptr;
  std::optional<kernels::ForwardPoison> poison;
  std::optional<kernels::KeyValueScan> kv;
  if (met_non_finite.load()) {
    poison.emplace(dims, in.q, &lease.pool());
    kv.emplace(in.k, in.v, &lease.pool());
    pr.params.q = poison->q();
    pr.params.k = kv->k();
    pr.params.v = kv->v();
    poison->AddKeys(RuleOf(in, opt, pr), kv->flags());
    redo = true;
  }
  if (redo) {
    if (!out32) out32.emplace(out, out_shape, "out");
    local = KernelStats();
    kernels::FlashForward(pr.params, lease.pool(), out32->get(), lse32.get(), &local);
  }
  // (Only on the f32 path: a direct bf16 out has its sinks already.)
  if (!pr.sinks.empty() && out32) {
    kernels::ApplySinks(RowShapeOf(dims), out32->get(), lse32.get(), pr.sinks.data());
  }
  if (poison) poison->Fill(out32->get(), lse32.get());
  if (out32) out32->Finish();
  lse32.Finish();
  if (stats != nullptr) *stats = local;
}

namespace {

// lse as the kernels read it, contiguous f32 [B, H, Sq]: the caller's own
// when it is, else converted into `copy`.
float* LseF32(const TensorView& lse, const AttentionDims& dims, Tensor& copy) {
  if (IsF32Contiguous(lse)) return static_cast<float*>(lse.data);
  copy = Tensor(DType::kF32, {dims.b, dims.h, dims.sq});
  CopyConvert(lse, copy.view());
  return copy.data_as<float>();
}

// Whether delta and lse are free of what a non-finite out, dout or lse
// leaves: a NaN or infinity anywhere in a row of out or dout makes its
// delta one (products and sums keep them), and lse is NaN or +inf only
// when poisoned (-inf is an empty row).
bool DeltaAndLseFinite(const std::vector<float>& delta, const float* lse32) {
  for (size_t r = 0; r < delta.size(); ++r) {
    if (!std::isfinite(delta[r]) || std::isnan(lse32[r]) ||
        lse32[r] == std::numeric_limits<float>::infinity()) {
      return false;
    }
  }
  return true;
}

}  // namespace

void AttentionBackward(const AttentionInputs& in, const AttentionOptions& opt, TensorView out,
                       TensorView lse, TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                       TensorView dsinks, KernelStats* stats) {
  const AttentionDims dims = kernels::ValidateInputsAndOptions(in, opt);
  kernels::ValidateBackwardArgs(dims, in, out, lse, dout, dq, dk, dv, dsinks);
  Prepared pr;
  Prepare(in, opt, dims, pr);
  PoolLease lease(opt.num_threads);  // the input scans use it too
  const auto rows = static_cast<size_t>(dims.b * dims.h * dims.sq);
  std::vector<float> delta(rows);
  Tensor lse_copy;
  // Written whole by the kernel (GradientSums: nothing added): no zeroing.
  F32Buffer dq32(dq, {dims.b, dims.sq, dims.h, dims.d}, "dq");
  F32Buffer dk32(dk, {dims.b, dims.skv, dims.hkv, dims.d}, "dk");
  F32Buffer dv32(dv, {dims.b, dims.skv, dims.hkv, dims.dv}, "dv");
  const kernels::GradientSums written{.add_dq = false, .add_dkv = false};
  KernelStats local;
  // Writes the results; `poison` (null when nothing is poisoned) overwrites
  // the rows that depend on a non-finite input.
  auto finish = [&](const float* lse32, const kernels::BackwardPoison* poison,
                    const kernels::PairRule& rule) {
    if (poison != nullptr) {
      poison->FillKeys(rule, dk32.get(), dv32.get());
      poison->FillQueries(dq32.get());
    }
    dq32.Finish();
    dk32.Finish();
    dv32.Finish();
    if (!pr.sinks.empty()) {
      std::vector<float> ds(static_cast<size_t>(dims.h), 0.0f);
      kernels::AccumulateDSinks(RowShapeOf(dims), pr.sinks.data(), lse32, delta.data(), ds.data());
      if (poison != nullptr) poison->FillDSinks(ds.data());
      for (int64_t h = 0; h < dims.h; ++h) StoreFromF32(dsinks, h * dsinks.stride[0], ds[h]);
    }
    if (stats != nullptr) *stats = local;
  };
  const kernels::PairRule rule = RuleOf(in, opt, pr);

  // delta [B, H, Sq] = rowsum(dout * out), from the caller's (possibly
  // rounded) out — the quantity the softmax backward needs for that out.
  // First the normal case (poison.h): delta and lse show any non-finite
  // out, dout or lse, and the kernel checks the q, k and v rows it reads
  // (FlashParams::non_finite) — no separate pass over five inputs (4 % of a
  // sliding-window backward). Only if something is met does the call run
  // again below, scanning and cleaning its inputs.
  {
    kernels::ComputeDelta(dout, out, delta.data());
    const float* lse32 = LseF32(lse, dims, lse_copy);
    if (DeltaAndLseFinite(delta, lse32)) {
      std::atomic<bool> met{false};
      kernels::FlashParams params = pr.params;
      params.non_finite = &met;
      kernels::FlashBackward(params, lease.pool(), dout, lse32, delta.data(), dq32.get(),
                             dk32.get(), dv32.get(), written, &local);
      if (!met.load()) {
        finish(lse32, nullptr, rule);
        return;
      }
      local = KernelStats();
    }
  }

  // Non-finite inputs (poison.h): the forward's dependencies are recomputed
  // from q, k and v (this call sees every key), the rest follows from out,
  // lse and dout.
  kernels::ForwardPoison forward_poison(dims, in.q, &lease.pool());
  const kernels::KeyValueScan kv(in.k, in.v, &lease.pool());
  forward_poison.AddKeys(rule, kv.flags());
  const kernels::BackwardPoison poison(dims, in.q, out, lse, dout, &lease.pool(), &forward_poison);
  pr.params.q = poison.q();
  pr.params.k = kv.k();
  pr.params.v = kv.v();
  dout = poison.dout();
  kernels::ComputeDelta(dout, out, delta.data());

  // The kernels read lse as contiguous f32 [B, H, Sq]; poisoned rows and
  // non-finite deltas are neutralised there (BackwardPoison::Sanitize).
  const float* lse32 = static_cast<const float*>(lse.data);
  if (!IsF32Contiguous(lse) || poison.any()) {
    lse_copy = Tensor(DType::kF32, {dims.b, dims.h, dims.sq});
    CopyConvert(lse, lse_copy.view());
    poison.Sanitize(lse_copy.data_as<float>(), delta.data());
    lse32 = lse_copy.data_as<float>();
  }
  kernels::FlashBackward(pr.params, lease.pool(), dout, lse32, delta.data(), dq32.get(), dk32.get(),
                         dv32.get(), written, &local);
  finish(lse32, &poison, rule);
}

}  // namespace ringsplash

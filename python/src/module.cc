// ringsplash._core: the one extension module of the Python package.
//
//   Mask                    ringsplash::Mask (built by ringsplash.masks)
//   forward / backward      the single-device entry points on NumPy arrays,
//                           outputs allocated by the caller (ringsplash/_numpy_api.py)
//   ffi_targets()           XLA FFI handlers as capsules (ringsplash/jax/_ffi.py)
//   kernel paths, thread release, version
// Every kernel call releases the GIL. ringsplash::Error becomes the Python
// exception type registered with set_error_type (ringsplash.InvalidArgumentError,
// a ValueError), carrying the C++ message unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "python/src/ffi_handlers.h"
#include "python/src/mask_registry.h"
#include "python/src/views.h"
#include "ringsplash/ringsplash.h"

namespace nb = nanobind;

namespace ringsplash::python {
namespace {

PyObject* error_type = PyExc_ValueError;  // replaced by set_error_type at import

nb::dict StatsDict(const KernelStats& s) {
  nb::dict d;
  d["computed_blocks"] = s.computed_blocks;
  d["full_blocks"] = s.full_blocks;
  d["partial_blocks"] = s.partial_blocks;
  d["skipped_blocks"] = s.skipped_blocks;
  d["flops"] = s.flops;
  return d;
}

// What every entry point shares: inputs and options from the keyword arguments.
struct Call {
  AttentionInputs in;
  AttentionOptions opt;
};

Call MakeCall(const InArray& q, const InArray& k, const InArray& v, const Mask& mask,
              std::optional<float> scale, std::optional<float> softcap,
              const std::optional<InArray>& sinks, const std::optional<InArray>& q_segments,
              const std::optional<InArray>& kv_segments,
              const std::optional<Positions>& q_positions,
              const std::optional<Positions>& kv_positions, int64_t block_q, int64_t block_kv,
              int num_threads) {
  Call c;
  c.in.q = ViewOf(q, "q");
  c.in.k = ViewOf(k, "k");
  c.in.v = ViewOf(v, "v");
  c.in.sinks = ViewOf(sinks, "sinks");
  c.in.q_segments = ViewOf(q_segments, "q_segment_ids");
  c.in.kv_segments = ViewOf(kv_segments, "kv_segment_ids");
  c.in.q_positions = PositionsOf(q_positions);
  c.in.kv_positions = PositionsOf(kv_positions);
  c.opt.mask = mask;
  c.opt.scale = scale;
  c.opt.softcap = softcap;
  c.opt.block_sizes = BlockSizes{block_q, block_kv};
  c.opt.num_threads = num_threads;
  return c;
}

nb::dict Forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
                 const OutArray& lse, const Mask& mask, std::optional<float> scale,
                 std::optional<float> softcap, const std::optional<InArray>& sinks,
                 const std::optional<InArray>& q_segments,
                 const std::optional<InArray>& kv_segments,
                 const std::optional<Positions>& q_positions,
                 const std::optional<Positions>& kv_positions, int64_t block_q, int64_t block_kv,
                 int num_threads) {
  Call c = MakeCall(q, k, v, mask, scale, softcap, sinks, q_segments, kv_segments, q_positions,
                    kv_positions, block_q, block_kv, num_threads);
  const TensorView out_view = ViewOf(out, "out");
  const TensorView lse_view = ViewOf(lse, "lse");
  KernelStats stats;
  {
    nb::gil_scoped_release release;
    AttentionForward(c.in, c.opt, out_view, lse_view, &stats);
  }
  return StatsDict(stats);
}

nb::dict Backward(const InArray& q, const InArray& k, const InArray& v, const InArray& out,
                  const InArray& lse, const InArray& dout, const OutArray& dq, const OutArray& dk,
                  const OutArray& dv, const std::optional<OutArray>& dsinks, const Mask& mask,
                  std::optional<float> scale, std::optional<float> softcap,
                  const std::optional<InArray>& sinks, const std::optional<InArray>& q_segments,
                  const std::optional<InArray>& kv_segments,
                  const std::optional<Positions>& q_positions,
                  const std::optional<Positions>& kv_positions, int64_t block_q, int64_t block_kv,
                  int num_threads) {
  Call c = MakeCall(q, k, v, mask, scale, softcap, sinks, q_segments, kv_segments, q_positions,
                    kv_positions, block_q, block_kv, num_threads);
  const TensorView out_view = ViewOf(out, "out");
  const TensorView lse_view = ViewOf(lse, "lse");
  const TensorView dout_view = ViewOf(dout, "dout");
  const TensorView dq_view = ViewOf(dq, "dq");
  const TensorView dk_view = ViewOf(dk, "dk");
  const TensorView dv_view = ViewOf(dv, "dv");
  const TensorView dsinks_view = dsinks ? ViewOf(*dsinks, "dsinks") : TensorView{};
  KernelStats stats;
  {
    nb::gil_scoped_release release;
    AttentionBackward(c.in, c.opt, out_view, lse_view, dout_view, dq_view, dk_view, dv_view,
                      dsinks_view, &stats);
  }
  return StatsDict(stats);
}

// A boolean matrix, C-contiguous uint8 [Sq, Skv] or [H, Sq, Skv] (the Python
// layer converts NumPy bool arrays).
Mask DenseMask(const nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>& values) {
  Check(values.ndim() == 2 || values.ndim() == 3,
        "NumpyMask: expected a [q_seq, kv_seq] or [heads, q_seq, kv_seq] array, got ",
        values.ndim(), " dims");
  const bool per_head = values.ndim() == 3;
  const auto heads = per_head ? static_cast<int64_t>(values.shape(0)) : 0;
  const auto sq = static_cast<int64_t>(values.shape(per_head ? 1 : 0));
  const auto skv = static_cast<int64_t>(values.shape(per_head ? 2 : 1));
  std::vector<uint8_t> bytes(values.data(), values.data() + values.size());
  return Mask::Dense(std::move(bytes), heads, sq, skv);
}

void BindMask(nb::module_& m) {
  nb::class_<Mask>(m, "Mask", "A ringsplash::Mask (use the classes of ringsplash.masks).")
      .def_static("full", &Mask::Full)
      .def_static("causal", &Mask::Causal, nb::arg("offset"))
      .def_static("local", &Mask::Local, nb::arg("left").none(), nb::arg("right").none(),
                  nb::arg("offset"))
      .def_static("chunked_causal", &Mask::ChunkedCausal, nb::arg("chunk"))
      .def_static("dense", &DenseMask, nb::arg("values"))
      .def_static("per_head", &Mask::PerHead, nb::arg("masks"))
      .def_static(
          "parse", [](const std::string& text) { return Mask::Parse(text); }, nb::arg("text"))
      .def("__and__", [](const Mask& a, const Mask& b) { return a & b; })
      .def("__or__", [](const Mask& a, const Mask& b) { return a | b; })
      .def("allowed", &Mask::Allowed, nb::arg("head"), nb::arg("q_pos"), nb::arg("kv_pos"))
      .def_prop_ro("num_heads", &Mask::num_heads)
      .def("__str__", &Mask::ToString)
      .def(
          "registry_id", [](const Mask& mask) { return RegisterMask(mask); },
          "The id FFI calls name this mask by (registers it on first use).");
}

}  // namespace
}  // namespace ringsplash::python

NB_MODULE(_core, m) {
  using namespace ringsplash;
  using namespace ringsplash::python;
  m.doc() = "ringsplash C++ core: block-sparse flash attention kernels.";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_type, e.what());
    }
  });
  m.def(
      "set_error_type",
      [](nb::handle type) {
        type.inc_ref();  // kept for the life of the process, like the module
        error_type = type.ptr();
      },
      "The Python exception type ringsplash::Error is raised as.");
  BindMask(m);
  m.def("forward", &Forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("mask"), nb::arg("scale").none(), nb::arg("softcap").none(),
        nb::arg("sinks").none(), nb::arg("q_segments").none(), nb::arg("kv_segments").none(),
        nb::arg("q_positions").none(), nb::arg("kv_positions").none(), nb::arg("block_q"),
        nb::arg("block_kv"), nb::arg("num_threads"),
        "AttentionForward into the given out/lse; returns the kernel's block counters.");
  m.def("backward", &Backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("dsinks").none(), nb::arg("mask"), nb::arg("scale").none(),
        nb::arg("softcap").none(), nb::arg("sinks").none(), nb::arg("q_segments").none(),
        nb::arg("kv_segments").none(), nb::arg("q_positions").none(),
        nb::arg("kv_positions").none(), nb::arg("block_q"), nb::arg("block_kv"),
        nb::arg("num_threads"),
        "AttentionBackward into the given dq/dk/dv/dsinks; returns the block counters.");
  m.def(
      "kernel_path",
      [](const std::string& requested) {
        return std::string(KernelPathName(ResolveKernelPath(ParseKernelPath(requested))));
      },
      nb::arg("requested") = "auto", "The micro-kernel path a call would run on this CPU.");
  m.def("supported_kernel_paths", [] {
    std::vector<std::string> names;
    for (KernelPath p : SupportedKernelPaths()) names.emplace_back(KernelPathName(p));
    return names;
  });
  m.def("release_cached_threads", &ReleaseCachedThreads,
        "Ends the worker threads single-device calls keep between calls and frees the large "
        "buffers calls keep for the next call of the same shapes.");
  m.def("ffi_targets", &FfiTargets,
        "XLA FFI handlers by target name, as capsules for jax.ffi.register_ffi_target "
        "(empty when the module was built without JAX's FFI headers).");
  m.attr("max_head_dim") = kMaxHeadDim;
  m.attr("max_threads") = kMaxThreads;
}

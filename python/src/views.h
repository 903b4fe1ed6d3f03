// NumPy arrays (through nanobind) as ringsplash tensor views, without copies.
//
// dtypes: float32 -> f32, float16 -> f16, uint16 -> bf16 (the Python layer
// passes ml_dtypes.bfloat16 arrays as their uint16 view: DLPack, which
// nanobind reads, has no name NumPy's bfloat16 extension maps to), DLPack
// bfloat16 (PyTorch tensors, which nanobind takes directly) -> bf16, int32 ->
// i32. Strides come over as they are (any, including 0 and negative), in
// elements; a view of more than 4 dims is an Error.
#ifndef RINGSPLASH_PYTHON_SRC_VIEWS_H_
#define RINGSPLASH_PYTHON_SRC_VIEWS_H_

#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ringsplash/tensor.h"

namespace ringsplash::python {

namespace nb = nanobind;

// An input array (read only) and an output array (written).
using InArray = nb::ndarray<nb::ro, nb::device::cpu>;
using OutArray = nb::ndarray<nb::device::cpu>;
// Global token positions, int64 [S].
using Positions = nb::ndarray<const int64_t, nb::ndim<1>, nb::device::cpu>;

TensorView ViewOf(const InArray& a, const char* what);
TensorView ViewOf(const OutArray& a, const char* what);
// An empty view for an absent optional array.
TensorView ViewOf(const std::optional<InArray>& a, const char* what);
std::vector<int64_t> PositionsOf(const std::optional<Positions>& p);

}  // namespace ringsplash::python

#endif  // RINGSPLASH_PYTHON_SRC_VIEWS_H_

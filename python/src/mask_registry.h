// Masks the XLA FFI handlers can name by an integer.
//
// An FFI call carries attributes (numbers, strings), not C++ objects, so a
// mask object of the Python package registers its ringsplash::Mask here once
// and passes the returned id as the `mask_id` attribute of every call. Ids
// are never reused and entries are never freed: a compiled JAX function may
// be called long after the Python mask object that built it is gone. The
// same mask (the same node tree) registered twice gets the same id, so a
// mask object re-used across many kernels costs one entry.
#ifndef RINGSPLASH_PYTHON_SRC_MASK_REGISTRY_H_
#define RINGSPLASH_PYTHON_SRC_MASK_REGISTRY_H_

#include <cstdint>

#include "ringsplash/mask.h"

namespace ringsplash::python {

// Thread-safe. Returns an id >= 0.
int64_t RegisterMask(const Mask& mask);
// The mask registered under `id`; throws ringsplash::Error for an unknown id.
Mask LookupMask(int64_t id);

}  // namespace ringsplash::python

#endif  // RINGSPLASH_PYTHON_SRC_MASK_REGISTRY_H_

#include "python/src/mask_registry.h"

#include <map>
#include <mutex>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash::python {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<Mask> masks;
  std::map<const void*, int64_t> ids;  // node address -> id (the node is kept alive by masks)
};

Registry& Get() {
  static Registry* registry = new Registry();  // never destroyed: FFI calls may outlive exit order
  return *registry;
}

}  // namespace

int64_t RegisterMask(const Mask& mask) {
  Registry& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  const void* key = &mask.node();
  auto it = r.ids.find(key);
  if (it != r.ids.end()) return it->second;
  const auto id = static_cast<int64_t>(r.masks.size());
  r.masks.push_back(mask);
  r.ids.emplace(key, id);
  return id;
}

Mask LookupMask(int64_t id) {
  Registry& r = Get();
  std::lock_guard<std::mutex> lock(r.mu);
  Check(id >= 0 && id < static_cast<int64_t>(r.masks.size()), "mask_id: no mask registered as ", id,
        " (", r.masks.size(), " masks are registered)");
  return r.masks[static_cast<size_t>(id)];
}

}  // namespace ringsplash::python

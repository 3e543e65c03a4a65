#include "collectives/backend.h"

#include <map>
#include <mutex>

#include "collectives/shm_backend.h"
#include "common/error.h"

namespace ctorchrun::dist {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, BackendFactory> factories;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

const char* to_string(OpType type) {
  switch (type) {
    case OpType::kAllReduce:
      return "all_reduce";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kReduce:
      return "reduce";
    case OpType::kAllGather:
      return "all_gather";
    case OpType::kGather:
      return "gather";
    case OpType::kScatter:
      return "scatter";
    case OpType::kReduceScatter:
      return "reduce_scatter";
    case OpType::kAllToAll:
      return "all_to_all";
    case OpType::kBarrier:
      return "barrier";
    case OpType::kSend:
      return "send";
    case OpType::kRecv:
      return "recv";
  }
  return "unknown";
}

void register_backend(const std::string& name, BackendFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(factory);
}

std::unique_ptr<Backend> create_backend(const std::string& name, const BackendContext& context) {
  if (name == "gloo") return create_host_backend(context);
  BackendFactory factory;
  std::string known = "gloo";
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(name);
    if (it != r.factories.end()) factory = it->second;
    for (const auto& [key, unused] : r.factories) known += ", " + key;
  }
  if (!factory) {
    throw ConfigError("unknown process group backend '" + name + "' (known: " + known +
                      "); 'nccl' needs ctorchrun::dist_nccl linked and CUDA");
  }
  return factory(context);
}

}  // namespace ctorchrun::dist

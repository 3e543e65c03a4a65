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

std::chrono::steady_clock::time_point deadline_of(const Op& op) {
  return op.deadline != std::chrono::steady_clock::time_point{}
             ? op.deadline
             : std::chrono::steady_clock::now() + op.timeout;
}

std::string describe(const Op& op, const std::string& transport, int rank, int size) {
  std::string text = std::string(to_string(op.type));
  const Buffer& b = op.type == OpType::kSend || op.type == OpType::kAllGather ||
                            op.type == OpType::kGather || op.type == OpType::kAllToAll ||
                            op.type == OpType::kScatter || op.type == OpType::kReduceScatter
                        ? op.input
                        : op.output;
  if (op.type != OpType::kBarrier) {
    text += " of " + std::to_string(b.count) + " " + to_string(b.dtype);
  }
  text += " on " + transport + " rank " + std::to_string(rank) + "/" + std::to_string(size);
  if (op.type == OpType::kSend) text += " to rank " + std::to_string(op.peer);
  if (op.type == OpType::kRecv) text += " from rank " + std::to_string(op.peer);
  return text;
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

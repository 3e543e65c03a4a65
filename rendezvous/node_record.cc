#include "rendezvous/node_record.h"

#include <cstdint>

#include "common/error.h"

namespace ctorchrun::rendezvous {

nlohmann::json node_record(const NodeInfo& node) {
  return nlohmann::json{{"host", node.host},
                        {"pid", node.pid},
                        {"local_world_size", node.local_world_size},
                        {"hosts_endpoint", node.hosts_endpoint}};
}

NodeInfo parse_node_record(const nlohmann::json& j, const std::string& key) {
  auto bad = [&](const std::string& why) {
    return ProtocolError("unreadable node record at key '" + key + "': " + why);
  };
  if (!j.is_object()) throw bad("not an object");
  auto integer = [&](const char* name, int64_t lo, int64_t hi) {
    auto it = j.find(name);
    if (it == j.end() || !it->is_number_integer()) {
      throw bad(std::string("'") + name + "' is not an integer");
    }
    const auto v = it->get<int64_t>();
    if (v < lo || v > hi) {
      throw bad(std::string("'") + name + "' is " + std::to_string(v) + ", outside " +
                std::to_string(lo) + ".." + std::to_string(hi));
    }
    return static_cast<int>(v);
  };
  NodeInfo n;
  n.local_world_size = integer("local_world_size", 1, int64_t{1} << 20);
  n.pid = integer("pid", 0, INT32_MAX);
  auto host = j.find("host");
  if (host == j.end() || !host->is_string() || host->get<std::string>().size() > 255) {
    throw bad("'host' is not a name of at most 255 bytes");
  }
  n.host = host->get<std::string>();
  auto he = j.find("hosts_endpoint");
  if (he != j.end() && !he->is_boolean()) throw bad("'hosts_endpoint' is not a boolean");
  n.hosts_endpoint = he != j.end() && he->get<bool>();
  return n;
}

}  // namespace ctorchrun::rendezvous

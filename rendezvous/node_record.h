#pragma once

// The record a node announces itself with, the one JSON shape of every
// backend (agent/protocol.h): the static rendezvous' nodes/<n> and the c10d
// rendezvous' node/<slot> and roster members, which add their own fields
// ("attempt", "slot") beside these:
//   {"host": str (at most 255 bytes), "pid": int >= 0,
//    "local_world_size": int 1..2^20, "hosts_endpoint": bool}
// Internal to rendezvous/.

#include <nlohmann/json.hpp>
#include <string>

#include "rendezvous/handler.h"

namespace ctorchrun::rendezvous {

nlohmann::json node_record(const NodeInfo& node);

// Reads a record written by a peer; every field is checked. Throws
// ProtocolError naming `key` (where it was read) for anything else. The
// group rank is the caller's to set.
NodeInfo parse_node_record(const nlohmann::json& record, const std::string& key);

}  // namespace ctorchrun::rendezvous

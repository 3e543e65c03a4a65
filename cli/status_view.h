#pragma once

// ctorch-status: one agent's GET /status (agent/job_status.h) fetched and
// drawn as a table for a terminal. Parsing is total: a field missing or of
// another type shows as "?", never an exception.

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

namespace ctorchrun::cli {

// "HOST:PORT", "[V6]:PORT"; false (with `*error`) for anything else.
bool parse_agent_address(const std::string& text, std::string* host, int* port, std::string* error);

struct StatusReply {
  bool ok = false;    // a 200 with a JSON object
  std::string error;  // why not, for people (what came back, cut and cleaned)
  nlohmann::json status;
};

// GET http://host:port/status, the whole exchange bounded by `timeout`.
StatusReply fetch_status(const std::string& host, int port, std::chrono::milliseconds timeout);

// The job table: the job's line, restarts, nodes, this node's ranks, the
// last failures. Lines end in '\n'.
std::string render_status(const nlohmann::json& status);

}  // namespace ctorchrun::cli

#pragma once

// StaticHandler: torchrun's static rendezvous. --nnodes=N fixed, each node
// gives its --node_rank, node 0 hosts the store at master_addr:master_port and
// the others connect to it, retrying until the rendezvous timeout.

#include <chrono>
#include <memory>
#include <string>

#include "rendezvous/handler.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::store {
class TcpStoreServer;
}

namespace ctorchrun::rendezvous {

struct StaticOptions {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0 (node 0 only): a free port
  int nnodes = 1;
  int node_rank = 0;
  std::string run_id = "none";
  std::chrono::milliseconds timeout{900'000};
  int local_world_size = 1;
  int max_restarts = 0;
  std::string host;  // this node's address as announced to others
  // Limits of the store node 0 hosts (its host and port come from the fields above).
  store::ServerOptions server;
};

class StaticHandler : public Handler {
 public:
  explicit StaticHandler(StaticOptions options);
  ~StaticHandler() override;

  RendezvousInfo next_rendezvous() override;
  const std::string& run_id() const override { return options_.run_id; }

  // The agents' key namespace on the wire: keys of torch's clients never start
  // with it (theirs are "init/", "/<run_id>/", "//worker/", "/default_pg/").
  static constexpr const char* kNamespace = "ctorchrun";

 private:
  StaticOptions options_;
  std::unique_ptr<store::TcpStoreServer> server_;
};

}  // namespace ctorchrun::rendezvous

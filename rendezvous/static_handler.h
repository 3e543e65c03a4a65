#pragma once

// StaticHandler: torchrun's static rendezvous. --nnodes=N fixed, each node
// gives its --node_rank, node 0 hosts the store at master_addr:master_port and
// the others connect to it, retrying until the rendezvous timeout.
//
// Admission (the keys are listed in agent/protocol.h): node 0 publishes the
// job's settings (run id, nnodes, max_restarts) before any node can announce
// itself, and a "formed" marker once every node has. A joining node reads the
// settings first and refuses, in this order: a store that serves another run
// id (RendezvousClosedError), a job already formed (RendezvousClosedError),
// different nnodes or max_restarts (ConfigError; the node also leaves a
// refusal in the job so that the others stop too, naming both values), a node
// rank already taken (ConfigError). A node that is refused writes nothing into
// a job that has formed or belongs to another run id.
//
// Addresses: master_addr may be a name, an IPv4 or IPv6 literal, or an IPv6
// literal in brackets ("[::1]"); brackets are removed everywhere (workers get
// MASTER_ADDR without them). Node 0 binds so that it is reachable at that
// address: a loopback literal (or "localhost") itself, anything else the
// wildcard of its family. An address that does not resolve or is not one of
// this host's is an IoError at once on node 0; the other nodes retry it until
// the rendezvous timeout, logging what they wait for every wait_log_interval.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "rendezvous/handler.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::store {
class TcpStoreServer;
}

namespace ctorchrun::rendezvous {

struct StaticOptions {
  // The job (job.min_nodes == job.max_nodes: --nnodes), this node, and the
  // limits of the store node 0 hosts at master_addr:master_port.
  JobSettings job;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0 (node 0 only): a free port
  int node_rank = 0;
  std::chrono::milliseconds timeout{900'000};
  std::chrono::milliseconds wait_log_interval{30'000};  // "still waiting" lines
};

class StaticHandler : public Handler {
 public:
  explicit StaticHandler(StaticOptions options);
  ~StaticHandler() override;

  RendezvousInfo next_rendezvous() override;
  const std::string& run_id() const override { return options_.job.run_id; }
  // Node 0's store, the agents' and the workers' ("job").
  std::vector<HostedStore> hosted_stores() override;

  // The agents' key namespace on the wire: keys of torch's clients never start
  // with it (theirs are "init/", "/<run_id>/", "//worker/", "/default_pg/").
  static constexpr const char* kNamespace = "ctorchrun";

 private:
  // Reads the job's settings and refuses a job this node must not join.
  // Returns the job's max_restarts, which this node agreed on.
  int check_admission(store::Store& root, store::Store& job, const std::string& endpoint);
  // Waits for every node's record, or ends at a refusal left by another node.
  void await_nodes(store::Store& job, const std::vector<std::string>& keys,
                   std::chrono::steady_clock::time_point deadline, const std::string& endpoint);

  StaticOptions options_;
  std::unique_ptr<store::TcpStoreServer> server_;
  std::mutex server_mutex_;  // server_'s assignment against hosted_stores()
};

}  // namespace ctorchrun::rendezvous

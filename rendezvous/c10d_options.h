#pragma once

// C10dOptions: the settings of an elastic rendezvous (--rdzv_backend=c10d or
// etcd-v3), as C10dHandler and its Coordination read them.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "etcd/client.h"
#include "rendezvous/handler.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

struct C10dOptions {
  // The job's settings and this node; job.server: the limits of the stores
  // it hosts (the endpoint's, the workers').
  JobSettings job;
  std::string endpoint_host = "127.0.0.1";  // brackets of an IPv6 literal allowed
  int endpoint_port = 29400;
  std::string advertise_addr;  // where workers reach the workers' store; empty: found
  std::optional<bool> is_host;
  std::chrono::milliseconds join_timeout{600'000};
  std::chrono::milliseconds last_call_timeout{30'000};
  std::chrono::milliseconds read_timeout{60'000};
  // Bounds closing the rendezvous at the job's end: the endpoint's host waits
  // at most this long (and at most 3 s) for waiting nodes to learn the end.
  std::chrono::milliseconds close_timeout{30'000};
  // Connect and request timeout of the agent's background connections (its
  // monitor): short, so that an unreachable endpoint shows within the
  // liveness bound.
  std::chrono::milliseconds monitor_timeout{3'000};
  // --rdzv_backend=etcd-v3: the agents' state lives in this etcd cluster
  // ("host:port" members; any that answers serves), under etcd_prefix/<id>;
  // empty: the TCP store at endpoint_host:endpoint_port.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/ctorchrun";
  // etcd: TLS with the members (every client this handler makes).
  etcd::EtcdTls etcd_tls;
  // etcd: the TTL of the lease that holds this agent's presence
  // (keep_alive_interval x keep_alive_max_attempt, at least 2 s).
  std::chrono::milliseconds presence_ttl{15'000};
  // Longest wait between two looks at the rendezvous (the store wakes the
  // waits on the keys that matter; this bounds how soon an end is seen).
  std::chrono::milliseconds poll_interval{1'000};
  // How long after a job's end a node of the same id is refused.
  // Unset: join_timeout.
  std::optional<std::chrono::milliseconds> closed_window;
  std::chrono::milliseconds wait_log_interval{30'000};
  // Tests: runs between the presence's renewal and a next round's entry
  // (C10dHandler::rejoin), where a fault (a lease revoked) can be injected.
  std::function<void()> before_entry;
};

}  // namespace ctorchrun::rendezvous

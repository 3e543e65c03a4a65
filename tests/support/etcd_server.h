#pragma once

// Test helper: a real etcd cluster (one or three members) of /usr/bin/etcd
// processes on 127.0.0.1, each with its data directory under one temporary
// directory, which the destructor removes.
//
// Ports come from a bind test (bind 127.0.0.1:0, read the port, close); if
// another process takes one before etcd binds it, the member exits, and the
// whole cluster is started again on new ports (a few attempts). Each cluster
// has its own --initial-cluster-token. Elections are fast
// (--heartbeat-interval 50 --election-timeout 500).
//
// The constructor returns once every member answers /v3/maintenance/status
// with a leader and a write goes through, or throws std::runtime_error with
// the tail of the members' logs. Members run in their own process groups
// with PR_SET_PDEATHSIG, so a test runner that dies leaves none behind; the
// destructor stops them (SIGTERM, then SIGKILL after a grace period) and
// reaps them, also when a test fails.

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace ctorchrun::testing {

class EtcdCluster {
 public:
  static constexpr const char* kEtcdBinary = "/usr/bin/etcd";
  static constexpr std::chrono::milliseconds kStopGrace{1000};

  explicit EtcdCluster(int members = 1,
                       std::chrono::milliseconds ready_timeout = std::chrono::seconds(30));
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:PORT" of member i's client URL.
  std::string client_endpoint(int i) const;
  std::vector<std::string> client_endpoints() const;
  bool alive(int i) const { return members_[i].pid > 0; }
  pid_t pid(int i) const { return members_[i].pid; }

  // The index of the member that leads now, as the members report it.
  // Throws std::runtime_error when none is known within `timeout`.
  int leader(std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
  // SIGKILLs member i and reaps it.
  void kill(int i);
  // SIGTERM, grace period, SIGKILL; reaps. Idempotent.
  void stop(int i);
  // The tail of member i's log (stdout and stderr).
  std::string log_tail(int i, std::size_t bytes = 4000) const;

 private:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
    pid_t pid = -1;
    std::string log_path;
  };

  bool start_all(std::chrono::milliseconds ready_timeout, std::string& why);
  void stop_all();

  std::string dir_;
  std::string token_;
  std::vector<Member> members_;
};

// Ports that were free a moment ago on 127.0.0.1 (bound to port 0 and closed).
std::vector<int> free_loopback_ports(int count);

}  // namespace ctorchrun::testing

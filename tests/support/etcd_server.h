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
//
// With Tls::kOn the members serve clients over https only, demanding a client
// certificate (--client-cert-auth); peers stay on http. The certificates are
// made with /usr/bin/openssl in the cluster's directory (see
// make_test_certificates); client_tls() is what a client needs to reach them.

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "etcd/client.h"
#include "tests/support/temp_dir.h"

namespace ctorchrun::testing {

// PEM files of a test PKI (all under one directory, keys unencrypted).
struct TestCertificates {
  std::string ca;           // the CA that signs the rest
  std::string server_cert;  // for 127.0.0.1 (IP SAN only), server and client auth
  std::string server_key;
  std::string client_cert;  // CN=ctorchrun-test-client, client auth
  std::string client_key;
  std::string other_ca;  // an unrelated CA, which trusts none of the above
};

// Makes a CA, a server and a client certificate (EC P-256, valid two days)
// and an unrelated CA in `dir` with /usr/bin/openssl. Throws
// std::runtime_error with openssl's output when it fails.
TestCertificates make_test_certificates(const std::string& dir);

class EtcdCluster {
 public:
  static constexpr const char* kEtcdBinary = "/usr/bin/etcd";
  static constexpr const char* kOpensslBinary = "/usr/bin/openssl";
  static constexpr std::chrono::milliseconds kStopGrace{1000};
  enum class Tls { kOff, kOn };

  // `extra_args` go to every member's command line (e.g. a small
  // "--quota-backend-bytes").
  explicit EtcdCluster(int members = 1,
                       std::chrono::milliseconds ready_timeout = std::chrono::seconds(30),
                       Tls tls = Tls::kOff, std::vector<std::string> extra_args = {});
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:PORT" of member i's client URL.
  std::string client_endpoint(int i) const;
  std::vector<std::string> client_endpoints() const;
  // "http://127.0.0.1:PORT" or "https://127.0.0.1:PORT".
  std::string client_url(int i) const;
  bool tls() const { return tls_ == Tls::kOn; }
  // The test PKI (Tls::kOn only).
  const TestCertificates& certificates() const { return certs_; }
  // What a client needs: TLS with the test CA and the client certificate
  // under Tls::kOn; plain http otherwise.
  etcd::EtcdTls client_tls() const;
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

  TempDir dir_;  // removed (with the members' data) after the destructor stopped them
  std::string token_;
  Tls tls_ = Tls::kOff;
  std::vector<std::string> extra_args_;
  TestCertificates certs_;
  std::vector<Member> members_;
};

// Ports that were free a moment ago on 127.0.0.1 (bound to port 0 and closed).
std::vector<int> free_loopback_ports(int count);

}  // namespace ctorchrun::testing

#include "tests/support/etcd_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "etcd/client.h"

namespace ctorchrun::testing {

using Clock = std::chrono::steady_clock;

std::vector<int> free_loopback_ports(int count) {
  // Hold every socket until all are bound, so the ports differ.
  std::vector<int> fds;
  std::vector<int> ports;
  for (int i = 0; i < count; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error("socket failed");
    fds.push_back(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      for (int f : fds) ::close(f);
      throw std::runtime_error(std::string("bind 127.0.0.1:0 failed: ") + std::strerror(errno));
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int f : fds) ::close(f);
  return ports;
}

namespace {

std::string url(int port, bool https = false) {
  return std::string(https ? "https" : "http") + "://127.0.0.1:" + std::to_string(port);
}

pid_t spawn(const std::vector<std::string>& argv, const std::string& log_path) {
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) throw std::runtime_error("cannot open " + log_path);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log);
    throw std::runtime_error("fork failed");
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(127);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::execv(args[0], args.data());
    _exit(127);
  }
  ::setpgid(pid, pid);
  ::close(log);
  return pid;
}

// Reaps `pid` if it has exited; true when it has.
bool reap_if_exited(pid_t pid) {
  int status = 0;
  const pid_t r = ::waitpid(pid, &status, WNOHANG);
  return r == pid || (r < 0 && errno == ECHILD);
}

std::atomic<int> g_clusters{0};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs openssl with `args` to completion (30 s at most); throws with its
// output when it fails.
void openssl(const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<std::string> argv{EtcdCluster::kOpensslBinary};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = spawn(argv, log_path);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) throw std::runtime_error("waitpid on openssl failed");
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      throw std::runtime_error("openssl did not finish within 30 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string cmd;
    for (const auto& a : argv) cmd += a + " ";
    throw std::runtime_error("'" + cmd + "' failed: " + read_file(log_path));
  }
}

}  // namespace

TestCertificates make_test_certificates(const std::string& dir) {
  if (::access(EtcdCluster::kOpensslBinary, X_OK) != 0)
    throw std::runtime_error(std::string(EtcdCluster::kOpensslBinary) +
                             " not found: install openssl (scripts/setup.sh)");
  const std::string log = dir + "/openssl.log";
  const std::vector<std::string> ec_key = {"-newkey", "ec", "-pkeyopt",
                                           "ec_paramgen_curve:prime256v1", "-nodes"};
  auto make_ca = [&](const std::string& name, const std::string& cn) {
    std::vector<std::string> a = {"req", "-x509"};
    a.insert(a.end(), ec_key.begin(), ec_key.end());
    a.insert(a.end(),
             {"-keyout", dir + "/" + name + ".key", "-out", dir + "/" + name + ".crt", "-days", "2",
              "-subj", "/CN=" + cn, "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
              "keyUsage=critical,keyCertSign,cRLSign"});
    openssl(a, log);
  };
  auto make_leaf = [&](const std::string& name, const std::string& cn, const std::string& ext) {
    std::vector<std::string> a = {"req"};
    a.insert(a.end(), ec_key.begin(), ec_key.end());
    a.insert(a.end(), {"-keyout", dir + "/" + name + ".key", "-out", dir + "/" + name + ".csr",
                       "-subj", "/CN=" + cn});
    openssl(a, log);
    const std::string ext_file = dir + "/" + name + ".ext";
    std::ofstream(ext_file) << ext;
    openssl({"x509", "-req", "-in", dir + "/" + name + ".csr", "-CA", dir + "/ca.crt", "-CAkey",
             dir + "/ca.key", "-CAcreateserial", "-out", dir + "/" + name + ".crt", "-days", "2",
             "-extfile", ext_file},
            log);
  };
  make_ca("ca", "ctorchrun-test-ca");
  make_ca("other-ca", "ctorchrun-test-other-ca");
  // etcd's gateway presents the server certificate to etcd's own gRPC
  // server, which checks it as a client certificate under --client-cert-auth.
  make_leaf("server", "127.0.0.1",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1\n");
  make_leaf("client", "ctorchrun-test-client",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=clientAuth\n");
  TestCertificates c;
  c.ca = dir + "/ca.crt";
  c.server_cert = dir + "/server.crt";
  c.server_key = dir + "/server.key";
  c.client_cert = dir + "/client.crt";
  c.client_key = dir + "/client.key";
  c.other_ca = dir + "/other-ca.crt";
  return c;
}

EtcdCluster::EtcdCluster(int members, std::chrono::milliseconds ready_timeout, Tls tls,
                         std::vector<std::string> extra_args)
    : dir_("etcd"), tls_(tls), extra_args_(std::move(extra_args)) {
  if (members < 1) throw std::invalid_argument("an etcd cluster needs a member");
  if (::access(kEtcdBinary, X_OK) != 0)
    throw std::runtime_error(std::string(kEtcdBinary) +
                             " not found: install etcd-server (scripts/setup.sh)");
  if (tls_ == Tls::kOn) certs_ = make_test_certificates(dir_.path);
  members_.resize(static_cast<std::size_t>(members));
  std::string why;
  constexpr int kAttempts = 3;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    token_ = "ctorchrun-test-" + std::to_string(::getpid()) + "-" +
             std::to_string(g_clusters.fetch_add(1)) + "-" + std::to_string(attempt);
    if (start_all(ready_timeout, why)) return;
    stop_all();
  }
  throw std::runtime_error("etcd cluster of " + std::to_string(members) + " did not start after " +
                           std::to_string(kAttempts) + " attempts: " + why);
}

EtcdCluster::~EtcdCluster() { stop_all(); }

bool EtcdCluster::start_all(std::chrono::milliseconds ready_timeout, std::string& why) {
  const int n = size();
  const auto ports = free_loopback_ports(2 * n);
  std::string initial_cluster;
  for (int i = 0; i < n; ++i) {
    auto& m = members_[i];
    m.name = "m" + std::to_string(i);
    m.client_port = ports[2 * i];
    m.peer_port = ports[2 * i + 1];
    m.log_path = dir_.file(m.name + "-" + token_ + ".log");
    initial_cluster += (i ? "," : "") + m.name + "=" + url(m.peer_port);
  }
  for (int i = 0; i < n; ++i) {
    auto& m = members_[i];
    const std::string data = dir_.file(m.name + "-" + token_ + ".etcd");
    std::vector<std::string> tls_args;
    if (tls()) {
      tls_args = {"--cert-file",       certs_.server_cert, "--key-file",        certs_.server_key,
                  "--trusted-ca-file", certs_.ca,          "--client-cert-auth"};
    }
    std::vector<std::string> argv = {kEtcdBinary,
                                     "--name",
                                     m.name,
                                     "--data-dir",
                                     data,
                                     "--listen-client-urls",
                                     url(m.client_port, tls()),
                                     "--advertise-client-urls",
                                     url(m.client_port, tls()),
                                     "--listen-peer-urls",
                                     url(m.peer_port),
                                     "--initial-advertise-peer-urls",
                                     url(m.peer_port),
                                     "--initial-cluster",
                                     initial_cluster,
                                     "--initial-cluster-state",
                                     "new",
                                     "--initial-cluster-token",
                                     token_,
                                     "--heartbeat-interval",
                                     "50",
                                     "--election-timeout",
                                     "500",
                                     "--logger",
                                     "zap",
                                     "--log-level",
                                     "warn"};
    argv.insert(argv.end(), tls_args.begin(), tls_args.end());
    argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
    m.pid = spawn(argv, m.log_path);
  }
  // Ready: every member reports a leader, and a write through each succeeds.
  const auto deadline = Clock::now() + ready_timeout;
  std::vector<bool> ready(n, false);
  int ready_count = 0;
  while (ready_count < n) {
    for (int i = 0; i < n; ++i) {
      if (ready[i]) continue;
      if (reap_if_exited(members_[i].pid)) {
        members_[i].pid = -1;
        why = "member " + members_[i].name +
              " exited during start-up (port taken?): " + log_tail(i, 1500);
        return false;
      }
      try {
        etcd::EtcdClient probe({client_endpoint(i)}, std::chrono::milliseconds(500), client_tls());
        if (probe.member_status(client_endpoint(i)).leader_id == 0) continue;
        probe.put("__ctorchrun_test_ready", "1");
        ready[i] = true;
        ++ready_count;
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    if (ready_count == n) break;
    if (Clock::now() >= deadline) {
      why = "not ready within " + std::to_string(ready_timeout.count()) + "ms (" + why +
            "); log of m0: " + log_tail(0, 1500);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

std::string EtcdCluster::client_endpoint(int i) const {
  return "127.0.0.1:" + std::to_string(members_[i].client_port);
}

std::string EtcdCluster::client_url(int i) const { return url(members_[i].client_port, tls()); }

etcd::EtcdTls EtcdCluster::client_tls() const {
  etcd::EtcdTls t;
  if (!tls()) return t;
  t.enabled = true;
  t.ca_file = certs_.ca;
  t.cert_file = certs_.client_cert;
  t.key_file = certs_.client_key;
  return t;
}

std::vector<std::string> EtcdCluster::client_endpoints() const {
  std::vector<std::string> out;
  for (int i = 0; i < size(); ++i) out.push_back(client_endpoint(i));
  return out;
}

int EtcdCluster::leader(std::chrono::milliseconds timeout) const {
  const auto deadline = Clock::now() + timeout;
  std::string why = "no member alive";
  do {
    for (int i = 0; i < size(); ++i) {
      if (!alive(i)) continue;
      try {
        etcd::EtcdClient probe({client_endpoint(i)}, std::chrono::milliseconds(500), client_tls());
        const auto st = probe.member_status(client_endpoint(i));
        if (st.leader_id == 0) continue;
        if (st.leader_id == st.member_id) return i;
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (Clock::now() < deadline);
  throw std::runtime_error("no etcd leader found within " + std::to_string(timeout.count()) +
                           "ms: " + why);
}

void EtcdCluster::kill(int i) {
  auto& m = members_[i];
  if (m.pid <= 0) return;
  ::kill(m.pid, SIGKILL);
  int status = 0;
  ::waitpid(m.pid, &status, 0);
  ::kill(-m.pid, SIGKILL);
  m.pid = -1;
}

void EtcdCluster::stop(int i) {
  auto& m = members_[i];
  if (m.pid <= 0) return;
  ::kill(m.pid, SIGTERM);
  // A leader that is told to stop first tries to hand over leadership, which
  // waits out the election timeout when its peers are dead or stopping too;
  // test data need no clean shutdown, so the grace period is short.
  const auto deadline = Clock::now() + kStopGrace;
  while (Clock::now() < deadline) {
    if (reap_if_exited(m.pid)) {
      ::kill(-m.pid, SIGKILL);
      m.pid = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(i);
}

void EtcdCluster::stop_all() {
  // SIGTERM to all first so the members stop together, then reap each.
  for (auto& m : members_)
    if (m.pid > 0) ::kill(m.pid, SIGTERM);
  for (int i = 0; i < size(); ++i) stop(i);
}

std::string EtcdCluster::log_tail(int i, std::size_t bytes) const {
  std::ifstream in(members_[i].log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string all = ss.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

}  // namespace ctorchrun::testing

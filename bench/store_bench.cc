// ctorch-store-bench: a load generator for any TCPStore-compatible server
// (ctorch-store, torch 1.13's or torch 2.x's own TCPStore server).
//
//   ctorch-store-bench --host H --port P --clients K --seconds S --op set|get|add|mixed
//                      [--dialect auto|v113|v2] [--value-bytes B] [--pipeline D]
//   ctorch-store-bench --host H --port P --storm N [--dialect ...]
//
// Load: K connections in one epoll loop, each with one request in flight
// (closed loop, as a torch client behaves), or --pipeline D of them, so the
// generator costs one core at most and the server gets the other. Operations on per-client keys:
//   set   SET k v, acknowledged by a pipelined CHECK [k] (SET has no reply);
//   get   GET k (k set beforehand);
//   add   ADD c 1;
//   mixed set, get, add in turn.
// Each counts as one operation; latency is per round trip.
//
// Storm: N connections open at once; each ADDs a counter, the one that brings
// it to N SETs a barrier key, and all WAIT for that key. storm_s is the time
// from the first connect to the last release.
//
// The last stdout line is JSON: ops_per_s, p50_us, p99_us (load) or storm_s,
// clients (storm).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "store/protocol.h"
#include "store/tcp_store.h"

namespace {

using namespace ctorchrun::store;
using protocol::Dialect;
using protocol::Op;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "ctorch-store-bench: %s\n", msg.c_str());
  std::exit(1);
}

void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

sockaddr_storage resolve(const std::string& host, int port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    die("cannot resolve " + host);
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

// Kinds of reply the loop waits for.
enum class Reply { kU8, kI64, kBytes };

struct Client {
  int fd = -1;
  std::string key;      // per-client value key
  std::string counter;  // per-client ADD key
  std::string in;
  Reply expect = Reply::kU8;  // storm: the one reply awaited
  // Load: requests in flight, oldest first (replies come back in order).
  std::deque<std::pair<Reply, Clock::time_point>> inflight;
  int step = 0;  // position in the op cycle
  bool done = false;
  int stage = 0;  // storm: 0 connecting, 1 add sent, 2 wait sent, 3 released
};

class Bench {
 public:
  Bench(std::string host, int port, Dialect dialect)
      : host_(std::move(host)), port_(port), dialect_(dialect) {
    addr_ = resolve(host_, port_, &addr_len_);
    ep_ = epoll_create1(EPOLL_CLOEXEC);
  }

  std::string request(Op op) const {
    std::string s;
    protocol::put_u8(&s, *protocol::encode_opcode(dialect_, op));
    return s;
  }

  int open_socket(bool nonblocking_connect) {
    int fd = socket(addr_.ss_family,
                    SOCK_STREAM | SOCK_CLOEXEC | (nonblocking_connect ? SOCK_NONBLOCK : 0), 0);
    if (fd < 0) die(std::string("socket: ") + std::strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr_), addr_len_);
    if (rc != 0 && !(nonblocking_connect && errno == EINPROGRESS)) {
      die("connect to " + host_ + ":" + std::to_string(port_) + ": " + std::strerror(errno));
    }
    if (!nonblocking_connect) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
  }

  void send_all(Client& c, const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(c.fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        continue;  // tiny requests: the socket buffer drains at once
      } else {
        die(std::string("send: ") + std::strerror(errno));
      }
    }
  }

  // Reads until the expected reply is complete (true, consumed from c.in) or
  // the socket has nothing more for now (false). A reply usually arrives in
  // one segment, so the common case costs one recv.
  bool read_reply(Client& c) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (take_reply(c)) return true;
        continue;
      }
      if (n == 0) die("the server closed a connection");
      if (errno == EAGAIN || errno == EINTR) return false;
      die(std::string("recv: ") + std::strerror(errno));
    }
  }

  bool take_reply(Client& c) {
    size_t need = 0;
    switch (c.inflight.empty() ? c.expect : c.inflight.front().first) {
      case Reply::kU8:
        need = 1;
        break;
      case Reply::kI64:
        need = 8;
        break;
      case Reply::kBytes:
        if (c.in.size() < 8) return false;
        need = 8 + protocol::read_u64(c.in.data());
        break;
    }
    if (c.in.size() < need) return false;
    last_reply_.assign(c.in, 0, need);
    c.in.erase(0, need);
    return true;
  }

  void watch(Client& c, size_t index) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = index;
    epoll_ctl(ep_, EPOLL_CTL_ADD, c.fd, &ev);
  }

  std::string host_;
  int port_;
  Dialect dialect_;
  sockaddr_storage addr_{};
  socklen_t addr_len_ = 0;
  int ep_ = -1;
  std::string last_reply_;
};

double percentile(std::vector<uint32_t>& v, double p) {
  if (v.empty()) return 0;
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(i), v.end());
  return v[i];
}

Dialect settle_dialect(const std::string& host, int port, const std::string& name) {
  if (name == "v113") return Dialect::kV113;
  if (name == "v2") return Dialect::kV2;
  TcpStoreOptions o;
  o.host = host;
  o.port = static_cast<uint16_t>(port);
  o.connect_timeout = std::chrono::seconds(10);
  try {
    TcpStore probe(o);
    return probe.dialect();
  } catch (const std::exception& e) {
    die(e.what());
  }
}

int run_load(Bench& b, int clients, double seconds, const std::string& op, size_t value_bytes,
             int pipeline) {
  const std::string tag = std::to_string(std::random_device{}());
  const std::string value(value_bytes, 'v');
  std::vector<Client> cs(static_cast<size_t>(clients));
  for (size_t i = 0; i < cs.size(); ++i) {
    Client& c = cs[i];
    c.fd = b.open_socket(false);
    c.key = "/bench/" + tag + "/k" + std::to_string(i);
    c.counter = "/bench/" + tag + "/c" + std::to_string(i);
    std::string setup;
    if (b.dialect_ == Dialect::kV2) {
      setup += b.request(Op::kValidate);
      protocol::put_u32(&setup, protocol::kValidationMagic);
    }
    // Every client's key exists before the clock starts (get needs it).
    setup += b.request(Op::kSet);
    protocol::put_bytes(&setup, c.key);
    protocol::put_bytes(&setup, value);
    b.send_all(c, setup);
    b.watch(c, i);
  }

  // Each client's requests never change: build them once.
  struct Prepared {
    std::string set, get, add;
  };
  std::vector<Prepared> prepared(cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    Prepared& pr = prepared[i];
    pr.set = b.request(Op::kSet);
    protocol::put_bytes(&pr.set, cs[i].key);
    protocol::put_bytes(&pr.set, value);
    pr.set += b.request(Op::kCheck);
    protocol::put_u64(&pr.set, 1);
    protocol::put_bytes(&pr.set, cs[i].key);
    pr.get = b.request(Op::kGet);
    protocol::put_bytes(&pr.get, cs[i].key);
    pr.add = b.request(Op::kAdd);
    protocol::put_bytes(&pr.add, cs[i].counter);
    protocol::put_i64(&pr.add, 1);
  }
  enum Kind { kSet, kGet, kAdd };
  const Kind fixed = op == "set" ? kSet : op == "get" ? kGet : kAdd;
  const bool mixed = op == "mixed";
  std::string batch;
  // Appends client i's next request to `batch` and records it as in flight.
  auto next_request = [&](size_t i, Clock::time_point now) {
    Client& c = cs[i];
    Kind kind = mixed ? static_cast<Kind>(c.step % 3) : fixed;
    ++c.step;
    if (kind == kSet) {
      c.inflight.emplace_back(Reply::kU8, now);
      batch += prepared[i].set;
    } else if (kind == kGet) {
      c.inflight.emplace_back(Reply::kBytes, now);
      batch += prepared[i].get;
    } else {
      c.inflight.emplace_back(Reply::kI64, now);
      batch += prepared[i].add;
    }
  };

  std::vector<uint32_t> lat;
  lat.reserve(1 << 20);
  const auto start = Clock::now();
  const auto end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (size_t i = 0; i < cs.size(); ++i) {
    batch.clear();
    for (int d = 0; d < pipeline; ++d) next_request(i, start);
    b.send_all(cs[i], batch);
  }
  uint64_t ops = 0;
  size_t active = cs.size();
  std::vector<epoll_event> events(cs.size());
  while (active > 0) {
    int n = epoll_wait(b.ep_, events.data(), static_cast<int>(events.size()), 1000);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("epoll_wait failed");
    if (Clock::now() > end + std::chrono::seconds(30)) die("the server stopped answering");
    for (int e = 0; e < n; ++e) {
      size_t i = events[e].data.u64;
      Client& c = cs[i];
      if (c.done || !b.read_reply(c)) continue;
      auto now = Clock::now();
      batch.clear();
      // Every complete reply: count it and, while the run lasts, replace it.
      do {
        lat.push_back(static_cast<uint32_t>(
            std::chrono::duration_cast<std::chrono::microseconds>(now - c.inflight.front().second)
                .count()));
        c.inflight.pop_front();
        ++ops;
        if (now < end) next_request(i, now);
      } while (!c.inflight.empty() && b.take_reply(c));
      if (!batch.empty()) b.send_all(c, batch);
      if (c.inflight.empty()) {
        c.done = true;
        --active;
      }
    }
  }
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  double ops_per_s = static_cast<double>(ops) / elapsed;
  double p50 = percentile(lat, 0.50);
  double p99 = percentile(lat, 0.99);
  for (auto& c : cs) close(c.fd);

  std::printf(
      "%s: %d clients x %d in flight, %.1f s, %llu ops, %.0f ops/s, p50 %.0f us, p99 %.0f us "
      "(%s)\n",
      op.c_str(), clients, pipeline, elapsed, static_cast<unsigned long long>(ops), ops_per_s, p50,
      p99, protocol::to_string(b.dialect_));
  nlohmann::json j = {{"mode", "load"},         {"op", op},
                      {"clients", clients},     {"pipeline", pipeline},
                      {"seconds", elapsed},     {"ops", ops},
                      {"ops_per_s", ops_per_s}, {"p50_us", p50},
                      {"p99_us", p99},          {"dialect", protocol::to_string(b.dialect_)}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

int run_storm(Bench& b, int n, double timeout_s) {
  const std::string tag = std::to_string(std::random_device{}());
  const std::string counter = "/storm/" + tag + "/count";
  const std::string barrier = "/storm/" + tag + "/go";
  std::vector<Client> cs(static_cast<size_t>(n));
  const auto start = Clock::now();
  for (size_t i = 0; i < cs.size(); ++i) {
    cs[i].fd = b.open_socket(true);
    epoll_event ev{};
    ev.events = EPOLLOUT | EPOLLIN;
    ev.data.u64 = i;
    epoll_ctl(b.ep_, EPOLL_CTL_ADD, cs[i].fd, &ev);
  }
  size_t released = 0;
  std::vector<epoll_event> events(cs.size());
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (released < cs.size()) {
    if (Clock::now() > deadline) {
      die("storm of " + std::to_string(n) + " not released within " + std::to_string(timeout_s) +
          " s (" + std::to_string(released) + " released)");
    }
    int k = epoll_wait(b.ep_, events.data(), static_cast<int>(events.size()), 200);
    if (k < 0 && errno == EINTR) continue;
    for (int e = 0; e < k; ++e) {
      size_t i = events[e].data.u64;
      Client& c = cs[i];
      if (c.stage == 0 && (events[e].events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) die(std::string("storm connect: ") + std::strerror(err));
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = i;
        epoll_ctl(b.ep_, EPOLL_CTL_MOD, c.fd, &ev);
        std::string r;
        if (b.dialect_ == Dialect::kV2) {
          r += b.request(Op::kValidate);
          protocol::put_u32(&r, protocol::kValidationMagic);
        }
        r += b.request(Op::kAdd);
        protocol::put_bytes(&r, counter);
        protocol::put_i64(&r, 1);
        c.expect = Reply::kI64;
        c.stage = 1;
        b.send_all(c, r);
        continue;
      }
      if (!(events[e].events & EPOLLIN) || !b.read_reply(c)) continue;
      if (c.stage == 1) {
        int64_t v = protocol::read_i64(b.last_reply_.data());
        std::string r;
        if (v == n) {
          r = b.request(Op::kSet);
          protocol::put_bytes(&r, barrier);
          protocol::put_bytes(&r, "1");
        }
        r += b.request(Op::kWait);
        protocol::put_u64(&r, 1);
        protocol::put_bytes(&r, barrier);
        c.expect = Reply::kU8;
        c.stage = 2;
        b.send_all(c, r);
      } else if (c.stage == 2) {
        c.stage = 3;
        ++released;
      }
    }
  }
  double storm_s = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& c : cs) close(c.fd);
  std::printf("storm: %d clients released in %.3f s (%s)\n", n, storm_s,
              protocol::to_string(b.dialect_));
  nlohmann::json j = {{"mode", "storm"},
                      {"clients", n},
                      {"storm_s", storm_s},
                      {"dialect", protocol::to_string(b.dialect_)}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  int port = 29500;
  int clients = 8;
  double seconds = 5;
  std::string op = "mixed";
  std::string dialect = "auto";
  int storm = 0;
  size_t value_bytes = 16;
  int pipeline = 1;
  double storm_timeout = 120;

  CLI::App app{"ctorch-store-bench: load generator for TCPStore-compatible servers",
               "ctorch-store-bench"};
  app.add_option("--host", host, "server address")->capture_default_str();
  app.add_option("--port", port, "server port")->capture_default_str()->check(CLI::Range(1, 65535));
  app.add_option("--clients", clients, "concurrent connections (load mode)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--seconds", seconds, "duration of the load")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--op", op, "set, get, add or mixed")
      ->capture_default_str()
      ->check(CLI::IsMember({"set", "get", "add", "mixed"}));
  app.add_option("--dialect", dialect,
                 "auto probes the server; v113 for torch 1.13/2.0, v2 for 2.1+")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "v113", "v2"}));
  app.add_option("--storm", storm, "run a rendezvous storm of N connections instead of a load")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--storm-timeout", storm_timeout, "give up on a storm after this many seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--value-bytes", value_bytes, "value size for set/get")->capture_default_str();
  app.add_option("--pipeline", pipeline,
                 "requests each client keeps in flight (1 = a torch client's pattern: one "
                 "request, wait for its reply)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  CLI11_PARSE(app, argc, argv);

  raise_fd_limit();
  Bench b(host, port, settle_dialect(host, port, dialect));
  if (storm > 0) return run_storm(b, storm, storm_timeout);
  return run_load(b, clients, seconds, op, value_bytes, pipeline);
}

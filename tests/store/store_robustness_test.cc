// No request freezes the store, every slow
// reader is bounded, no refusal goes unreported, torch's ADD wrap, a correct
// APPEND on torch 1.13 servers, and keys bound to a connection.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spdlog/sinks/ostream_sink.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "store/protocol.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"
#include "tests/store/local_server.h"
#include "tests/store/wire_bytes.h"
#include "tests/support/process.h"
#include "tests/support/raw_client.h"
#include "tests/support/test_python.h"

using namespace ctorchrun;
using namespace ctorchrun::store;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using protocol::Dialect;
using protocol::Op;

namespace {

std::string i64(int64_t v) { return wire::u64(static_cast<uint64_t>(v)); }
const std::string kStop(1, '\0');
constexpr size_t kMaxKeys = 131072;  // the documented keys-per-request limit

std::string key_name(size_t i) { return "/k" + std::to_string(i); }

std::shared_ptr<TcpStore> client(uint16_t port, ClientDialect d = ClientDialect::kAuto) {
  TcpStoreOptions o;
  o.port = port;
  o.dialect = d;
  o.timeout = 10s;
  o.connect_timeout = 10s;
  return std::make_shared<TcpStore>(o);
}

// Collects what the "store" logger writes while it lives.
class LogCapture {
 public:
  LogCapture() : logger_(get_logger("store")) {
    sink_ = std::make_shared<spdlog::sinks::ostream_sink_mt>(out_);
    logger_->sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = logger_->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  // Call only after a server call that synchronises with the server thread.
  std::vector<std::string> lines_with(const std::string& needle) {
    std::vector<std::string> out;
    std::istringstream in(out_.str());
    for (std::string line; std::getline(in, line);) {
      if (line.find(needle) != std::string::npos) out.push_back(line);
    }
    return out;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> logger_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

}  // namespace

TEST_CASE("store: completing a WAIT on 131072 distinct keys examines each key once", "[net]") {
  auto server = local_server();
  RawClient waiter(server->port()), setter(server->port()), other(server->port());
  for (auto* c : {&waiter, &setter, &other}) c->send(wire::validate());
  std::vector<std::string> keys;
  for (size_t i = 0; i < kMaxKeys; ++i) keys.push_back(key_name(i));
  // A PING behind the WAIT is answered once the WAIT is registered.
  waiter.send(wire::op(Dialect::kV2, Op::kWait) + wire::keys(keys) +
              wire::op(Dialect::kV2, Op::kPing) + wire::u32(7));
  REQUIRE(waiter.recv(4, 10s) == wire::u32(7));
  uint64_t before = server->stats().waiter_entries_examined;

  std::string multi_set = wire::op(Dialect::kV2, Op::kMultiSet) + i64(kMaxKeys);
  for (const auto& k : keys) multi_set += wire::str(k) + wire::str("1");
  setter.send(multi_set);
  // Backstop: another client is served while the keys arrive.
  other.send(wire::op(Dialect::kV2, Op::kGetNumKeys));
  CHECK(other.recv(8, 2s));
  CHECK(waiter.recv(1, 10s) == kStop);
  CHECK(server->stats().waiter_entries_examined - before == kMaxKeys);
}

TEST_CASE("store: a WAIT naming one key 131072 times completes after examining it once", "[net]") {
  auto server = local_server();
  RawClient waiter(server->port()), setter(server->port()), other(server->port());
  for (auto* c : {&waiter, &setter, &other}) c->send(wire::validate());
  waiter.send(wire::op(Dialect::kV2, Op::kWait) +
              wire::keys(std::vector<std::string>(kMaxKeys, "/dup")) +
              wire::op(Dialect::kV2, Op::kPing) + wire::u32(7));
  REQUIRE(waiter.recv(4, 10s) == wire::u32(7));
  uint64_t before = server->stats().waiter_entries_examined;
  setter.send(wire::op(Dialect::kV2, Op::kSet) + wire::str("/dup") + wire::str("x"));
  other.send(wire::op(Dialect::kV2, Op::kGetNumKeys));
  CHECK(other.recv(8, 2s));
  CHECK(waiter.recv(1, 10s) == kStop);
  CHECK(server->stats().waiter_entries_examined - before == 1);
}

TEST_CASE("store: a multi-key request received in pieces is parsed from where it stopped",
          "[unit]") {
  protocol::Limits limits;
  limits.max_key_bytes = 16;
  protocol::Request req;
  std::vector<std::string> keys;
  for (int i = 0; i < 1000; ++i) keys.push_back(key_name(static_cast<size_t>(i)));
  std::string full = wire::op(Dialect::kV2, Op::kWait) + wire::keys(keys);
  Dialect d = Dialect::kV2;
  std::string buf;
  size_t sent = 1 + 8;
  buf = full.substr(0, sent);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto r = protocol::parse_request(&d, buf.data(), buf.size(), limits, &req);
    REQUIRE(r.status == protocol::ParseStatus::kNeedMore);
    if (i == 1) {
      // The first key's length prefix is behind the parser now: garble it.
      // A parser that started over would see a key over the limit.
      uint64_t huge = uint64_t{1} << 40;
      std::memcpy(&buf[9], &huge, 8);
    }
    size_t piece = 8 + keys[i].size();
    // The buffer moves, as a connection's does when it compacts or grows.
    std::string moved = buf + full.substr(sent, piece);
    buf.swap(moved);
    sent += piece;
  }
  auto r = protocol::parse_request(&d, buf.data(), buf.size(), limits, &req);
  REQUIRE(r.status == protocol::ParseStatus::kComplete);
  CHECK(r.size == full.size());
  REQUIRE(req.keys.size() == keys.size());
  CHECK(req.keys[1] == keys[1]);
  CHECK(req.keys.back() == keys.back());
  // A fresh request on the same Request object starts over.
  std::string get = wire::op(Dialect::kV2, Op::kGet) + wire::str("/g");
  r = protocol::parse_request(&d, get.data(), get.size(), limits, &req);
  CHECK(r.status == protocol::ParseStatus::kComplete);
  CHECK(req.key == "/g");
}

TEST_CASE("store: a 131072-key WAIT sent in small pieces does not hold up other clients", "[net]") {
  auto server = local_server();
  RawClient waiter(server->port()), other(server->port());
  std::vector<std::string> keys;
  for (size_t i = 0; i < kMaxKeys; ++i) keys.push_back(key_name(i));
  std::string full = wire::op(Dialect::kV113, Op::kWait) + wire::keys(keys);
  constexpr size_t kPiece = 4096;
  for (size_t off = 0; off < full.size(); off += kPiece) {
    REQUIRE(waiter.send(full.substr(off, kPiece)));
    if ((off / kPiece) % 64 == 0) {
      other.send(wire::op(Dialect::kV113, Op::kGetNumKeys));
      REQUIRE(other.recv(8, 2s) == i64(0));
    }
  }
  // The last pieces may still be in flight: this checks the outcome, the
  // probes above the waiting times.
  other.send(wire::op(Dialect::kV113, Op::kCheck) + wire::keys({"/k0"}));
  CHECK(other.recv(1, 10s) == std::string(1, '\x01'));
  CHECK(waiter.silent_for(50ms));
}

TEST_CASE(
    "store: every refusal over a limit is counted, and the first per client is logged at once",
    "[net]") {
  LogCapture log;
  ServerOptions o;
  o.limits.max_key_bytes = 100;
  o.limits.max_value_bytes = 1024;
  o.limits.max_request_bytes = 2048;
  auto server = local_server(o);
  const std::string long_key = "/refused-" + std::string(200, 'k');
  for (int i = 0; i < 3; ++i) {
    RawClient c(server->port());
    c.send(wire::op(Dialect::kV113, Op::kSet) + wire::str("/too-big") +
           wire::str(std::string(1025, 'v')));
    CHECK(c.closed_within(2s));
  }
  auto s = server->stats();
  CHECK(s.limit_refusals == 3);
  auto lines = log.lines_with("refused");
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("127.0.0.1:") != std::string::npos);
  CHECK(lines[0].find("/too-big") != std::string::npos);
  CHECK(lines[0].find("1024") != std::string::npos);

  // A whole request over the request limit, with a key cut in the log.
  {
    RawClient c(server->port());
    c.send(wire::validate() + wire::op(Dialect::kV2, Op::kMultiSet) + i64(3) + wire::str("/a") +
           wire::str(std::string(1000, 'v')) + wire::str("/b") + wire::str(std::string(1000, 'v')) +
           wire::str("/c") + wire::u64(1000));
    CHECK(c.closed_within(2s));
  }
  // A MULTI_GET whose reply would pass the request limit.
  {
    RawClient c(server->port());
    c.send(wire::validate() + wire::op(Dialect::kV2, Op::kSet) + wire::str("/m") +
           wire::str(std::string(1000, 'v')) + wire::op(Dialect::kV2, Op::kMultiGet) +
           wire::keys({"/m", "/m", "/m"}));
    CHECK(c.closed_within(2s));
  }
  CHECK(server->stats().limit_refusals == 5);

  // After the period, one line reports the refusals since the last one.
  std::this_thread::sleep_for(1100ms);
  {
    RawClient c(server->port());
    c.send(wire::op(Dialect::kV113, Op::kGet) + wire::str(long_key));
    CHECK(c.closed_within(2s));
  }
  CHECK(server->stats().limit_refusals == 6);
  lines = log.lines_with("refused");
  REQUIRE(lines.size() == 2);
  CHECK(lines[1].find("refused 5 more requests from 127.0.0.1") != std::string::npos);
  CHECK(lines[1].find("/refused-" + std::string(91, 'k') + "...") != std::string::npos);
}

TEST_CASE("store: a request limit below key + value limits is refused at start", "[unit]") {
  ServerOptions o;
  o.limits.max_key_bytes = 100;
  o.limits.max_value_bytes = 1000;
  o.limits.max_request_bytes = 1099;
  CHECK_THROWS_AS(local_server(o), ConfigError);
  protocol::Limits l;
  CHECK(protocol::request_limit(l) == (size_t{128} << 20));
  l.max_value_bytes = 1 << 20;
  CHECK(protocol::request_limit(l) == (size_t{65} << 20));
}

TEST_CASE("store: a WATCH_KEY client that never reads its events is closed, not buffered",
          "[net]") {
  LogCapture log;
  auto server = local_server();
  RawClient watcher(server->port()), setter(server->port());
  const Dialect d = Dialect::kV113;
  watcher.send(wire::op(d, Op::kWatchKey) + wire::str("/watched"));
  REQUIRE(watcher.recv(1, 2s) == std::string(1, '\x03'));
  const std::string value(1 << 20, 'w');
  for (int i = 0; i < 300; ++i) {
    REQUIRE(setter.send(wire::op(d, Op::kSet) + wire::str("/watched") + wire::str(value)));
  }
  setter.send(wire::op(d, Op::kGetNumKeys));
  REQUIRE(setter.recv(8, 30s) == i64(1));
  auto s = server->stats();
  CHECK(s.slow_readers_closed == 1);
  CHECK(watcher.closed_within(10s));
  CHECK(log.lines_with("WATCH_KEY client left its events unread").size() == 1);
}

TEST_CASE("store: ADD wraps past int64's ends as torch's servers do", "[net]") {
  auto server = local_server();
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    RawClient c(server->port());
    std::string pre = d == Dialect::kV2 ? wire::validate() : "";
    std::string key = std::string("/wrap-") + protocol::to_string(d);
    c.send(pre + wire::op(d, Op::kAdd) + wire::str(key) + i64(INT64_MAX) + wire::op(d, Op::kAdd) +
           wire::str(key) + i64(1));
    CHECK(c.recv(16, 2s) == i64(INT64_MAX) + i64(INT64_MIN));
    c.send(wire::op(d, Op::kGet) + wire::str(key) + wire::op(d, Op::kAdd) + wire::str(key) +
           i64(-1));
    CHECK(c.recv(8 + 20 + 8, 2s) == wire::str("-9223372036854775808") + i64(INT64_MAX));
  }
  auto c = client(server->port());
  c->set("n", "-9223372036854775808");
  CHECK(c->add("n", -1) == std::numeric_limits<int64_t>::max());
}

TEST_CASE("store: four clients appending through the 1.13 emulation lose no byte", "[net]") {
  auto server = local_server();
  constexpr int kClients = 4, kAppends = 50;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      try {
        auto c = client(server->port(), ClientDialect::kV113);
        for (int i = 0; i < kAppends; ++i)
          c->append("log", std::string(4, static_cast<char>('a' + t)));
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  auto c = client(server->port(), ClientDialect::kV113);
  std::string v = c->get("log");
  CHECK(v.size() == kClients * kAppends * 4);
  for (int t = 0; t < kClients; ++t) {
    CHECK(std::count(v.begin(), v.end(), static_cast<char>('a' + t)) == kAppends * 4);
  }
  CHECK_FALSE(c->check({std::string("log") + TcpStore::kAppendLockSuffix}));
}

TEST_CASE("store: keys bound to a SIGKILLed client's connection are gone within 100 ms",
          "[multiproc]") {
  Process store({CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"});
  int port = wait_for_listening_port(store, 20s);
  REQUIRE(port > 0);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      auto c = client(static_cast<uint16_t>(port));
      c->bind_keys_to_connection();
      c->set("alive/0", "1");
      c->add("count/0", 1);
      char ok = 'y';
      if (::write(ready[1], &ok, 1) != 1) ::_exit(3);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(2);
    }
  }
  ::close(ready[1]);
  char got = 0;
  REQUIRE(::read(ready[0], &got, 1) == 1);
  ::close(ready[0]);
  auto observer = client(static_cast<uint16_t>(port));
  observer->set("unbound", "stays");
  CHECK(observer->check({"alive/0", "count/0"}));
  CHECK_FALSE(observer->check({TcpStore::gone_marker("alive/0")}));

  ::kill(child, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  observer->wait({TcpStore::gone_marker("alive/0"), TcpStore::gone_marker("count/0")}, 100ms);
  CHECK_FALSE(observer->check({"alive/0"}));
  CHECK_FALSE(observer->check({"count/0"}));
  CHECK(observer->get("unbound") == "stays");
}

TEST_CASE("store: a bound key's marker follows its current holder", "[net]") {
  auto server = local_server();
  auto observer = client(server->port());
  {
    auto holder = client(server->port());
    holder->bind_keys_to_connection();
    holder->set("lease", "a");
    observer->set("lease", "overwritten");  // still bound to holder
    holder->set("mine-then-deleted", "x");
    CHECK(holder->delete_key("mine-then-deleted"));
    observer->set("mine-then-deleted", "observer's");  // not bound to holder
  }
  observer->wait({TcpStore::gone_marker("lease")}, 2s);
  CHECK_FALSE(observer->check({"lease"}));
  // A new holder creates the key again: the old marker goes.
  auto holder2 = client(server->port());
  holder2->bind_keys_to_connection();
  holder2->set("lease", "b");
  CHECK_FALSE(observer->check({TcpStore::gone_marker("lease")}));
  CHECK(observer->get("mine-then-deleted") == "observer's");
}

TEST_CASE("store: binding keys to a connection is reported not supported without the extension",
          "[net]") {
  auto server = local_server();
  // Our server in the 1.13 dialect stands for torch 1.13's server here.
  auto v113 = client(server->port(), ClientDialect::kV113);
  try {
    v113->bind_keys_to_connection();
    FAIL("bound keys over the 1.13 dialect");
  } catch (const NotSupportedError& e) {
    CHECK(std::string(e.what()).find("not supported") != std::string::npos);
  }
  v113->set("still", "usable");
  CHECK(v113->get("still") == "usable");

  // A torch 2.x server answers VALIDATE and PING, and closes the connection
  // on an opcode it does not know.
  int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(ls, 4) == 0);
  socklen_t al = sizeof a;
  ::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &al);
  std::thread fake([ls] {
    int fd = ::accept(ls, nullptr, nullptr);
    if (fd < 0) return;
    char b[10];
    size_t got = 0;
    while (got < sizeof b) {
      ssize_t n = ::recv(fd, b + got, sizeof b - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (got == sizeof b) (void)!::send(fd, b + 6, 4, MSG_NOSIGNAL);  // echo the nonce
    char op = 0;
    (void)!::recv(fd, &op, 1, 0);  // the unknown opcode: disconnect
    ::close(fd);
  });
  TcpStoreOptions o;
  o.port = ntohs(a.sin_port);
  o.dialect = ClientDialect::kV2;
  o.timeout = 2s;
  o.connect_timeout = 2s;
  {
    TcpStore c(o);
    try {
      c.bind_keys_to_connection();
      FAIL("bound keys on a server without the extension");
    } catch (const NotSupportedError& e) {
      CHECK(std::string(e.what()).find("not supported") != std::string::npos);
    }
  }
  fake.join();
  ::close(ls);
}

TEST_CASE(
    "store: against torch's own server, appends lose no byte and bound keys are not supported",
    "[torch]") {
  Process server({test_python(), CTORCHRUN_SOURCE_DIR "/tests/torch/torch_store_server.py",
                  "--port", "0", "--duration", "120"});
  int port = wait_for_listening_port(server, 60s);
  REQUIRE(port > 0);
  constexpr int kClients = 4, kAppends = 50;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      try {
        auto c = client(static_cast<uint16_t>(port));
        for (int i = 0; i < kAppends; ++i) {
          c->append("log", std::string(4, static_cast<char>('a' + t)));
        }
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  auto c = client(static_cast<uint16_t>(port));
  // torch 1.13 (and 2.0) speak v113; 2.1 and later v2.
  CHECK(c->dialect() == (test_torch_version() >= std::pair{2, 1} ? Dialect::kV2 : Dialect::kV113));
  CHECK(c->get("log").size() == kClients * kAppends * 4);
  CHECK_THROWS_AS(c->bind_keys_to_connection(), NotSupportedError);
  c->set("after", "ok");
  CHECK(c->get("after") == "ok");
}

TEST_CASE("store: after a set() refused over a limit, the next call's error says why", "[net]") {
  ServerOptions o;
  o.limits.max_value_bytes = 1024;
  auto server = local_server(o);
  auto c = client(server->port());
  c->set("big", std::string(2048, 'v'));  // no reply: the refusal shows later
  try {
    c->get("other");
    FAIL("the connection survived a refused set");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).find("size limits") != std::string::npos);
  }
  c->set("small", "ok");  // reconnects
  CHECK(c->get("small") == "ok");
  CHECK(server->stats().limit_refusals == 1);
}

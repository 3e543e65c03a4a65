// Server behaviour seen on the wire: raw bytes in, raw bytes out.

#include "store/tcp_store_server.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <thread>

#include "common/error.h"
#include "store/tcp_store.h"
#include "tests/store/local_server.h"
#include "tests/store/wire_bytes.h"
#include "tests/support/raw_client.h"

using namespace ctorchrun;
using namespace ctorchrun::store;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using protocol::Dialect;
using protocol::Op;

namespace {

constexpr auto kReply = 2s;
const std::string kStop(1, '\0');

std::string i64(int64_t v) { return wire::u64(static_cast<uint64_t>(v)); }

}  // namespace

TEST_CASE(
    "TcpStoreServer: GET of a missing key returns an empty value, as torch 2.x's libuv server",
    "[net]") {
  auto server = local_server();
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    RawClient c(server->port());
    if (d == Dialect::kV2) c.send(wire::validate());
    c.send(wire::op(d, Op::kGet) + wire::str("/missing"));
    CHECK(c.recv(8, kReply) == wire::u64(0));
  }
}

TEST_CASE("TcpStoreServer: answers VALIDATE with nothing and echoes PING at any time", "[net]") {
  auto server = local_server();
  RawClient c(server->port());
  c.send(wire::validate());
  CHECK(c.silent_for(100ms));
  c.send(wire::op(Dialect::kV2, Op::kPing) + wire::u32(12345));
  CHECK(c.recv(4, kReply) == wire::u32(12345));
  c.send(wire::op(Dialect::kV2, Op::kSet) + wire::str("/k") + wire::str("v") +
         wire::op(Dialect::kV2, Op::kPing) + wire::u32(7));
  CHECK(c.recv(4, kReply) == wire::u32(7));
}

TEST_CASE("TcpStoreServer: a first byte of 0 split from the magic still selects v2", "[net]") {
  auto server = local_server();
  RawClient c(server->port());
  std::string v = wire::validate();
  c.send(v.substr(0, 1));
  std::this_thread::sleep_for(50ms);
  c.send(v.substr(1, 2));
  std::this_thread::sleep_for(50ms);
  c.send(v.substr(3) + wire::op(Dialect::kV2, Op::kPing) + wire::u32(99));
  CHECK(c.recv(4, kReply) == wire::u32(99));
}

TEST_CASE("TcpStoreServer: echoes the dialect probe (VALIDATE + PING 0xFFFFFFFF)", "[net]") {
  auto server = local_server();
  RawClient c(server->port());
  c.send(wire::validate() + wire::op(Dialect::kV2, Op::kPing) + wire::u32(0xFFFFFFFF));
  CHECK(c.recv(4, kReply) == wire::u32(0xFFFFFFFF));
}

TEST_CASE("TcpStoreServer: a v113 WAIT abandoned by its client is dropped, not answered late",
          "[net]") {
  auto server = local_server();
  RawClient c(server->port());
  const Dialect d = Dialect::kV113;
  c.send(wire::op(d, Op::kWait) + wire::keys({"/x"}));
  CHECK(c.silent_for(100ms));  // pending
  // The 1.13 client timed out and moves on: SET then GET another key.
  c.send(wire::op(d, Op::kSet) + wire::str("/y") + wire::str("hello"));
  c.send(wire::op(d, Op::kGet) + wire::str("/y"));
  CHECK(c.recv(8 + 5, kReply) == wire::str("hello"));
  // The awaited key appears now: no stale STOP_WAITING may follow.
  RawClient other(server->port());
  other.send(wire::op(d, Op::kSet) + wire::str("/x") + wire::str("1"));
  CHECK(c.silent_for(200ms));
  c.send(wire::op(d, Op::kGetNumKeys));
  CHECK(c.recv(8, kReply) == i64(2));
}

TEST_CASE("TcpStoreServer: WAIT replies only when every missing key exists", "[net]") {
  auto server = local_server();
  RawClient w(server->port());
  RawClient s(server->port());
  const Dialect d = Dialect::kV113;
  s.send(wire::op(d, Op::kSet) + wire::str("/p") + wire::str("1") + wire::op(d, Op::kGetNumKeys));
  CHECK(s.recv(8, kReply) == i64(1));
  w.send(wire::op(d, Op::kWait) + wire::keys({"/p", "/m1", "/m2"}));
  CHECK(w.silent_for(50ms));
  s.send(wire::op(d, Op::kAdd) + wire::str("/m1") + i64(1));
  CHECK(s.recv(8, kReply) == i64(1));
  CHECK(w.silent_for(100ms));
  s.send(wire::op(d, Op::kCompareSet) + wire::str("/m2") + wire::str("") + wire::str("v"));
  CHECK(s.recv(9, kReply) == wire::str("v"));
  CHECK(w.recv(1, kReply) == kStop);
  // Zero keys: at once.
  w.send(wire::op(d, Op::kWait) + wire::keys({}));
  CHECK(w.recv(1, kReply) == kStop);
}

TEST_CASE("TcpStoreServer: CANCEL_WAIT drops the wait and always answers WAIT_CANCELED", "[net]") {
  auto server = local_server();
  RawClient c(server->port());
  const Dialect d = Dialect::kV2;
  c.send(wire::validate() + wire::op(d, Op::kWait) + wire::keys({"/never"}));
  CHECK(c.silent_for(50ms));
  c.send(wire::op(d, Op::kCancelWait));
  CHECK(c.recv(1, kReply) == std::string(1, '\x01'));
  RawClient other(server->port());
  other.send(wire::validate() + wire::op(d, Op::kSet) + wire::str("/never") + wire::str("x"));
  CHECK(c.silent_for(150ms));
  c.send(wire::op(d, Op::kCancelWait));  // nothing pending
  CHECK(c.recv(1, kReply) == std::string(1, '\x01'));
}

TEST_CASE("TcpStoreServer: queues push, pop, count and wake one waiter", "[net]") {
  auto server = local_server();
  const Dialect d = Dialect::kV2;
  RawClient w1(server->port()), w2(server->port()), c(server->port());
  for (auto* x : {&w1, &w2, &c}) x->send(wire::validate());
  w1.send(wire::op(d, Op::kWait) + wire::keys({"/q"}));
  w2.send(wire::op(d, Op::kWait) + wire::keys({"/q"}));
  CHECK(w1.silent_for(50ms));
  c.send(wire::op(d, Op::kQueuePush) + wire::str("/q") + wire::str("a"));
  // Exactly one of the two waiters is released.
  auto r1 = w1.recv(1, 500ms);
  auto r2 = w2.recv(1, 500ms);
  CHECK((r1 ? 1 : 0) + (r2 ? 1 : 0) == 1);
  CHECK((r1 ? *r1 : *r2) == kStop);
  c.send(wire::op(d, Op::kQueueLen) + wire::str("/q"));
  CHECK(c.recv(8, kReply) == i64(1));
  c.send(wire::op(d, Op::kCheck) + wire::keys({"/q"}));
  CHECK(c.recv(1, kReply) == std::string(1, '\0'));
  c.send(wire::op(d, Op::kQueuePop) + wire::str("/q"));
  CHECK(c.recv(8 + 9, kReply) == i64(1) + wire::str("a"));
  c.send(wire::op(d, Op::kQueuePop) + wire::str("/q"));
  CHECK(c.recv(8, kReply) == i64(0));
  CHECK(c.silent_for(50ms));
}

TEST_CASE("TcpStoreServer: v113 WATCH_KEY reports creation, update and deletion", "[net]") {
  auto server = local_server();
  const Dialect d = Dialect::kV113;
  RawClient w(server->port()), c(server->port());
  w.send(wire::op(d, Op::kWatchKey) + wire::str("/wk"));
  CHECK(w.recv(1, kReply) == std::string(1, '\x03'));
  c.send(wire::op(d, Op::kSet) + wire::str("/wk") + wire::str("a"));
  CHECK(w.recv(1 + 11 + 8 + 9, kReply) ==
        std::string(1, '\x01') + wire::str("/wk") + wire::str("") + wire::str("a"));
  c.send(wire::op(d, Op::kSet) + wire::str("/wk") + wire::str("b"));
  CHECK(w.recv(1 + 11 + 9 + 9, kReply) ==
        std::string(1, '\x00') + wire::str("/wk") + wire::str("a") + wire::str("b"));
  c.send(wire::op(d, Op::kDeleteKey) + wire::str("/wk"));
  CHECK(c.recv(8, kReply) == i64(1));
  CHECK(w.recv(1 + 11 + 9 + 8, kReply) ==
        std::string(1, '\x02') + wire::str("/wk") + wire::str("b") + wire::str(""));
}

TEST_CASE("TcpStoreServer: a misbehaving client loses its connection, others carry on", "[net]") {
  auto server = local_server();
  RawClient good(server->port());
  good.send(wire::validate() + wire::op(Dialect::kV2, Op::kSet) + wire::str("/g") + wire::str("1"));
  struct BadCase {
    const char* what;
    std::string bytes;
  };
  std::vector<BadCase> cases = {
      {"unknown v113 opcode", std::string(1, '\x09')},
      {"unknown v2 opcode", wire::validate() + std::string(1, '\x12')},
      {"VALIDATE with a wrong magic, later",
       wire::validate() + wire::op(Dialect::kV2, Op::kValidate) + wire::u32(1)},
      {"ADD on a non-integer", wire::op(Dialect::kV113, Op::kSet) + wire::str("/t") +
                                   wire::str("abc") + wire::op(Dialect::kV113, Op::kAdd) +
                                   wire::str("/t") + i64(1)},
      {"second WAIT while one is pending (v2)",
       wire::validate() + wire::op(Dialect::kV2, Op::kWait) + wire::keys({"/w1"}) +
           wire::op(Dialect::kV2, Op::kWait) + wire::keys({"/w2"})},
  };
  for (const auto& bad : cases) {
    INFO(bad.what);
    RawClient c(server->port());
    c.send(bad.bytes);
    CHECK(c.closed_within(2s));
    good.send(wire::op(Dialect::kV2, Op::kGet) + wire::str("/g"));
    CHECK(good.recv(9, kReply) == wire::str("1"));
  }
  CHECK(server->stats().dropped >= cases.size());
}

TEST_CASE("TcpStoreServer: half a request stalls nobody else", "[net]") {
  auto server = local_server();
  RawClient slow(server->port()), fast(server->port());
  slow.send(wire::op(Dialect::kV113, Op::kSet) + wire::u64(3) + "/s");  // key incomplete
  auto t0 = std::chrono::steady_clock::now();
  fast.send(wire::op(Dialect::kV113, Op::kGetNumKeys));
  CHECK(fast.recv(8, kReply) == i64(0));
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
  // Completing the request executes it (its own follow-up sees the key).
  slow.send("l" + wire::str("v") + wire::op(Dialect::kV113, Op::kGetNumKeys));
  CHECK(slow.recv(8, kReply) == i64(1));
}

TEST_CASE("TcpStoreServer: erase_keys_except keeps only the given namespaces", "[net]") {
  auto server = local_server();
  TcpStoreOptions o;
  o.port = server->port();
  TcpStore c(o);
  c.set("none/torchelastic/role_info0", "x");  // sent as "/none/..."
  c.set("worker/attempt_0/default_pg/0", "y");
  c.set("default_pg/0//cpu//0", "z");
  c.add("ctr", 1);
  CHECK(server->erase_keys_except({"/none/"}) == 3);
  CHECK(c.num_keys() == 1);
  CHECK(c.check({"none/torchelastic/role_info0"}));
}

TEST_CASE("TcpStoreServer: connections over --max-connections are closed at once", "[net]") {
  ServerOptions o;
  o.max_connections = 2;
  auto server = local_server(o);
  RawClient a(server->port()), b(server->port());
  a.send(wire::op(Dialect::kV113, Op::kGetNumKeys));
  CHECK(a.recv(8, kReply));
  RawClient c(server->port());
  CHECK(c.closed_within(2s));
  b.send(wire::op(Dialect::kV113, Op::kGetNumKeys));
  CHECK(b.recv(8, kReply));
  CHECK(server->stats().refused == 1);
}

TEST_CASE("TcpStoreServer: binding a port in use throws IoError naming it", "[net]") {
  auto first = local_server();
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = first->port();
  try {
    TcpStoreServer::start(o);
    FAIL("second bind succeeded");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).find(std::to_string(first->port())) != std::string::npos);
  }
}

TEST_CASE("TcpStoreServer: a waiter that disconnects leaves no registration behind", "[net]") {
  auto server = local_server();
  {
    RawClient w(server->port());
    w.send(wire::op(Dialect::kV113, Op::kWait) + wire::keys({"/gone"}));
    CHECK(w.silent_for(50ms));
  }
  RawClient c(server->port());
  c.send(wire::op(Dialect::kV113, Op::kSet) + wire::str("/gone") + wire::str("1") +
         wire::op(Dialect::kV113, Op::kGetNumKeys));
  CHECK(c.recv(8, kReply) == i64(1));
  // The server notices the close on its own schedule: poll, bounded.
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server->stats().open_connections != 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(server->stats().open_connections == 1);
}

TEST_CASE(
    "TcpStore: interrupt() from another thread ends a wait blocked on the connection at once, "
    "and every later call fails",
    "[net]") {
  auto server = local_server();
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = server->port();
  auto client = std::make_shared<TcpStore>(o);
  client->set("k", "v");
  std::atomic<bool> failed{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::thread waiter([&] {
    try {
      client->wait({"never"}, 60s);  // a wait that nothing ends but interrupt()
    } catch (const IoError&) {
      failed = true;
    }
  });
  std::this_thread::sleep_for(100ms);  // let it block in the wait
  client->interrupt();
  waiter.join();
  CHECK(failed);
  // Well within the wait's 60 s: it was cut short, not waited out.
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
  CHECK_THROWS_AS(client->get("k"), IoError);  // no reconnection
  // The server keeps serving others.
  CHECK(TcpStore(o).get("k") == "v");
}

TEST_CASE(
    "TcpStoreServer: calls from other threads run while clients are served and still answer "
    "after stop",
    "[net]") {
  // The server thread takes no lock: other threads reach it only through its
  // mailbox (an eventfd). Many calls racing with client traffic must all
  // run, none lost (a lost wake-up would hang this test), and a call after
  // stop() must not wait for a thread that is gone.
  auto server = local_server();
  constexpr int kClientRequests = 2000;
  std::atomic<bool> client_ok{true};
  std::thread client([&] {
    RawClient c(server->port());
    for (int i = 0; i < kClientRequests && client_ok; ++i) {
      c.send(wire::op(Dialect::kV113, Op::kAdd) + wire::str("/n") + i64(1));
      if (c.recv(8, kReply) != i64(i + 1)) client_ok = false;
    }
  });
  std::vector<std::thread> callers;
  std::atomic<int> calls{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        (void)server->stats();
        ++calls;
      }
    });
  }
  for (auto& t : callers) t.join();
  client.join();
  CHECK(client_ok);
  CHECK(calls == 1200);
  CHECK(server->stats().requests >= static_cast<uint64_t>(kClientRequests));
  server->stop();
  // After stop() the thread is gone: both answer on the caller's thread.
  CHECK(server->stats().requests >= static_cast<uint64_t>(kClientRequests));
  CHECK(server->erase_keys_except({"/none/"}) == 0);
}

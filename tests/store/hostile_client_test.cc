// Hostile clients against the real ctorch-store binary: garbage, truncated
// frames, absurd length prefixes and hundreds of stalled half-sent requests.
// The server must keep answering a good client, and its memory must follow
// the bytes actually received, not the lengths announced.

#include <catch2/catch.hpp>
#include <memory>
#include <random>
#include <thread>

#include "tests/store/wire_bytes.h"
#include "tests/support/process.h"
#include "tests/support/raw_client.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using ctorchrun::store::protocol::decode_opcode;
using ctorchrun::store::protocol::Dialect;
using ctorchrun::store::protocol::Op;

namespace {

struct StoreProcess {
  Process proc{{CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"}};
  int port = wait_for_listening_port(proc, 20s);
};

// A good client's round trip still works.
bool good_client_served(int port) {
  RawClient c(port);
  c.send(wire::validate() + wire::op(Dialect::kV2, Op::kSet) + wire::str("/alive") +
         wire::str("yes") + wire::op(Dialect::kV2, Op::kGet) + wire::str("/alive"));
  return c.recv(8 + 3, 5s) == wire::str("yes");
}

}  // namespace

TEST_CASE("ctorch-store: random bytes from many clients close those clients only", "[net]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  std::mt19937_64 rng(42);
  for (int round = 0; round < 200; ++round) {
    RawClient c(s.port);
    std::string junk(1 + rng() % 4096, '\0');
    for (auto& ch : junk) ch = static_cast<char>(rng());
    c.send(junk);
    if (round % 50 == 0) CHECK(good_client_served(s.port));
  }
  CHECK(good_client_served(s.port));
  CHECK(s.proc.wait(0ms) == std::nullopt);  // still running
}

TEST_CASE("ctorch-store: truncated frames of every op, then a disconnect, harm nobody", "[net]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    for (int code = 0; code < 20; ++code) {
      auto op = decode_opcode(d, static_cast<uint8_t>(code));
      if (!op) continue;
      std::string frame = (d == Dialect::kV2 ? wire::validate() : "") +
                          std::string(1, static_cast<char>(code)) + wire::u64(10) + "abc";
      for (size_t cut : {size_t{1}, size_t{3}, frame.size() - 1}) {
        RawClient c(s.port);
        c.send(frame.substr(0, cut));
      }
    }
  }
  CHECK(good_client_served(s.port));
}

TEST_CASE("ctorch-store: 2^62 and 2^31 length prefixes close the connection without allocating",
          "[net]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  long rss_before = rss_kib(s.proc.pid());
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    for (int code = 0; code < 20; ++code) {
      auto op = decode_opcode(d, static_cast<uint8_t>(code));
      if (!op || *op == Op::kGetNumKeys || *op == Op::kCancelWait || *op == Op::kList ||
          *op == Op::kValidate || *op == Op::kPing) {
        continue;
      }
      for (uint64_t len : {uint64_t{1} << 62, uint64_t{1} << 31}) {
        INFO("dialect " << (d == Dialect::kV2 ? "v2" : "v113") << " opcode " << code << " length "
                        << len);
        RawClient c(s.port);
        std::string prefix = d == Dialect::kV2 ? wire::validate() : "";
        // v113 opcode 0 followed by a length whose low half is not the magic.
        c.send(prefix + std::string(1, static_cast<char>(code)) + wire::u64(len));
        CHECK(c.closed_within(2s));
      }
    }
  }
  CHECK(good_client_served(s.port));
  long rss_after = rss_kib(s.proc.pid());
  INFO("rss before " << rss_before << " KiB, after " << rss_after << " KiB");
  CHECK(rss_after - rss_before < 32 * 1024);
}

TEST_CASE("ctorch-store: hundreds of stalled half-sent requests keep memory bounded", "[net]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  long rss_before = rss_kib(s.proc.pid());
  std::vector<std::unique_ptr<RawClient>> stalled;
  constexpr int kStalled = 400;
  for (int i = 0; i < kStalled; ++i) {
    auto c = std::make_unique<RawClient>(s.port);
    // Announces a 60 MiB value (within the limit), sends 100 bytes of it.
    c->send(wire::op(Dialect::kV113, Op::kSet) + wire::str("/big" + std::to_string(i)) +
            wire::u64(60u << 20) + std::string(100, 'x'));
    stalled.push_back(std::move(c));
  }
  std::this_thread::sleep_for(200ms);
  CHECK(good_client_served(s.port));
  long rss_after = rss_kib(s.proc.pid());
  INFO("rss before " << rss_before << " KiB, with " << kStalled << " stalled clients " << rss_after
                     << " KiB");
  // Announced: 400 x 60 MiB = 24 GiB. Allowed: a few KiB of buffer each.
  CHECK(rss_after - rss_before < 48 * 1024);
  stalled.clear();
  std::this_thread::sleep_for(100ms);
  CHECK(good_client_served(s.port));
}

TEST_CASE(
    "ctorch-store: a client that pipelines large GETs and never reads is paused, not "
    "buffered without bound",
    "[net]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  {
    RawClient setter(s.port);
    setter.send(wire::op(Dialect::kV113, Op::kSet) + wire::str("/v") +
                wire::str(std::string(4 << 20, 'v')) + wire::op(Dialect::kV113, Op::kGetNumKeys));
    REQUIRE(setter.recv(8, 10s));
  }
  long rss_before = rss_kib(s.proc.pid());
  RawClient greedy(s.port);
  std::string gets;
  for (int i = 0; i < 500; ++i) gets += wire::op(Dialect::kV113, Op::kGet) + wire::str("/v");
  greedy.send(gets);  // asks for 2 GiB of replies, reads none
  std::this_thread::sleep_for(500ms);
  CHECK(good_client_served(s.port));
  long rss_after = rss_kib(s.proc.pid());
  INFO("rss before " << rss_before << " KiB, after " << rss_after << " KiB");
  CHECK(rss_after - rss_before < 64 * 1024);
}

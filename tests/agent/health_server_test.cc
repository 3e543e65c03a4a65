// The agent's /healthz endpoint (agent/health_server.h): what it reports, and
// that a slow or hostile client affects only itself.

#include "agent/health_server.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/error.h"
#include "tests/support/http_get.h"
#include "tests/support/raw_client.h"

using namespace ctorchrun;
using namespace ctorchrun::agent;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

HealthServerOptions loopback(std::chrono::milliseconds read_timeout = 10s) {
  HealthServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.read_timeout = read_timeout;
  return o;
}

}  // namespace

TEST_CASE("health check: the JSON names state attempt progress and the file timer", "[unit]") {
  HealthStatus s;
  const auto t = std::chrono::system_clock::time_point(std::chrono::seconds(1764032105));
  s.set_run_id("job7");
  auto j = nlohmann::json::parse(s.to_json(t));
  CHECK(j["state"] == "starting");
  CHECK(j["attempt"] == 0);
  CHECK(j["run_id"] == "job7");
  CHECK(j["time"].get<double>() == Approx(1764032105.0));
  CHECK(j["last_progress"].is_null());
  CHECK(j["file_timer"].is_null());
  CHECK(s.alive());
  CHECK_FALSE(s.ready());

  s.set_phase(AgentPhase::kRunning);
  s.set_attempt(2);
  s.set_last_progress(t - 5s);
  s.set_last_progress(t - 9s);  // older: ignored
  s.set_file_timer("/tmp/pipe", [] {
    FileTimerStats f;
    f.last_request = 1764032100.5;
    f.active_timers = 3;
    return f;
  });
  CHECK(s.alive());
  CHECK(s.ready());
  j = nlohmann::json::parse(s.to_json(t));
  CHECK(j["state"] == "running");
  CHECK(j["attempt"] == 2);
  CHECK(j["last_progress"].get<double>() == Approx(1764032100.0));
  CHECK_FALSE(j["file_timer"].contains("path"));  // the pipe is nobody's business
  CHECK(j["file_timer"]["last_request"].get<double>() == Approx(1764032100.5));
  CHECK(j["file_timer"]["active_timers"] == 3);

  for (auto p : {AgentPhase::kRendezvous, AgentPhase::kRestarting, AgentPhase::kStopping,
                 AgentPhase::kFinished}) {
    s.set_phase(p);
    CHECK(s.alive() == (p != AgentPhase::kFinished));
    CHECK_FALSE(s.ready());
    CHECK(nlohmann::json::parse(s.to_json(t))["state"] == phase_name(p));
  }
  // A run id that is no UTF-8 still gives JSON.
  s.set_run_id("bad\xff");
  CHECK_NOTHROW(nlohmann::json::parse(s.to_json(t)));
}

TEST_CASE("health check: the port comes from TORCHELASTIC_HEALTH_CHECK_PORT", "[unit]") {
  std::string error;
  CHECK_FALSE(health_check_port({}, &error).has_value());
  CHECK(error.empty());
  CHECK(health_check_port({{"TORCHELASTIC_HEALTH_CHECK_PORT", "8080"}}, &error) == 8080);
  CHECK(health_check_port({{"TORCHELASTIC_HEALTH_CHECK_PORT", " 0 "}}, &error) == 0);
  for (const char* bad : {"", "abc", "-1", "65536", "99999999999999", "80 80", "0x50"}) {
    error.clear();
    INFO(bad);
    CHECK_FALSE(health_check_port({{"TORCHELASTIC_HEALTH_CHECK_PORT", bad}}, &error).has_value());
    CHECK(error.find("TORCHELASTIC_HEALTH_CHECK_PORT") != std::string::npos);
  }
}

TEST_CASE(
    "health check: GET /healthz answers 200 while the agent runs its job, /readyz while the "
    "workers run",
    "[net]") {
  auto status = std::make_shared<HealthStatus>();
  HealthServer server(loopback(), status);
  REQUIRE(server.port() > 0);

  // Waiting normally (rendezvous, restarting, the exit barrier) is alive:
  // a liveness probe must not restart the pod; not ready.
  for (auto p : {AgentPhase::kStarting, AgentPhase::kRendezvous, AgentPhase::kRestarting,
                 AgentPhase::kStopping}) {
    status->set_phase(p);
    auto live = http_get(server.port(), "/healthz", 5s);
    REQUIRE(live.has_value());
    CHECK(live->status == 200);
    CHECK(nlohmann::json::parse(live->body)["state"] == phase_name(p));
    auto ready = http_get(server.port(), "/readyz", 5s);
    REQUIRE(ready.has_value());
    CHECK(ready->status == 503);
  }
  status->set_phase(AgentPhase::kFinished);
  auto r = http_get(server.port(), "/healthz", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 503);
  CHECK(nlohmann::json::parse(r->body)["state"] == "finished");

  status->set_phase(AgentPhase::kRunning);
  status->set_attempt(1);
  r = http_get(server.port(), "/readyz?verbose=1", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  CHECK(r->raw.find("Content-Type: application/json") != std::string::npos);
  auto j = nlohmann::json::parse(r->body);
  CHECK(j["state"] == "running");
  CHECK(j["attempt"] == 1);

  r = http_get(server.port(), "/metrics", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 404);
  r = http_exchange(server.port(), "POST /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 405);
  r = http_exchange(server.port(), "garbage\r\n\r\n", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 400);
  // HTTP/1.0 clients that end lines with \n alone are answered too.
  r = http_exchange(server.port(), "GET /healthz HTTP/1.0\n\n", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
}

TEST_CASE(
    "health check: a slow client does not hold another up and is dropped after the read "
    "timeout",
    "[net]") {
  auto status = std::make_shared<HealthStatus>();
  status->set_phase(AgentPhase::kRunning);
  HealthServer server(loopback(400ms), status);
  RawClient loris(server.port());
  REQUIRE(loris.send("GET /heal"));
  // Served at once while the slow one hangs on.
  auto r = http_get(server.port(), "/healthz", 2s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  // Nothing answers a request that never ends; its connection goes.
  CHECK(loris.closed_within(5s));
}

TEST_CASE("health check: a huge request head is refused and does not block another client",
          "[net]") {
  auto status = std::make_shared<HealthStatus>();
  status->set_phase(AgentPhase::kRunning);
  HealthServer server(loopback(), status);

  // Exactly the bound, never finished: 431.
  std::string head = "GET /healthz HTTP/1.1\r\nX-Junk: ";
  head += std::string(8192 - head.size(), 'a');
  auto r = http_exchange(server.port(), head, 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 431);

  // A megabyte of header: the connection is cut, others are served meanwhile.
  RawClient flood(server.port());
  std::thread sender([&] { flood.send(head + std::string(1 << 20, 'b')); });
  auto ok = http_get(server.port(), "/healthz", 2s);
  sender.join();
  REQUIRE(ok.has_value());
  CHECK(ok->status == 200);
  CHECK(flood.closed_within(5s));
}

TEST_CASE("health check: past the connection bound the oldest connection makes room", "[net]") {
  auto status = std::make_shared<HealthStatus>();
  status->set_phase(AgentPhase::kRunning);
  auto o = loopback(20s);
  o.max_connections = 2;
  HealthServer server(o, status);
  RawClient idle1(server.port());
  REQUIRE(idle1.send("G"));
  // The server has taken the first before the second comes (accepts are in order).
  REQUIRE(idle1.silent_for(100ms));
  RawClient idle2(server.port());
  REQUIRE(idle2.send("G"));
  REQUIRE(idle2.silent_for(100ms));
  // Both slow clients hold the two places; a new client is still answered,
  // and the oldest slow one is the one that went.
  auto r = http_get(server.port(), "/healthz", 2s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  CHECK(idle1.closed_within(2s));
  // Many slow connections at once lock nobody out either.
  std::vector<std::unique_ptr<RawClient>> flood;
  for (int i = 0; i < 20; ++i) flood.push_back(std::make_unique<RawClient>(server.port()));
  r = http_get(server.port(), "/healthz", 2s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
}

TEST_CASE("health check: a port already taken is an IoError naming it", "[net]") {
  auto status = std::make_shared<HealthStatus>();
  HealthServer first(loopback(), status);
  auto o = loopback();
  o.port = first.port();
  try {
    HealthServer second(o, status);
    FAIL("bound a taken port");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).find(std::to_string(first.port())) != std::string::npos);
  }
}

// --status_port's model and endpoints (agent/job_status.h): what /status and
// /metrics say after a job's events, that the exposition format holds for
// any run id, and that the endpoints hold against concurrent and slow
// clients.

#include "agent/job_status.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "agent/health_server.h"
#include "agent/status_page.h"
#include "tests/support/http_get.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using namespace ctorchrun::agent;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

struct ManualClock {
  std::chrono::system_clock::time_point t{std::chrono::seconds(1764032000)};
  std::function<std::chrono::system_clock::time_point()> fn() {
    return [this] { return t; };
  }
};

JobStatusOptions options(ManualClock& clock, std::string run_id = "job7") {
  JobStatusOptions o;
  o.run_id = std::move(run_id);
  o.rdzv_backend = "c10d";
  o.host = "node-a";
  o.max_restarts = 3;
  o.now = clock.fn();
  return o;
}

// A two-node round, node 0 here with ranks 0-1, a failure of rank 1 and a
// restart, then node 1 lost and a re-formed round.
void play_job(JobStatus& s, ManualClock& clock) {
  s.rendezvous_started();
  clock.t += 250ms;
  s.round_formed(0, 0, 0, 2, {{0, "node-a", "present", 2, 0}, {1, "node-b", "present", 2, 2}}, 4);
  s.workers_started(0, 0, {101, 102});
  clock.t += 10s;
  s.worker_exited(1, true);
  StatusFailure f;
  f.time = 1764032010;
  f.attempt = 0;
  f.rank = 1;
  f.node = 0;
  f.host = "node-a";
  f.cause = "exit code 3";
  s.attempt_failed(f, clock.t - 40ms, false);
  s.restart(RestartReason::kFailure, 1, "rank 1 failed with exit code 3");
  clock.t += 1s;
  s.workers_started(1, 0, {103, 104});
  clock.t += 5s;
  s.node_lost(1, "agent exited", false);
  s.restart(RestartReason::kMembership, 1, "node 1 lost");
  s.rendezvous_started();
  clock.t += 2s;
  s.round_formed(1, 1, 0, 1, {{0, "node-a", "present", 2, 0}}, 2);
  s.workers_started(1, 0, {105, 106});
}

// The value of the sample `series` (name and labels as written) in `text`.
std::optional<double> sample_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
}

// promtool's verdict on `text` (Debian's prometheus package, which
// scripts/setup.sh installs): its exit code and output.
std::pair<int, std::string> promtool_check(const std::string& text) {
  TempDir d;
  std::ofstream(d.file("metrics.txt")) << text;
  const std::string cmd = "promtool check metrics < " + d.file("metrics.txt") + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

}  // namespace

TEST_CASE("status: /status names the nodes ranks restarts and failures of the job", "[unit]") {
  ManualClock clock;
  JobStatus s(options(clock));
  play_job(s, clock);
  auto j = nlohmann::json::parse(s.status_json());
  CHECK(j["run_id"] == "job7");
  CHECK(j["rdzv_backend"] == "c10d");
  CHECK(j["state"] == "running");
  CHECK(j["attempt"] == 1);
  CHECK(j["round"] == 1);
  CHECK(j["world_size"] == 2);
  CHECK(j["restarts"]["failure"] == 1);
  CHECK(j["restarts"]["membership"] == 1);
  CHECK(j["restarts"]["hang"] == 0);
  CHECK(j["worker_failures"] == 1);
  REQUIRE(j["nodes"].size() == 2);
  CHECK(j["nodes"][0]["state"] == "present");
  CHECK(j["nodes"][1]["host"] == "node-b");
  CHECK(j["nodes"][1]["state"] == "lost");  // kept after the round without it
  REQUIRE(j["ranks"].size() == 2);
  CHECK(j["ranks"][1]["pid"] == 106);
  CHECK(j["ranks"][1]["state"] == "running");
  REQUIRE(j["failures"].size() == 1);
  CHECK(j["failures"][0]["cause"] == "exit code 3");
  CHECK(j["failures"][0]["rank"] == 1);
  std::vector<std::string> events;
  for (const auto& e : j["history"]) events.push_back(e["event"]);
  CHECK(std::count(events.begin(), events.end(), "restart") == 2);
  CHECK(std::count(events.begin(), events.end(), "node_lost") == 1);
  CHECK(j["store"].is_null());
  CHECK(j["hang"]["enabled"] == false);
}

TEST_CASE("status: /metrics counts restarts by reason and times detection and recovery", "[unit]") {
  ManualClock clock;
  JobStatus s(options(clock));
  play_job(s, clock);
  const std::string m = s.metrics_text();
  CHECK(sample_value(m, "ctorchrun_restarts_total{reason=\"failure\"}") == 1);
  CHECK(sample_value(m, "ctorchrun_restarts_total{reason=\"membership\"}") == 1);
  CHECK(sample_value(m, "ctorchrun_restarts_total{reason=\"hang\"}") == 0);
  CHECK(sample_value(m, "ctorchrun_worker_failures_total") == 1);
  CHECK(sample_value(m, "ctorchrun_nodes{state=\"lost\"}") == 1);
  CHECK(sample_value(m, "ctorchrun_nodes{state=\"present\"}") == 1);
  CHECK(sample_value(m, "ctorchrun_agent_state{state=\"running\"}") == 1);
  CHECK(sample_value(m, "ctorchrun_workers{state=\"running\"}") == 2);
  // Two rounds formed: 0.25 s and 2 s.
  CHECK(sample_value(m, "ctorchrun_rendezvous_duration_seconds_count") == 2);
  CHECK(sample_value(m, "ctorchrun_rendezvous_duration_seconds_sum") == Approx(2.25));
  CHECK(sample_value(m, "ctorchrun_rendezvous_duration_seconds_bucket{le=\"0.25\"}") == 1);
  // The failure, 40 ms old when known; recovered 1.04 s after it; the node
  // lost at once, recovered 2 s later.
  CHECK(sample_value(m, "ctorchrun_fault_detection_latency_seconds_sum") == Approx(0.04));
  CHECK(sample_value(m, "ctorchrun_restart_latency_seconds_count") == 2);
  CHECK(sample_value(m, "ctorchrun_restart_latency_seconds_sum") == Approx(3.04));
  CHECK(sample_value(m, "ctorchrun_restart_latency_seconds_bucket{le=\"1\"}") == 0);
  CHECK(sample_value(m, "ctorchrun_restart_latency_seconds_bucket{le=\"2.5\"}") == 2);
  CHECK(m.find("ctorchrun_info{version=\"") != std::string::npos);
}

TEST_CASE("status: per-rank samples and the hosted store's requests are in /metrics", "[unit]") {
  ManualClock clock;
  JobStatus s(options(clock));
  play_job(s, clock);
  StatusRank r;
  r.pid = 105;
  r.cpu_s = 12.5;
  r.rss_bytes = 1 << 20;
  r.stalled_s = 3.5;
  r.last_progress = 1764032100.0;
  s.set_samples({r});
  StoreFigures store;
  store.role = "rendezvous";
  store.stats.keys = 17;
  store.stats.open_connections = 4;
  store.stats.requests_by_op[static_cast<size_t>(store::protocol::Op::kSet)] = 9;
  s.set_stores({store});
  const std::string m = s.metrics_text();
  CHECK(sample_value(m, "ctorchrun_worker_cpu_seconds_total{local_rank=\"0\",rank=\"0\"}") == 12.5);
  CHECK(sample_value(m, "ctorchrun_worker_resident_memory_bytes{local_rank=\"0\",rank=\"0\"}") ==
        1048576);
  CHECK(sample_value(m, "ctorchrun_worker_seconds_since_progress{local_rank=\"0\",rank=\"0\"}") ==
        3.5);
  CHECK(sample_value(m, "ctorchrun_store_keys{role=\"rendezvous\"}") == 17);
  CHECK(sample_value(m, "ctorchrun_store_requests_total{role=\"rendezvous\",op=\"set\"}") == 9);
  auto j = nlohmann::json::parse(s.status_json());
  CHECK(j["ranks"][0]["cpu_s"] == 12.5);
  CHECK(j["ranks"][0]["stalled_s"] == 3.5);
  CHECK(j["store"]["keys"] == 17);
  CHECK(j["store"]["requests"]["set"] == 9);
}

TEST_CASE("status: promtool accepts /metrics whatever bytes the run id holds", "[unit]") {
  ManualClock clock;
  for (std::string run_id : {std::string("job7"), std::string("a\"b\\c\nd"),
                             std::string("bad\xff\xfeutf8"), std::string(600, 'x')}) {
    JobStatus s(options(clock, run_id));
    play_job(s, clock);
    StoreFigures store;
    store.role = "job";
    s.set_stores({store});
    auto [rc, out] = promtool_check(s.metrics_text());
    INFO("run id " << run_id << ":\n" << out);
    CHECK(rc == 0);
    CHECK(out.find("error") == std::string::npos);
    // /status stays JSON, the bytes shown as U+FFFD.
    CHECK_NOTHROW(nlohmann::json::parse(s.status_json()));
  }
}

TEST_CASE("status: the history and failures are bounded however long the job runs", "[unit]") {
  ManualClock clock;
  JobStatus s(options(clock));
  StatusFailure f;
  f.cause = "exit code 1";
  for (int i = 0; i < 5000; ++i) {
    s.attempt_failed(f, clock.t, false);
    s.restart(RestartReason::kFailure, i + 1, "again");
  }
  auto j = nlohmann::json::parse(s.status_json());
  CHECK(j["failures"].size() == 20);
  CHECK(j["history"].size() == 100);
  CHECK(j["restarts"]["failure"] == 5000);
}

TEST_CASE("status: the server answers /metrics /status and the page, and 404 elsewhere", "[net]") {
  ManualClock clock;
  auto job = std::make_shared<JobStatus>(options(clock));
  play_job(*job, clock);
  HealthServerOptions o;
  o.host = "127.0.0.1";
  HealthServer server(o, std::make_shared<HealthStatus>(), job);
  auto r = http_get(server.port(), "/metrics", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  CHECK(r->raw.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(sample_value(r->body, "ctorchrun_restarts_total{reason=\"failure\"}") == 1);
  r = http_get(server.port(), "/status", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  CHECK(nlohmann::json::parse(r->body)["run_id"] == "job7");
  r = http_get(server.port(), "/", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  CHECK(r->raw.find("Content-Type: text/html") != std::string::npos);
  CHECK(r->body.find("status") != std::string::npos);
  r = http_get(server.port(), "/env", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 404);
  // The health check's endpoints are the same server's.
  r = http_get(server.port(), "/healthz", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
}

TEST_CASE("status: many concurrent scrapers while the job changes are all answered", "[net]") {
  ManualClock clock;
  auto job = std::make_shared<JobStatus>(options(clock));
  HealthServerOptions o;
  o.host = "127.0.0.1";
  HealthServer server(o, std::make_shared<HealthStatus>(), job);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    // The agent's side goes on meanwhile: nothing waits for a scraper.
    for (int i = 0; !stop; ++i) {
      job->restart(RestartReason::kFailure, i, "again");
      job->workers_started(i, 0, {100, 101, 102, 103});
    }
  });
  std::atomic<int> ok{0};
  std::vector<std::thread> scrapers;
  for (int t = 0; t < 16; ++t) {
    scrapers.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) {
        auto r = http_get(server.port(), t % 2 ? "/metrics" : "/status", 10s);
        if (r && r->status == 200) ++ok;
      }
    });
  }
  for (auto& s : scrapers) s.join();
  stop = true;
  writer.join();
  CHECK(ok == 160);
}

TEST_CASE("status: a scraper that never reads its answer holds up no one else", "[net]") {
  ManualClock clock;
  auto job = std::make_shared<JobStatus>(options(clock));
  StatusRank r;
  std::vector<pid_t> pids;
  for (int i = 0; i < 512; ++i) pids.push_back(1000 + i);  // a large /metrics
  job->workers_started(0, 0, pids);
  HealthServerOptions o;
  o.host = "127.0.0.1";
  o.read_timeout = 2s;
  HealthServer server(o, std::make_shared<HealthStatus>(), job);
  // Slow clients: their requests sent, their answers never read.
  std::vector<int> slow;
  for (int i = 0; i < 8; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int small = 1024;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    const std::string req = "GET /metrics HTTP/1.1\r\n\r\n";
    REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
    slow.push_back(fd);
  }
  for (int i = 0; i < 5; ++i) {
    auto reply = http_get(server.port(), "/status", 5s);
    REQUIRE(reply.has_value());
    CHECK(reply->status == 200);
  }
  for (int fd : slow) ::close(fd);
}

TEST_CASE("status: the page is self-contained and marks what the browser test reads", "[unit]") {
  const std::string& page = status_page_html();
  REQUIRE(page.size() > 1000);
  CHECK(page.rfind("<!doctype html>", 0) == 0);
  // No CDN, no external script, style, font or image: the machines have no
  // internet.
  for (const char* external : {"src=\"http", "href=\"http", "@import", "//cdn", "url(http"}) {
    INFO(external);
    CHECK(page.find(external) == std::string::npos);
  }
  for (const char* mark : {"id=\"nodes\"", "id=\"agent-state\"", "id=\"attempt\"", "id=\"banner\"",
                           "id=\"history\"", "data-rank", "data-node", "fetch(\"status\""}) {
    INFO(mark);
    CHECK(page.find(mark) != std::string::npos);
  }
  // Text from the agent goes through textContent, never markup.
  CHECK(page.find("innerHTML") == std::string::npos);
}

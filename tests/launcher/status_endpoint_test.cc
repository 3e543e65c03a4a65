// --status_port on real jobs: static, c10d and etcd-v3 agents serve the job
// as they know it (/status, /metrics), a port taken leaves the job running,
// and a real Prometheus scrapes two agents through a worker crash and a
// node lost.

#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/etcd_server.h"
#include "tests/support/http_get.h"
#include "tests/support/raw_client.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

std::optional<json> get_json(int port, const std::string& path) {
  auto r = http_get(port, path, 5s);
  if (!r || r->status != 200) return std::nullopt;
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// Polls GET /status until `ok` holds (every 100 ms, up to `timeout`); the
// last answer either way (null when none came).
json await_status(int port, const std::function<bool(const json&)>& ok,
                  std::chrono::milliseconds timeout = 60s) {
  json last;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto j = get_json(port, "/status")) {
      last = *j;
      try {
        if (ok(last)) return last;
      } catch (const json::exception&) {
        // A field not there yet.
      }
    }
    std::this_thread::sleep_for(100ms);
  }
  return last;
}

std::string metrics(int port) {
  auto r = http_get(port, "/metrics", 5s);
  return r && r->status == 200 ? r->body : std::string();
}

bool has_line(const std::string& text, const std::string& line) {
  return ("\n" + text).find("\n" + line + "\n") != std::string::npos;
}

// A worker that appends a line to `seen`, exits 3 when `crash_once` is not
// empty and it is the first to make that folder, else runs until `stop`.
std::vector<std::string> worker(const std::string& seen, const std::string& stop,
                                const std::string& crash_once = "") {
  std::string script = "echo \"$WORLD_SIZE $RANK\" >> " + seen + "; ";
  if (!crash_once.empty()) {
    // mkdir is atomic: one worker of the node fails, whatever the others do.
    script += "if mkdir " + crash_once + " 2>/dev/null; then exit 3; fi; ";
  }
  script += "i=0; while [ ! -e " + stop + " ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
  return sh(script);
}

// A real Prometheus (Debian's prometheus) scraping `targets` every second,
// on a free loopback port; stopped by pid.
struct Prometheus {
  explicit Prometheus(const std::vector<int>& targets) {
    std::string list;
    for (int t : targets)
      list += std::string(list.empty() ? "" : ", ") + "'127.0.0.1:" + std::to_string(t) + "'";
    std::ofstream(d.file("prometheus.yml"))
        << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "scrape_configs:\n  - job_name: ctorchrun\n    scrape_interval: 1s\n"
        << "    static_configs:\n      - targets: [" << list << "]\n";
    port = free_port();
    process = std::make_unique<Process>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + d.file("prometheus.yml"),
                                 "--storage.tsdb.path=" + d.file("data"),
                                 "--web.listen-address=127.0.0.1:" + std::to_string(port),
                                 "--log.level=warn"},
        std::map<std::string, std::string>{}, /*capture_stderr=*/true);
  }
  ~Prometheus() {
    process->signal(SIGTERM);
    if (!process->wait(10s)) process->signal(SIGKILL);
  }
  bool ready(std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      auto r = http_get(port, "/-/ready", 2s);
      if (r && r->status == 200) return true;
      std::this_thread::sleep_for(200ms);
    }
    return false;
  }
  // The instant vector of PromQL `expr` (percent-encoded by the caller).
  json query(const std::string& encoded) const {
    auto r = http_get(port, "/api/v1/query?query=" + encoded, 5s);
    if (!r || r->status != 200) return json::array();
    json j = json::parse(r->body, nullptr, false);
    if (j.is_discarded() || j["status"] != "success") return json::array();
    return j["data"]["result"];
  }
  // Polls `encoded` until one series' value is `want` (or more, `at_least`).
  bool await_value(const std::string& encoded, double want, bool at_least,
                   std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      for (const auto& s : query(encoded)) {
        const double v = std::stod(s["value"][1].get<std::string>());
        if (at_least ? v >= want : v == want) return true;
      }
      std::this_thread::sleep_for(500ms);
    }
    return false;
  }
  TempDir d;
  int port = 0;
  std::unique_ptr<Process> process;
};

}  // namespace

TEST_CASE("status port: a static job's /status and /metrics show a worker's failure and restart",
          "[multiproc]") {
  TempDir d;
  const int port = free_port();
  auto job =
      start_ctorchrun(concat({"--nproc_per_node=2", "--max_restarts=1",
                              "--status_port=" + std::to_string(port), "--status_host=127.0.0.1"},
                             worker(d.file("seen"), d.file("stop"), d.file("crashed"))));
  json s = await_status(port, [](const json& j) {
    return j["attempt"] == 1 && j["state"] == "running" && j["ranks"].size() == 2 &&
           !j["store"].is_null();  // the store's figures: sampled once a second
  });
  INFO(s.dump(1));
  CHECK(s["rdzv_backend"] == "static");
  CHECK(s["restarts"]["failure"] == 1);
  CHECK(s["worker_failures"] == 1);
  REQUIRE(s["failures"].size() == 1);
  CHECK(s["failures"][0]["cause"] == "exit code 3");
  CHECK(s["nodes"].size() == 1);
  CHECK(s["ranks"][0]["pid"].get<int>() > 0);
  CHECK(s["store"]["role"] == "job");
  s = await_status(port, [](const json& j) {
    return !j["ranks"][0]["cpu_s"].is_null() && j["ranks"][0]["rss_bytes"] > 0;
  });
  CHECK(s["ranks"][0]["rss_bytes"].get<int64_t>() > 0);
  const std::string m = metrics(port);
  CHECK(has_line(m, "ctorchrun_restarts_total{reason=\"failure\"} 1"));
  CHECK(has_line(m, "ctorchrun_workers{state=\"running\"} 2"));
  CHECK(has_line(m, "ctorchrun_restart_latency_seconds_count 1"));
  CHECK(m.find("ctorchrun_store_requests_total{role=\"job\",op=\"set\"}") != std::string::npos);
  // The page is there too, and the health check's endpoints.
  auto page = http_get(port, "/", 5s);
  REQUIRE(page.has_value());
  CHECK(page->status == 200);
  std::ofstream(d.file("stop")) << "x";
  CHECK(job->exit_code(60s) == 0);
}

TEST_CASE("status port: a port already taken is a warning and the job runs without it",
          "[multiproc]") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=1",
                          "--status_port=" + std::to_string(port), "--no_python", "/bin/true"},
                         {}, 60s);
  ::close(fd);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(count_lines_with(r.output, "without a status endpoint") == 1);
  CHECK(r.output.find(std::to_string(port)) != std::string::npos);
}

TEST_CASE(
    "status port: an agent stopped while clients hold half-sent requests exits at once and "
    "closes them",
    "[multiproc]") {
  TempDir d;
  const int port = free_port();
  auto job = start_ctorchrun(concat(
      {"--nproc_per_node=1", "--status_port=" + std::to_string(port), "--status_host=127.0.0.1"},
      worker(d.file("seen"), d.file("stop"))));
  REQUIRE(wait_for_lines(d.file("seen"), 1, 60s));
  REQUIRE(wait_for_port(port, 30s));
  RawClient half(port);
  REQUIRE(half.send("GET /metr"));  // never finished
  RawClient garbage(port);
  REQUIRE(garbage.send(std::string("\x16\x03\x01\x00\xff", 5)));  // a TLS hello, say
  auto r = http_get(port, "/status", 5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
  job->signal(SIGTERM);
  CHECK(job->exit_code(30s) == 143);  // the clients hold nothing up
  CHECK(half.closed_within(5s));
  CHECK(garbage.closed_within(5s));
}

TEST_CASE("status port: a port out of range or a host that is no address is a usage error",
          "[multiproc]") {
  auto r = run_ctorchrun({"--status_port=70000", "--no_python", "/bin/true"}, {}, 30s);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--status_port") != std::string::npos);
  r = run_ctorchrun({"--status_port=0", "--status_host=node-a", "--no_python", "/bin/true"}, {},
                    30s);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--status_host: 'node-a' is no IP address") != std::string::npos);
  r = run_ctorchrun({"--status_port=0", "--status_host=[::1]", "--no_python", "/bin/true"}, {},
                    30s);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("status endpoint listening on ::1:") != std::string::npos);
}

TEST_CASE("status port: a c10d agent shows the node it lost and the re-formed round",
          "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const int status_a = free_port(), status_b = free_port();
  auto agent = [&](const std::string& name, int status_port) {
    return start_ctorchrun(
        concat({"--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=st",
                "--rdzv_conf=join_timeout=60,last_call_timeout=1", "--max_restarts=0",
                "--status_port=" + std::to_string(status_port), "--status_host=127.0.0.1"},
               worker(d.file(name), d.file("stop"))));
  };
  auto a = agent("a", status_a);
  REQUIRE(wait_for_port(std::stoi(port), 30s));  // a hosts the endpoint's store
  auto b = agent("b", status_b);
  json s = await_status(
      status_a, [](const json& j) { return j["world_size"] == 2 && j["state"] == "running"; });
  INFO(s.dump(1));
  REQUIRE(s["nodes"].size() == 2);
  b->signal(SIGKILL);
  s = await_status(status_a, [](const json& j) {
    return j["restarts"]["membership"] == 1 && j["world_size"] == 1 && j["state"] == "running" &&
           !j["stores"].empty();  // sampled once a second
  });
  INFO(s.dump(1));
  CHECK(s["restarts"]["membership"] == 1);
  CHECK(s["restarts"]["failure"] == 0);
  int lost = 0;
  for (const auto& n : s["nodes"]) lost += n["state"] == "lost" ? 1 : 0;
  CHECK(lost == 1);
  std::vector<std::string> roles;
  for (const auto& st : s["stores"]) roles.push_back(st["role"]);
  CHECK(std::count(roles.begin(), roles.end(), "rendezvous") == 1);
  const std::string m = metrics(status_a);
  CHECK(has_line(m, "ctorchrun_nodes{state=\"lost\"} 1"));
  CHECK(has_line(m, "ctorchrun_restarts_total{reason=\"membership\"} 1"));
  CHECK(has_line(m, "ctorchrun_restart_latency_seconds_count 1"));
  std::ofstream(d.file("stop")) << "x";
  CHECK(a->exit_code(60s) == 0);
}

TEST_CASE("status port: an etcd-v3 agent serves its view of the job", "[multiproc]") {
  EtcdCluster etcd(1);
  TempDir d;
  const int status = free_port();
  auto a =
      start_ctorchrun(concat({"--nnodes=1:2", "--nproc_per_node=2", "--rdzv_backend=etcd-v3",
                              "--rdzv_endpoint=" + etcd.client_endpoint(0), "--rdzv_id=st-etcd",
                              "--rdzv_conf=join_timeout=30,last_call_timeout=1",
                              "--status_port=" + std::to_string(status), "--status_host=127.0.0.1"},
                             worker(d.file("seen"), d.file("stop"))));
  json s = await_status(
      status, [](const json& j) { return j["state"] == "running" && j["ranks"].size() == 2; });
  INFO(s.dump(1));
  CHECK(s["rdzv_backend"] == "etcd-v3");
  CHECK(s["world_size"] == 2);
  CHECK(s["nodes"].size() == 1);
  CHECK(has_line(metrics(status), "ctorchrun_agent_state{state=\"running\"} 1"));
  std::ofstream(d.file("stop")) << "x";
  CHECK(a->exit_code(60s) == 0);
}

TEST_CASE(
    "status port: a real Prometheus scraping two c10d agents sees a restart by reason, the lost "
    "node and a restart latency",
    "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  const int status_a = free_port(), status_b = free_port();
  Prometheus prom({status_a, status_b});
  REQUIRE(prom.ready(30s));
  auto agent = [&](const std::string& name, int status_port, const std::string& crash) {
    return start_ctorchrun(
        concat({"--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=prom",
                "--rdzv_conf=join_timeout=60,last_call_timeout=1", "--max_restarts=1",
                "--status_port=" + std::to_string(status_port), "--status_host=127.0.0.1"},
               worker(d.file(name), d.file("stop"), crash)));
  };
  auto a = agent("a", status_a, "");
  REQUIRE(wait_for_port(std::stoi(port), 30s));
  // b's worker fails once, in the first attempt of the two-node round.
  auto b = agent("b", status_b, d.file("crashed"));
  json s = await_status(status_a, [](const json& j) {
    return j["restarts"]["failure"] == 1 && j["state"] == "running" && j["world_size"] == 2;
  });
  INFO(s.dump(1));
  REQUIRE(s["restarts"]["failure"] == 1);
  // Both agents scraped since (each counts the job's restart), then b's node
  // is lost.
  for (int p : {status_a, status_b}) {
    CHECK(prom.await_value(
        "ctorchrun_restarts_total%7Breason%3D%22failure%22%2Cinstance%3D%22127.0.0.1%3A" +
            std::to_string(p) + "%22%7D",
        1, false, 30s));
  }
  b->signal(SIGKILL);
  s = await_status(status_a, [](const json& j) {
    return j["restarts"]["membership"] == 1 && j["state"] == "running";
  });
  CHECK(s["restarts"]["membership"] == 1);
  CHECK(prom.await_value("ctorchrun_restarts_total%7Breason%3D%22membership%22%7D", 1, false, 30s));
  CHECK(prom.await_value("ctorchrun_nodes%7Bstate%3D%22lost%22%7D", 1, false, 30s));
  CHECK(prom.await_value("ctorchrun_restart_latency_seconds_count", 2, true, 30s));
  // Both agents were scraped while alive.
  CHECK(prom.query("count%20by%20(instance)%20(count_over_time(ctorchrun_info%5B5m%5D))").size() ==
        2);
  std::ofstream(d.file("stop")) << "x";
  CHECK(a->exit_code(60s) == 0);
}

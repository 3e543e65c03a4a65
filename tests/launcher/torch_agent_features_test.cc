// torch's agent features through the real launcher: the file timer
// (TORCHELASTIC_ENABLE_FILE_TIMER) with torch's own FileTimerClient and
// expires() in the workers (torch 1.13, and 2.6 under the torch2 label), and
// the /healthz endpoint (TORCHELASTIC_HEALTH_CHECK_PORT).

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/http_get.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

const std::string kTimerWorker = CTORCHRUN_SOURCE_DIR "/tests/launcher/py/timer_worker.py";

// The port of "health check listening on HOST:PORT" in `p`'s output, 0 if no
// such line came within the timeout.
int health_port(Process& p, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string needle = "health check listening on ";
  while (std::chrono::steady_clock::now() < deadline) {
    auto line = p.read_line(std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now()));
    if (!line) return 0;
    auto at = line->find(needle);
    if (at == std::string::npos) continue;
    auto colon = line->find(':', at + needle.size());
    if (colon == std::string::npos) return 0;
    return std::atoi(line->c_str() + colon + 1);
  }
  return 0;
}

// The lines of the events file whose "event" is `name`, parsed.
std::vector<nlohmann::json> events_named(const std::string& path, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& line : lines_of(path)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == name) out.push_back(j);
  }
  return out;
}

}  // namespace

TEST_CASE("ctorchrun: a rank stuck past its torch expires() timer is killed and the job fails",
          "[torch]") {
  TempDir d;
  const std::string pipe = d.file("timer.pipe");
  auto r = run_ctorchrun(
      {"--nproc_per_node=2", "--master_port=" + std::to_string(free_port()), kTimerWorker,
       "--after", "1", "--sleep", "5", "--record", d.path, "--after-others"},
      {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}}, 120s);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  // Every worker was given the pipe (counted in the text, not per line: the
  // two workers share the console and their lines may interleave).
  size_t given = 0;
  for (size_t at = r.output.find("timer_file=" + pipe); at != std::string::npos;
       at = r.output.find("timer_file=" + pipe, at + 1)) {
    ++given;
  }
  CHECK(given == 2);
  // Rank 0 was killed inside its 5 s sleep, by the file timer, with torch's
  // default signal; rank 1's timer never expired and it finished.
  CHECK(file_exists(d.file("attempt0_rank0")));
  CHECK_FALSE(file_exists(d.file("done_attempt0_rank0")));
  CHECK(file_exists(d.file("done_attempt0_rank1")));
  CHECK(count_lines_with(r.output, "file timer: pid " + read_file(d.file("attempt0_rank0")) +
                                       " timer expired") == 1);
  CHECK(r.output.find("failed with signal 9 (SIGKILL)") != std::string::npos);
  // The pipe goes with the launcher.
  CHECK_FALSE(file_exists(pipe));
}

TEST_CASE(
    "ctorchrun: a rank killed by its torch timer restarts under --max_restarts and "
    "/healthz answers while the workers run",
    "[torch]") {
  TempDir d;
  auto p = start_ctorchrun(
      {"--nproc_per_node=2", "--max_restarts=1", "--master_port=" + std::to_string(free_port()),
       "--events_file=" + d.file("events.jsonl"), kTimerWorker, "--after", "5", "--sleep", "60",
       "--stuck-attempts", "1", "--record", d.path},
      {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_HEALTH_CHECK_PORT", "0"}});
  const int port = health_port(*p, 60s);
  REQUIRE(port > 0);
  REQUIRE(wait_for_file(d.file("attempt0_rank0"), 60s));
  // Rank 0 holds its timer for 5 s: the endpoint shows the running workers
  // and the timer.
  nlohmann::json seen;
  const bool answered = [&] {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto reply = http_get(port, "/readyz", 2s);
      if (reply && reply->status == 200) {
        seen = nlohmann::json::parse(reply->body);
        if (seen["file_timer"]["active_timers"].get<int>() >= 1) return true;
      }
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }();
  INFO(seen.dump());
  CHECK(answered);
  CHECK(seen["state"] == "running");
  CHECK(seen["attempt"] == 0);
  CHECK_FALSE(seen["file_timer"].contains("path"));  // never published
  CHECK(seen["file_timer"]["last_request"].is_number());
  CHECK(seen.contains("last_progress"));

  std::string output = p->read_all(120s);
  INFO(output);
  CHECK(p->exit_code(10s) == 0);
  CHECK(file_exists(d.file("done_attempt1_rank0")));
  CHECK_FALSE(file_exists(d.file("done_attempt0_rank0")));
  auto expired = events_named(d.file("events.jsonl"), "file_timer_expired");
  REQUIRE(expired.size() == 1);
  CHECK(expired[0]["killed"] == true);
  CHECK(expired[0]["local_rank"] == 0);
  CHECK(expired[0]["signal"] == "SIGKILL");
  CHECK(expired[0]["attempt"] == 0);
  CHECK(events_named(d.file("events.jsonl"), "restart").size() == 1);
}

TEST_CASE("ctorchrun: a file timer line naming a process that is no worker kills nothing",
          "[multiproc]") {
  TempDir d;
  Process stranger({"/bin/sleep", "60"});
  const std::string line = "{\"version\": 1, \"pid\": " + std::to_string(stranger.pid()) +
                           ", \"scope_id\": \"x\", \"expiration_time\": 1, \"signal\": 9}";
  // The worker writes junk, the stranger's timer, then a timer of its own
  // (SIGTERM) behind them: the server reads them in order, so the worker's
  // death proves the stranger's line was handled.
  const std::string body =
      "printf 'junk\\n{\"pid\": 1}\\n' > \"$TORCHELASTIC_TIMER_FILE\"; "
      "printf '%s\\n' '" +
      line +
      "' > \"$TORCHELASTIC_TIMER_FILE\"; "
      "printf '{\"version\": 1, \"pid\": %d, \"scope_id\": \"self\", \"expiration_time\": 1, "
      "\"signal\": 15}\\n' $$ > \"$TORCHELASTIC_TIMER_FILE\"; "
      "sleep 60; echo not-killed";
  auto r = run_ctorchrun(concat({"--standalone", "--nproc_per_node=1"}, sh(body)),
                         {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}}, 60s);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("failed with signal 15 (SIGTERM)") != std::string::npos);
  CHECK(r.output.find("not-killed") == std::string::npos);
  CHECK(count_lines_with(r.output, "pid " + std::to_string(stranger.pid()) + " timer expired") ==
        1);
  CHECK(r.output.find("no worker of this agent") != std::string::npos);
  CHECK(count_lines_with(r.output, "file timer: ignored a line") >= 1);
  CHECK_FALSE(stranger.wait(100ms).has_value());  // alive
}

TEST_CASE("ctorchrun: a health check port already taken leaves the job running without it",
          "[multiproc]") {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  auto r = run_ctorchrun({"--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"},
                         {{"TORCHELASTIC_HEALTH_CHECK_PORT", std::to_string(port)}}, 60s);
  ::close(fd);
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(count_lines_with(r.output, "without a health check") == 1);
  CHECK(r.output.find(std::to_string(port)) != std::string::npos);
}

TEST_CASE(
    "ctorchrun: TORCHELASTIC_TIMER_FILE naming a file that is no pipe is a usage error and "
    "the file stays",
    "[multiproc]") {
  TempDir d;
  const std::string path = d.file("notes.txt");
  { std::ofstream(path) << "keep me"; }
  auto r = run_ctorchrun(
      {"--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"},
      {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", path}}, 60s);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("is not a named pipe") != std::string::npos);
  CHECK(read_file(path) == "keep me");
}

TEST_CASE("ctorchrun: the file timer's pipe goes when the launcher is stopped by SIGTERM",
          "[multiproc]") {
  TempDir d;
  const std::string pipe = d.file("timer.pipe");
  auto p =
      start_ctorchrun(concat({"--standalone", "--nproc_per_node=1"}, sh("sleep 60")),
                      {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}});
  REQUIRE(wait_for_line(*p, "started 1 workers", 30s));
  CHECK(file_exists(pipe));
  p->signal(SIGTERM);
  CHECK(p->exit_code(30s) == 143);
  CHECK_FALSE(file_exists(pipe));
}

TEST_CASE(
    "ctorchrun: /healthz stays 200 while node 0 waits in its exit barrier for a node still "
    "running, and /readyz says its workers are done",
    "[multiproc]") {
  TempDir d;
  const std::string port = std::to_string(free_port());
  auto node = [&](int rank, std::map<std::string, std::string> env) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                "--status_host=127.0.0.1"},
               sh("if [ $GROUP_RANK = 0 ]; then exit 0; fi; i=0; while [ ! -e " + d.file("stop") +
                  " ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done")),
        std::move(env));
  };
  auto n0 = node(0, {{"TORCHELASTIC_HEALTH_CHECK_PORT", "0"}});
  auto n1 = node(1, {});
  const int health = health_port(*n0, 60s);
  REQUIRE(health > 0);
  // Node 0's worker is done at once; node 0 then waits for node 1.
  nlohmann::json seen;
  int live = 0, ready = 0;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto h = http_get(health, "/healthz", 2s);
    auto r = http_get(health, "/readyz", 2s);
    if (h && r && h->status == 200) {
      seen = nlohmann::json::parse(h->body);
      if (seen["state"] != "running" && seen["state"] != "starting" &&
          seen["state"] != "rendezvous") {
        live = h->status;
        ready = r->status;
        break;
      }
    }
    std::this_thread::sleep_for(50ms);
  }
  INFO(seen.dump());
  CHECK(live == 200);   // a liveness probe keeps the pod (and the job's store)
  CHECK(ready == 503);  // no workers of its own run
  std::ofstream(d.file("stop")) << "x";
  CHECK(n0->exit_code(60s) == 0);
  CHECK(n1->exit_code(60s) == 0);
}

// The live page (GET /) in a real browser: headless Chromium, driven through
// the DevTools protocol by tests/launcher/page_driver.py, draws a running
// two-node job, follows it through a restart, and says plainly when the
// agent is gone.

#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/launcher/launcher_support.h"
#include "tests/support/http_get.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

// What the browser shows, as page_driver.py last wrote it; polled until `ok`
// holds (up to `timeout`); the last snapshot either way.
json await_page(const std::string& dir, const std::function<bool(const json&)>& ok,
                std::chrono::milliseconds timeout = 60s) {
  json last;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(dir + "/dom.json");
    json j = json::parse(in, nullptr, false);
    if (!j.is_discarded() && j.is_object()) {
      last = j;
      try {
        if (ok(last)) return last;
      } catch (const json::exception&) {
        // Not drawn yet.
      }
    }
    std::this_thread::sleep_for(100ms);
  }
  return last;
}

// The state the page gives global rank `rank` ("" when it draws no such rank).
std::string rank_state(const json& page, int rank) {
  for (const auto& r : page["ranks"]) {
    if (r["rank"] == rank) return r["state"];
  }
  return "";
}

// Every rank of the 2 x 2 job drawn, this node's (0 and 1) running; the
// other node's ranks are drawn in that node's state.
bool all_ranks_drawn(const json& page) {
  for (int r = 0; r < 4; ++r) {
    if (rank_state(page, r).empty()) return false;
  }
  return rank_state(page, 0) == "running" && rank_state(page, 1) == "running";
}

bool has_event(const json& page, const std::string& event) {
  for (const auto& e : page["history"]) {
    if (e == event) return true;
  }
  return false;
}

}  // namespace

TEST_CASE(
    "status page: headless Chromium draws every rank of a two-node job, follows a restart and "
    "says when the agent is gone",
    "[multiproc]") {
  TempDir d;
  const std::string master = std::to_string(free_port());
  const int status0 = free_port(), status1 = free_port();
  // Rank 3 fails once when the test says so; every worker runs until stop.
  const std::string script = "i=0; while [ ! -e " + d.file("stop") +
                             " ] && [ $i -lt 900 ]; do "
                             "if [ $RANK = 3 ] && [ -e " +
                             d.file("trigger") + " ] && mkdir " + d.file("crashed") +
                             " 2>/dev/null; then exit 3; fi; sleep 0.1; i=$((i+1)); done";
  auto node = [&](int rank, int status) {
    return start_ctorchrun(
        concat({"--nnodes=2", "--node_rank=" + std::to_string(rank), "--nproc_per_node=2",
                "--master_port=" + master, "--max_restarts=1",
                "--status_port=" + std::to_string(status), "--status_host=127.0.0.1"},
               sh(script)));
  };
  auto n0 = node(0, status0);
  auto n1 = node(1, status1);
  REQUIRE(wait_for_port(status0, 30s));
  Process browser({"/usr/bin/python3", CTORCHRUN_SOURCE_DIR "/tests/launcher/page_driver.py",
                   "http://127.0.0.1:" + std::to_string(status0) + "/", d.path, "110"},
                  {}, /*capture_stderr=*/true);

  json page = await_page(d.path, [](const json& p) {
    return p["loaded"] == "1" && p["state"] == "running" && all_ranks_drawn(p);
  });
  INFO("before the restart: " << page.dump(1));
  REQUIRE(page["loaded"] == "1");
  CHECK(page["attempt"].get<std::string>().find('0') != std::string::npos);
  CHECK(all_ranks_drawn(page));  // node 1's ranks too, from the round's table
  CHECK(rank_state(page, 3) == "present");
  CHECK(page["nodes"].size() == 2);
  CHECK(page["banner"] == "");

  std::ofstream(d.file("trigger")) << "x";  // rank 3 (node 1) fails once
  page = await_page(d.path, [](const json& p) {
    return p["attempt"].get<std::string>().find('1') != std::string::npos &&
           has_event(p, "restart") && all_ranks_drawn(p);
  });
  INFO("after the restart: " << page.dump(1));
  CHECK(page["attempt"].get<std::string>().find('1') != std::string::npos);
  CHECK(has_event(page, "restart"));
  CHECK(all_ranks_drawn(page));
  CHECK(page["text"].get<std::string>().find("exit code 3") != std::string::npos);
  std::ofstream(d.file("shoot")).close();  // the README's screenshot comes from here
  CHECK(wait_for_file(d.file("page.png"), 20s));

  // The agent goes: the page says so, and keeps the last view.
  n0->signal(SIGKILL);
  n1->signal(SIGKILL);
  page = await_page(d.path, [](const json& p) { return p["banner"] == "unreachable"; });
  INFO("agent gone: " << page.dump(1));
  CHECK(page["banner"] == "unreachable");
  CHECK(rank_state(page, 0) != "");  // the last known view is still drawn
  std::ofstream(d.file("quit")).close();
  CHECK(browser.exit_code(30s) == 0);
  if (const char* keep = std::getenv("CTORCHRUN_PAGE_SCREENSHOT")) {
    std::filesystem::copy_file(d.file("page.png"), keep,
                               std::filesystem::copy_options::overwrite_existing);
  }
}

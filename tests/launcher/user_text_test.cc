// End-to-end: bytes the user chooses reach the launcher's JSON (store
// records, events, the hang summary) and never make it fail as an internal
// error (exit 70): run ids and program paths that are not UTF-8, and a hung
// Python line whose multi-byte characters straddle the 80-byte cut.

#include <catch2/catch.hpp>
#include <fstream>
#include <regex>
#include <string>

#include "common/json_text.h"
#include "tests/launcher/launcher_support.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Every line of an --events_file, read back as the launcher wrote it.
std::vector<nlohmann::json> events_of(const std::string& path) {
  std::vector<nlohmann::json> out;
  for (const auto& line : lines_of(path)) out.push_back(json_text::parse_record(line));
  return out;
}

}  // namespace

TEST_CASE("ctorchrun: a run id or a missing program's path that is not UTF-8 is no internal error",
          "[multiproc]") {
  TempDir d;
  const std::string run_id = "job\xff\xfe";
  const std::vector<std::vector<std::string>> rendezvous = {
      {"--master_port=" + std::to_string(free_port())},
      {"--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + std::to_string(free_port())}};
  for (const auto& rdzv : rendezvous) {
    INFO(rdzv[0]);
    // The run id is kept whole: in the store's records and in the events.
    auto r =
        run_ctorchrun(concat(rdzv, {"--rdzv_id=" + run_id, "--events_file=" + d.file("events.json"),
                                    "--no_python", "/bin/true"}),
                      {}, 60s);
    INFO(r.output);
    CHECK(r.exit_code == 0);
    auto events = events_of(d.file("events.json"));
    REQUIRE_FALSE(events.empty());
    for (const auto& e : events) {
      REQUIRE(e.is_object());
      CHECK(e["run_id"].get<std::string>() == run_id);
    }
    std::remove(d.file("events.json").c_str());
    // A missing program whose path is not UTF-8: a usage error, as with any
    // missing program.
    r = run_ctorchrun(concat(rdzv, {"--no_python", d.path + "/\xff/x\xc3"}), {}, 60s);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.output, "No such file or directory"));
    CHECK_FALSE(contains(r.output, "internal error"));
  }
}

TEST_CASE("hang: a hung line with multi-byte UTF-8 past byte 80 is named and fails as a hang",
          "[multiproc]") {
  TempDir d;
  // Byte 80 falls inside a 3-byte character of the comment.
  std::string line = "time.sleep(60)  # ";  // 18 bytes
  while (line.size() < 100) line += "\xe7\xad\x89";
  std::ofstream(d.file("w.py")) << "import time\n" << line << "\n";
  auto r = run_ctorchrun(
      {"--standalone", "--nproc_per_node=1", "--hang_timeout=1", "--log_dir=" + d.file("logs"),
       "--events_file=" + d.file("events.json"), d.file("w.py")},
      {}, 60s);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  // A hang keeps torch's exitcode field (how the stalled worker then ended)
  // and says so in its traceback.
  CHECK(std::regex_search(r.output, std::regex("\n  exitcode  : -?[0-9]+ \\(pid: [0-9]+\\) ")));
  CHECK(contains(r.output, "\n  traceback : hang: no worker progressed"));
  CHECK_FALSE(contains(r.output, "exitcode  : hang"));
  // 78 bytes of the line: the cut went back to the character's start.
  const std::string shown = line.substr(0, 78);
  CHECK(contains(r.output, "rank 0 in <module> at w.py:2 (" + shown + ")"));
  CHECK_FALSE(contains(r.output, "internal error"));
  bool diagnosed = false;
  for (const auto& e : events_of(d.file("events.json"))) {
    if (e.value("event", "") == "hang_diagnosed") {
      diagnosed = true;
      CHECK(contains(e["frames"].get<std::string>(), shown + ")"));
    }
  }
  CHECK(diagnosed);
}

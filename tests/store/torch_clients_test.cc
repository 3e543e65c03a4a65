// Real torch clients (Debian's python3-torch: 1.13, or 2.6 for the torch2
// tests) against ctorch-store: every
// Python TCPStore call, and two gloo workers that rendezvous through it as
// they would through torchrun's agent store.

#include <catch2/catch.hpp>
#include <regex>

#include "tests/support/process.h"
#include "tests/support/test_python.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

struct StoreProcess {
  Process proc{{CTORCHRUN_STORE_BIN, "--host", "127.0.0.1", "--port", "0"}};
  int port = wait_for_listening_port(proc, 20s);
};

// Runs a script of tests/torch/ and returns (exit code, output).
std::pair<int, std::string> run_script(const std::string& script,
                                       const std::vector<std::string>& args) {
  std::vector<std::string> argv = {test_python(), CTORCHRUN_SOURCE_DIR "/tests/torch/" + script};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, {}, /*capture_stderr=*/true);
  std::string out = p.read_all(120s);
  return {p.exit_code(10s), out};
}

// The "N passed, M failed" line the scripts end with.
std::pair<int, int> tally(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"((\d+) passed, (\d+) failed)");
  std::pair<int, int> last{-1, -1};
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    last = {std::stoi((*it)[1]), std::stoi((*it)[2])};
  }
  return last;
}

}  // namespace

TEST_CASE("ctorch-store: every torch TCPStore call from Python behaves as on torch's server",
          "[torch]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  auto [code, out] =
      run_script("store_api_check.py", {"--host", "127.0.0.1", "--port", std::to_string(s.port)});
  INFO(out);
  CHECK(code == 0);
  auto [passed, failed] = tally(out);
  CHECK(passed >= 25);
  CHECK(failed == 0);
}

TEST_CASE("ctorch-store: two torch gloo workers init_process_group and all_reduce through it",
          "[torch]") {
  StoreProcess s;
  REQUIRE(s.port > 0);
  auto [code, out] = run_script("run_gloo_pair.py", {"--host", "127.0.0.1", "--port",
                                                     std::to_string(s.port), "--world", "2"});
  INFO(out);
  CHECK(code == 0);
  auto [passed, failed] = tally(out);
  CHECK(passed == 4);
  CHECK(failed == 0);
  CHECK(out.find("ok worker0_ok_line") != std::string::npos);
  CHECK(out.find("ok worker1_ok_line") != std::string::npos);
}

// worker::installed_torch_version against stand-in interpreters (shell
// scripts that answer, fail or hang) and the real Python with torch.

#include "worker/torch_probe.h"

#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <string>

#include "tests/support/temp_dir.h"
#include "tests/support/test_python.h"

using namespace ctorchrun;
using namespace std::chrono_literals;

namespace {

// An executable script in a fresh directory, removed with it.
struct FakePython {
  explicit FakePython(const std::string& body) {
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    ::chmod(path.c_str(), 0755);
  }
  ctorchrun::testing::TempDir dir{"probe"};
  const std::string path = dir.file("python");
};

std::map<std::string, std::string> env_with_path(const std::string& path) {
  return {{"PATH", path}};
}

}  // namespace

TEST_CASE("torch probe: a version text gives its major and minor, anything else nothing",
          "[unit]") {
  CHECK(worker::major_minor("1.13.0a0+gitunknown") == std::pair{1, 13});
  CHECK(worker::major_minor("2.6.0+debian") == std::pair{2, 6});
  CHECK(worker::major_minor("2.11") == std::pair{2, 11});
  for (const char* bad : {"", "2", "2.", ".6", "x.y", "2.x", "1234567.1", "v2.6"}) {
    INFO(bad);
    CHECK_FALSE(worker::major_minor(bad).has_value());
  }
}

TEST_CASE(
    "torch probe: the interpreter's answer is the version, and a failure, a hang past the "
    "timeout or a missing interpreter is no version, within the bound",
    "[multiproc]") {
  FakePython answers("case \"$2\" in *importlib.metadata*) echo '2.6.0+debian';; *) exit 9;; esac");
  CHECK(worker::installed_torch_version(answers.path, {}, 5s) == "2.6.0+debian");
  // A bare name is found on the PATH of the environment given.
  CHECK(worker::installed_torch_version("python", env_with_path(answers.dir.path), 5s) ==
        "2.6.0+debian");

  FakePython no_torch("echo 'No module named torch' >&2; exit 1");
  CHECK_FALSE(worker::installed_torch_version(no_torch.path, {}, 5s).has_value());

  FakePython hangs("exec sleep 30");
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(worker::installed_torch_version(hangs.path, {}, 300ms).has_value());
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);

  CHECK_FALSE(worker::installed_torch_version("/nonexistent/python", {}, 5s).has_value());
  CHECK_FALSE(
      worker::installed_torch_version("python", env_with_path("/nonexistent"), 5s).has_value());
}

TEST_CASE("torch probe: the test Python's torch is found without importing it", "[torch]") {
  auto version =
      worker::installed_torch_version(testing::test_python(), env_with_path("/usr/bin:/bin"), 10s);
  REQUIRE(version.has_value());
  auto mm = worker::major_minor(*version);
  REQUIRE(mm.has_value());
  CHECK(*mm == testing::test_torch_version());
}

// The packages of scripts/package.sh on clean systems ([package]): the .deb
// installed with apt into a copy of a clean Debian 12 root
// (scripts/setup_clean_root.sh), the wheel installed with pip into a venv by
// a user who is not root (tests/package/*.sh do the work and say which step
// failed). Needs root, the clean root and dist/ (scripts/test.sh makes both
// before it runs the tests); without them the tests fail, naming what to run.

#include <glob.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace ctorchrun::testing {
namespace {

const std::string kSource = CTORCHRUN_SOURCE_DIR;
const std::string kVersion = CTORCHRUN_PACKAGE_VERSION;

// The one file dist/ holds by `pattern`'s name ("" when there is none).
std::string in_dist(const std::string& pattern) {
  glob_t g{};
  std::string found;
  if (::glob((kSource + "/dist/" + pattern).c_str(), 0, nullptr, &g) == 0 && g.gl_pathc == 1)
    found = g.gl_pathv[0];
  ::globfree(&g);
  return found;
}

// Runs `argv` (stderr too captured); its exit code, and its output in `out`.
int run(const std::vector<std::string>& argv, std::string* out) {
  Process p(argv, {}, true);
  *out = p.read_all(std::chrono::seconds(280));
  return p.exit_code(std::chrono::seconds(10));
}

std::string deb_path() {
  const std::string deb = in_dist("ctorchrun_" + kVersion + "_*.deb");
  {
    INFO("no dist/ctorchrun_" << kVersion << "_*.deb: run scripts/package.sh deb");
    REQUIRE(!deb.empty());
  }
  return deb;
}

TEST_CASE("package: the .deb's control names its version, runtime Depends and Suggests",
          "[package]") {
  const std::string deb = deb_path();
  std::string fields;
  REQUIRE(run({"/usr/bin/dpkg-deb", "-f", deb, "Version", "Depends", "Suggests"}, &fields) == 0);
  INFO(fields);
  CHECK(fields.find("Version: " + kVersion + "\n") != std::string::npos);
  CHECK(fields.find("libc6 (>=") != std::string::npos);
  CHECK(fields.find("libgloo0") != std::string::npos);
  for (const char* not_runtime :
       {"-dev", "gcc ", "g++", "cmake", "slurm-client,", "etcd-server,"}) {
    const size_t suggests = fields.find("Suggests:");
    CHECK(fields.substr(0, suggests).find(not_runtime) == std::string::npos);
  }
  CHECK(fields.find("Suggests: python3-torch, etcd-server, etcd-client, slurm-client") !=
        std::string::npos);
}

TEST_CASE("package: the .deb on a clean Debian 12: install, job, restart, CMake, man, remove",
          "[package]") {
  std::string out;
  const int code = run({"/bin/bash", kSource + "/tests/package/deb_test.sh", deb_path()}, &out);
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("deb_test.sh: passed") != std::string::npos);
}

TEST_CASE("package: the wheel in a venv as a user: PATH, python -m, torch, C library only",
          "[package]") {
  const std::string wheel =
      in_dist("ctorchrun-" + kVersion + "-py3-none-manylinux_2_36_x86_64.whl");
  {
    INFO("no dist/ctorchrun-" << kVersion << "-py3-none-manylinux_2_36_x86_64.whl: run "
                              << "scripts/package.sh wheel");
    REQUIRE(!wheel.empty());
  }
  std::string out;
  const int code = run({"/bin/bash", kSource + "/tests/package/wheel_test.sh", wheel}, &out);
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("wheel_test.sh: passed") != std::string::npos);
}

}  // namespace
}  // namespace ctorchrun::testing

#pragma once

// The Python with torch that the tests run: $CTORCHRUN_PYTHON when set and
// not empty (the torch2 tests set it to scripts/torch2/python, Debian 13's
// torch 2.6), else CTORCHRUN_TEST_PYTHON (CMake cache, /usr/bin/python3 with
// Debian 12's torch 1.13). The including target defines CTORCHRUN_TEST_PYTHON.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "tests/support/process.h"

namespace ctorchrun::testing {

inline std::string test_python() {
  const char* env = std::getenv("CTORCHRUN_PYTHON");
  return env && *env ? env : CTORCHRUN_TEST_PYTHON;
}

// (major, minor) of the torch that test_python() imports, from its package
// metadata (quick: torch itself is not imported), e.g. {1, 13} or {2, 6}.
// For assertions on what differs between torch versions.
inline std::pair<int, int> test_torch_version() {
  static const std::pair<int, int> version = [] {
    Process p({test_python(), "-c", "import importlib.metadata as m; print(m.version('torch'))"},
              {}, /*capture_stderr=*/true);
    std::string out = p.read_all(std::chrono::seconds(30));
    int major = 0, minor = 0;
    if (p.exit_code(std::chrono::seconds(10)) != 0 ||
        std::sscanf(out.c_str(), "%d.%d", &major, &minor) != 2) {
      throw std::runtime_error("no torch version from " + test_python() + ": " + out);
    }
    return std::pair{major, minor};
  }();
  return version;
}

}  // namespace ctorchrun::testing

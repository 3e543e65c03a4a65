#pragma once

// The Python with torch that the tests run: $CTORCHRUN_PYTHON when set and
// not empty (the torch2 tests set it to scripts/torch2/python, Debian 13's
// torch 2.6), else CTORCHRUN_TEST_PYTHON (CMake cache, /usr/bin/python3 with
// Debian 12's torch 1.13). The including target defines CTORCHRUN_TEST_PYTHON.

#include <cstdlib>
#include <string>

namespace ctorchrun::testing {

inline std::string test_python() {
  const char* env = std::getenv("CTORCHRUN_PYTHON");
  return env && *env ? env : CTORCHRUN_TEST_PYTHON;
}

}  // namespace ctorchrun::testing

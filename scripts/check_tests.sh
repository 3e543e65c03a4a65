#!/usr/bin/env bash
# Checks that CTest registered every Catch2 test case of every test binary:
# a TEST_CASE whose tag its target does not discover (tests/CMakeLists.txt,
# ctorchrun_discover) would otherwise never run, silently. The [torch] cases
# are registered once more under the label torch2 (torch 2.6) unless the build
# says CTORCHRUN_TORCH2_TESTS=OFF: every one of them must be there too.
#   scripts/check_tests.sh [build dir]   (default build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cases=0 torch_cases=0
for bin in "$build"/bin/*_tests; do
  n=$("$bin" --list-test-names-only | grep -c . || true)
  cases=$((cases + n))
  n=$("$bin" --list-test-names-only "[torch]" | grep -c . || true)
  torch_cases=$((torch_cases + n))
done
count() { (cd "$build" && ctest -N "$@" | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p'); }
registered=$(count -LE '^torch2$')
if [ "$cases" != "$registered" ]; then
  echo "check_tests: the test binaries hold $cases test cases but CTest registered $registered;"
  echo "check_tests: give every TEST_CASE exactly one tag its target discovers"
  exit 1
fi
torch2=$(count -L '^torch2$')
if grep -q '^CTORCHRUN_TORCH2_TESTS:BOOL=OFF$' "$build/CMakeCache.txt"; then
  expected=0
else
  expected=$torch_cases
fi
if [ "$torch2" != "$expected" ]; then
  echo "check_tests: $torch_cases [torch] test cases but $torch2 torch2 tests (expected $expected);"
  echo "check_tests: register every target with [torch] cases with the torch tag (ctorchrun_discover)"
  exit 1
fi
echo "check_tests: all $cases test cases are registered with CTest, and $torch2 [torch] ones for torch2"

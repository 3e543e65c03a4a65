#!/usr/bin/env bash
# Checks that CTest registered every Catch2 test case of every test binary:
# a TEST_CASE whose tag its target does not discover (tests/CMakeLists.txt,
# ctorchrun_discover) would otherwise never run, silently.
#   scripts/check_tests.sh [build dir]   (default build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cases=0
for bin in "$build"/bin/*_tests; do
  n=$("$bin" --list-test-names-only | grep -c . || true)
  cases=$((cases + n))
done
registered=$(cd "$build" && ctest -N | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p')
if [ "$cases" != "$registered" ]; then
  echo "check_tests: the test binaries hold $cases test cases but CTest registered $registered;"
  echo "check_tests: give every TEST_CASE exactly one tag its target discovers"
  exit 1
fi
echo "check_tests: all $cases test cases are registered with CTest"

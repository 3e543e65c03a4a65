#!/usr/bin/env bash
# Sets up, builds and runs every test of ctorchrun (what CI runs):
#  1. scripts/setup.sh (apt dependencies, the Debian 13 root with torch 2.6
#     for the torch2 tests and the clean Debian 12 root for the package
#     tests), a Release build with warnings as errors, the packages
#     (scripts/package.sh: the .deb and the wheel in dist/), and an ASan+UBSan
#     build;
#  2. the formatting check, a check that CTest registered every test case,
#     and the request-parser fuzzer (bounded time);
#  3. the unit, net, multi-process and simulation tests under ASan+UBSan
#     (the simulation with CTORCHRUN_SIM_SEEDS=200, not its default 2000);
#  4. every test but the GPU ones, unsanitised (multi-process, the
#     simulation's 2000 seeds, torch 1.13 and, label torch2, torch 2.6 too:
#     CTest gives those CTORCHRUN_PYTHON=scripts/torch2/python; label package,
#     the packages installed on clean systems).
# GPU tests (label gpu) need a GPU and are left out here by name: run them with
#   (cd build && ctest -L gpu --output-on-failure)
set -euo pipefail
cd "$(dirname "$0")/.."
export CTORCHRUN_PYTHON=${CTORCHRUN_PYTHON:-/usr/bin/python3}
jobs=${CTEST_JOBS:-2}
fuzz_seconds=${FUZZ_SECONDS:-30}
# Time per phase; CTest adds its own time per label ("Label Time Summary").
phase_start=$SECONDS
phase_done() { echo "== $1 took $((SECONDS - phase_start)) s (total $SECONDS s)"; phase_start=$SECONDS; }
# The simulation's own summary ("simulated N seeds in X s"), which CTest keeps
# in its log when the test passes.
sim_summary() { grep -h '^simulated [0-9]* seeds in' "$1/Testing/Temporary/LastTest.log" || true; }

scripts/setup.sh
phase_done setup
scripts/build.sh -DCTORCHRUN_WERROR=ON
phase_done "release build"
# The .deb and the wheel (dist/), which the package tests install on clean
# systems: two more Release builds, mostly from ccache.
scripts/package.sh
phase_done "packages"
# -O1 with line tables: readable sanitizer reports, and much quicker to
# compile than the Release build's -O3.
BUILD_DIR=build-asan scripts/build.sh -DCTORCHRUN_WERROR=ON -DCTORCHRUN_SANITIZE=address,undefined \
  -DCTORCHRUN_TORCH_BACKEND=OFF \
  -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="-O1 -g1"
phase_done "sanitizer build"

scripts/format.sh --check
scripts/check_tests.sh build
scripts/fuzz.sh "$fuzz_seconds"
phase_done "format, test registration and fuzz checks"

echo "== unit, net, multiproc and sim tests under ASan+UBSan"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  CTORCHRUN_SIM_SEEDS=200 ctest -L 'unit|net|multiproc|sim' --output-on-failure -j "$jobs")
sim_summary build-asan
phase_done "sanitized tests"

echo "== every test but gpu"
(cd build && ctest -LE gpu --output-on-failure -j "$jobs")
sim_summary build
phase_done "unsanitised tests"

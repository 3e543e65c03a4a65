#!/usr/bin/env bash
# Configures and builds ctorchrun (Release) into build/; binaries land in build/bin/.
#   scripts/build.sh [extra cmake -D options]
# BUILD_DIR overrides the folder (the sanitizer build uses build-asan/).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
launcher=()
if command -v ccache >/dev/null 2>&1; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
elif [ $# -gt 0 ]; then
  cmake -S . -B "$build_dir" "$@"
fi
cmake --build "$build_dir" --parallel "$(nproc)"
# The ctorch backend for torch 2.6 too, built in the Debian 13 root, when
# this build made the torch 1.13 one and the root has its build packages
# (CTORCHRUN_TORCH2_BUILD=0 skips it).
if [ "${CTORCHRUN_TORCH2_BUILD:-1}" != 0 ] && [ -f "$build_dir/python/ctorch/__init__.py" ] &&
  [ -f "${CTORCHRUN_TORCH2_ROOT:-/var/lib/ctorchrun/torch2-trixie}/.ctorchrun-torch2-build-packages" ]; then
  BUILD_DIR="$build_dir" scripts/build_torch2.sh
fi

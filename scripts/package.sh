#!/usr/bin/env bash
# Builds the installable packages of ctorchrun into dist/ (gitignored):
#   dist/ctorchrun_<version>_<arch>.deb   ctorchrun, ctorch-store, the C++ tools,
#       libctorch_dist with its headers and CMake package, the man pages and
#       the bash, zsh and tcsh completions; Depends from dpkg-shlibdeps.
#   dist/ctorchrun-<version>-py3-none-manylinux_2_36_x86_64.whl   ctorchrun and
#       ctorch-store built with CTORCHRUN_PORTABLE (nothing needed but glibc
#       2.36 or later) and the `python -m ctorchrun` package.
#   scripts/package.sh [deb] [wheel]      (default both)
# The version is CMake's project version. Each package has a Release build
# folder of its own, configured here when missing and rebuilt (incrementally)
# every time: the .deb's $DEB_BUILD_DIR (default build-deb/: no nccl backend,
# since Debian has no NCCL, and no torch extension, which would make torch a
# dependency of every install; no tests), the wheel's $PORTABLE_BUILD_DIR
# (default build-portable/, CTORCHRUN_PORTABLE). Both take
# CTORCHRUN_WERROR from build/ when it has one, so that ccache shares their
# objects. $PACKAGE_JOBS (default nproc) compile jobs. lintian checks the
# .deb when it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
deb_build=${DEB_BUILD_DIR:-build-deb}
portable=${PORTABLE_BUILD_DIR:-build-portable}
jobs=${PACKAGE_JOBS:-$(nproc)}
what=("$@")
[ ${#what[@]} -gt 0 ] || what=(deb wheel)

say() { echo "package: $*"; }
fail() { echo "package: error: $*" >&2; exit 1; }

# Configures `dir` (Release, ninja and ccache when there) with `args` unless
# it is configured already.
configure() {
  local dir=$1
  shift
  local extra=()
  if command -v ninja >/dev/null 2>&1; then extra+=(-G Ninja); fi
  if command -v ccache >/dev/null 2>&1; then extra+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  local werror
  werror=$(sed -n 's/^CTORCHRUN_WERROR:BOOL=//p' build/CMakeCache.txt 2>/dev/null || true)
  [ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" "${extra[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCTORCHRUN_WERROR="${werror:-OFF}" -DCTORCHRUN_BUILD_TESTS=OFF "$@" >/dev/null
  grep -q '^CMAKE_BUILD_TYPE:STRING=Release$' "$dir/CMakeCache.txt" ||
    fail "$dir is not a Release build; packages are made from Release builds only"
}

version() { sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$1/CMakeCache.txt"; }

mkdir -p dist
# The dates inside both packages: the last commit's, so that one commit's
# packages come out the same byte for byte.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}
export SOURCE_DATE_EPOCH
for w in "${what[@]}"; do
  case $w in
    deb)
      configure "$deb_build" -DCTORCHRUN_WITH_NCCL=OFF -DCTORCHRUN_TORCH_BACKEND=OFF
      cmake --build "$deb_build" --parallel "$jobs"
      scripts/package_deb.sh "$deb_build" "$(version "$deb_build")" dist
      ;;
    wheel)
      configure "$portable" -DCTORCHRUN_PORTABLE=ON
      cmake --build "$portable" --parallel "$jobs" --target ctorchrun ctorch-store ctorch-status
      scripts/package_wheel.sh "$portable" "$(version "$portable")" dist
      ;;
    *) fail "unknown package '$w' (deb or wheel)" ;;
  esac
done

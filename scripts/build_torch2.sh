#!/usr/bin/env bash
# Builds the ctorch torch backend for torch 2.6 inside the Debian 13 root of
# scripts/setup_torch2.sh, and puts it next to the host's build in
# build/python/ctorch/ (as _C_torch2_6.cpython-313-x86_64-linux-gnu.so), so
# that one package serves workers of either torch.
#   scripts/build_torch2.sh            (called by scripts/build.sh)
# The host's libctorch_dist links Debian 12's spdlog, fmt and gloo, which the
# root lacks or has in other versions: common/, store/ and collectives/ are
# built a second time in the root, with its compiler and packages, and
# linked into the module. Sources are copied into the root (the build is
# incremental: files keep their times) under /var/tmp/ctorchrun-torch2-<id>,
# one folder per clone. Needs root (or sudo) for chroot.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${CTORCHRUN_TORCH2_ROOT:-/var/lib/ctorchrun/torch2-trixie}
build_dir=${BUILD_DIR:-build}
say() { echo "build_torch2: $*"; }
fail() { echo "build_torch2: error: $*" >&2; exit 1; }

[ -f "$root/.ctorchrun-torch2-build-packages" ] ||
  fail "no torch 2 root with its build packages at $root; run scripts/setup_torch2.sh"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

id=$(pwd -P | sha256sum | cut -c1-12)
work=/var/tmp/ctorchrun-torch2-$id
# Clones come and go (CI clones afresh each run): their builds, untouched
# for three days, go.
$SUDO find "$root/var/tmp" -maxdepth 1 -name 'ctorchrun-torch2-*' ! -name "ctorchrun-torch2-$id" \
  -mtime +3 -exec rm -rf {} + 2>/dev/null || true
$SUDO mkdir -p "$root$work/src"
tar -c CMakeLists.txt common store collectives torch_backend | $SUDO tar -x -C "$root$work/src"
jobs=$(nproc)
$SUDO chroot "$root" /bin/sh -c "
  set -e
  cd $work
  if [ ! -f build/build.ninja ]; then
    cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCTORCHRUN_TORCH_BACKEND_ONLY=ON \
      -DCTORCHRUN_TORCH_BACKEND=ON -DCTORCHRUN_TORCH_PYTHON=/usr/bin/python3 >/dev/null
  fi
  cmake --build build --parallel $jobs
" >"$build_dir/torch2-build.log" 2>&1 ||
  { tail -30 "$build_dir/torch2-build.log" >&2; fail "the torch 2 build failed (log: $build_dir/torch2-build.log)"; }
mkdir -p "$build_dir/python/ctorch"
found=0
for module in "$root$work"/build/python/ctorch/_C_torch*.so; do
  [ -f "$module" ] || continue
  cp -p "$module" "$build_dir/python/ctorch/"
  found=1
  say "built $(basename "$module")"
done
[ "$found" = 1 ] || fail "the torch 2 build made no module (log: $build_dir/torch2-build.log)"

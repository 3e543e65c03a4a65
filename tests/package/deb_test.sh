#!/usr/bin/env bash
# The .deb on a clean Debian 12 (tests/package/package_test.cc runs it):
#   tests/package/deb_test.sh DEB [CLEAN_ROOT]
# Installed with apt into a copy of the clean root it pulls runtime packages
# only; a job runs; ctorch-train-example fails, restarts and resumes; a
# program builds against the CMake package; man shows the page; apt-get
# remove leaves none of its files behind.
set -euo pipefail
deb=$(realpath "$1")
root=${2:-${CTORCHRUN_CLEAN_ROOT:-/var/lib/ctorchrun/bookworm-clean}}
. "$(dirname "$0")/clean_root.sh"
[ -f "$deb" ] || fail "no .deb at $1 (scripts/package.sh deb makes it)"
start_clean_root "$root"

step "apt-get install ./$(basename "$deb")"
cp "$deb" "$r/tmp/ctorchrun.deb"
before=$(installed_packages)
in_root apt-get install -y -qq --no-install-recommends /tmp/ctorchrun.deb >"$copy/apt.log" 2>&1 ||
  { tail -20 "$copy/apt.log"; fail "apt-get install of the .deb failed"; }
added=$(comm -13 <(echo "$before") <(installed_packages))
echo "pulled in: $(echo $added)"
echo "$added" | grep -qx ctorchrun || fail "ctorchrun is not installed"
bad=$(echo "$added" | grep -E -- '-dev$|^(gcc|g\+\+|cpp|clang|cmake|make|binutils)(-[0-9.]+)?$|slurm|etcd|^python3-torch|^libtorch' || true)
[ -z "$bad" ] || fail "the .deb pulled in what no runtime needs: $(echo $bad)"

step "a job of two workers"
out=$(in_root ctorchrun --nproc_per_node=2 --no_python /bin/sh -c 'echo "rank $RANK"' 2>"$copy/job.log") ||
  { cat "$copy/job.log"; fail "ctorchrun failed"; }
[ "$(echo "$out" | sort)" = "$(printf 'rank 0\nrank 1')" ] || fail "the job printed '$out'"

step "ctorch-train-example fails at epoch 1, restarts and resumes"
in_root ctorchrun --standalone --nproc_per_node=2 --max_restarts=1 --no_python \
  ctorch-train-example --workdir /tmp/train --epochs 3 --fail-once-at-epoch 1 >"$copy/train.log" 2>&1 ||
  { tail -20 "$copy/train.log"; fail "the training job failed"; }
grep -q 'restarting the workers' "$copy/train.log" || fail "no restart in the training log"
grep -q '"attempt":1' "$r/tmp/train/result.json" || fail "result.json: $(cat "$r/tmp/train/result.json")"
grep -q '"start_epoch":1' "$r/tmp/train/result.json" || fail "the restart did not resume from epoch 1"

step "a program against the CMake package (g++, cmake and make added)"
in_root apt-get install -y -qq --no-install-recommends g++ cmake make >"$copy/apt-dev.log" 2>&1 ||
  { tail -20 "$copy/apt-dev.log"; fail "apt-get install g++ cmake make failed"; }
mkdir -p "$r/tmp/consumer"
cat >"$r/tmp/consumer/CMakeLists.txt" <<'EOT'
cmake_minimum_required(VERSION 3.25)
project(consumer CXX)
find_package(ctorchrun 0.1 REQUIRED)
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE ctorchrun::dist)
EOT
cat >"$r/tmp/consumer/main.cc" <<'EOT'
#include <iostream>
#include "collectives/sha256.h"
int main() { std::cout << ctorchrun::dist::sha256_hex("abc", 3) << "\n"; }
EOT
in_root sh -c 'cmake -S /tmp/consumer -B /tmp/consumer/build && cmake --build /tmp/consumer/build' \
  >"$copy/consumer.log" 2>&1 || { tail -30 "$copy/consumer.log"; fail "the consumer does not build"; }
sum=$(in_root /tmp/consumer/build/consumer)
[ "$sum" = ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad ] ||
  fail "the consumer printed '$sum'"

step "man ctorchrun (man-db added)"
in_root apt-get install -y -qq --no-install-recommends man-db >"$copy/apt-man.log" 2>&1 ||
  { tail -20 "$copy/apt-man.log"; fail "apt-get install man-db failed"; }
page=$(in_root env MANWIDTH=120 MANPAGER=cat man ctorchrun 2>&1) || fail "man ctorchrun: $page"
echo "$page" | grep -q -- '--nproc-per-node, --nproc_per_node' || fail "man ctorchrun has no --nproc_per_node"
in_root env MANPAGER=cat man ctorch-store 2>&1 | grep -q -- '--max-connections' || fail "man ctorch-store"
[ "$(in_root ctorch-status --version)" = "ctorch-status $(in_root ctorchrun --version | cut -d' ' -f2)" ] ||
  fail "ctorch-status is not installed"
for f in /usr/share/bash-completion/completions/ctorchrun /usr/share/zsh/vendor-completions/_ctorchrun \
  /usr/share/ctorchrun/completion.tcsh; do
  [ -s "$r$f" ] || fail "no completion at $f"
done

step "apt-get remove ctorchrun"
mapfile -t files < <(in_root dpkg -L ctorchrun)
in_root apt-get remove -y -qq ctorchrun >"$copy/apt-remove.log" 2>&1 ||
  { tail -20 "$copy/apt-remove.log"; fail "apt-get remove failed"; }
if in_root dpkg -L ctorchrun >/dev/null 2>&1; then fail "dpkg -L still lists ctorchrun after removal"; fi
for f in "${files[@]}"; do
  [ -d "$r$f" ] || [ ! -e "$r$f" ] || fail "$f is left behind"
done
[ ! -e "$r/usr/bin/ctorchrun" ] || fail "/usr/bin/ctorchrun is left behind"
step "passed"

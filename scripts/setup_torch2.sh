#!/usr/bin/env bash
# Makes a Debian 13 (trixie) root with torch 2.6 (python3-torch, Python 3.13,
# CPU, gloo) next to the host's torch 1.13, so that the tests also run torch
# 2.x workers (through scripts/torch2/python, label torch2), with what
# scripts/build_torch2.sh builds the ctorch backend for that torch with.
#   scripts/setup_torch2.sh        (called by scripts/setup.sh)
# The root lives outside the repository, so that every clone shares it:
#   $CTORCHRUN_TORCH2_ROOT, default /var/lib/ctorchrun/torch2-trixie
# Idempotent: a finished root (its marker files) returns at once; one made
# before the build packages were needed gets them added. A root left
# half-made by an interrupted run is removed and made again. Needs root (or
# sudo), about 6 GB free while it works, and the Debian mirror of this
# machine's apt sources. Takes 1 to 3 minutes from nothing (mostly downloads).
set -euo pipefail

root=${CTORCHRUN_TORCH2_ROOT:-/var/lib/ctorchrun/torch2-trixie}
marker="$root/.ctorchrun-torch2-complete"
packages=(python3-torch python3-numpy)
# What scripts/build_torch2.sh builds the ctorch backend with, inside the
# root (libctorch_dist again, against the root's spdlog, fmt and gloo, then
# the extension against its torch). Added to a root made before they were
# needed too: the build marker lists what was installed.
build_packages=(g++ cmake ninja-build libtorch-dev python3-dev pybind11-dev libspdlog-dev
  libfmt-dev libboost-dev libgloo-dev)
build_marker="$root/.ctorchrun-torch2-build-packages"
need_kb=$((6 * 1024 * 1024))

say() { echo "setup_torch2: $*"; }
fail() { echo "setup_torch2: error: $*" >&2; exit 1; }
complete() { [ -f "$marker" ] && [ "$(cat "$build_marker" 2>/dev/null)" = "${build_packages[*]}" ]; }

if complete; then exit 0; fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "making $root needs root (or sudo)"
  SUDO="sudo"
fi
command -v debootstrap >/dev/null 2>&1 ||
  fail "debootstrap is missing (scripts/setup.sh installs it: apt-get install debootstrap)"

# The Debian mirror this machine's apt already uses (deb822 .sources or a
# one-line sources.list), so that the root comes from the same place.
mirror=${CTORCHRUN_TORCH2_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk 'BEGIN { RS = ""; FS = "\n" }
         /(^|\n)Types:[^\n]*deb/ && !/-security/ {
           for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) { split($i, u, " "); print u[2]; exit } }')
fi
if [ -z "$mirror" ]; then
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; exit } }')
fi
[ -n "$mirror" ] || fail "no Debian mirror in /etc/apt/sources.list*; set CTORCHRUN_TORCH2_MIRROR"

parent=$(dirname "$root")
$SUDO mkdir -p "$parent"
# One setup at a time per root (two clones set up at once wait for each other).
$SUDO touch "$root.lock"
exec 9<"$root.lock"
flock 9
if complete; then exit 0; fi

# Mounts under the root (proc from an interrupted run) go before anything else.
unmount_all() {
  local m
  for m in $(findmnt -rn -o TARGET | grep -F "$root/" | sort -r); do
    $SUDO umount "$m" 2>/dev/null || $SUDO umount -l "$m" || true
  done
}
# The build packages, into a finished root (idempotent: apt installs what
# is missing).
add_build_packages() {
  say "installing the build packages in $root: ${build_packages[*]}"
  trap unmount_all EXIT
  findmnt -rn -o TARGET | grep -qxF "$root/proc" || $SUDO mount -t proc proc "$root/proc"
  $SUDO cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  DEBIAN_FRONTEND=noninteractive $SUDO chroot "$root" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO chroot "$root" \
    apt-get install -y -qq --no-install-recommends "${build_packages[@]}" >"$root.apt-build.log" 2>&1 ||
    { tail -20 "$root.apt-build.log" >&2; fail "apt-get install ${build_packages[*]} in $root failed (log: $root.apt-build.log)"; }
  $SUDO chroot "$root" apt-get clean
  unmount_all
  trap - EXIT
  echo "${build_packages[*]}" | $SUDO tee "$build_marker" >/dev/null
}
if [ -f "$marker" ]; then
  add_build_packages
  exit 0
fi

if [ -e "$root" ]; then
  say "$root was left half-made (no marker): removing it and starting again"
  unmount_all
  $SUDO rm -rf --one-file-system "$root"
fi

avail_kb=$(df -Pk "$parent" | awk 'NR == 2 { print $4 }')
if [ "$avail_kb" -lt "$need_kb" ]; then
  fail "$parent has $((avail_kb / 1024)) MB free; the torch 2.6 root needs about $((need_kb / 1024)) MB.
setup_torch2: free some space or set CTORCHRUN_TORCH2_ROOT to a folder on a larger disk"
fi

start=$SECONDS
say "making a Debian 13 (trixie) root in $root from $mirror"
say "then installing ${packages[*]} in it (torch 2.6, Python 3.13: about 1.3 GB in all)"
$SUDO debootstrap --variant=minbase trixie "$root" "$mirror" >"$root.debootstrap.log" 2>&1 ||
  { tail -20 "$root.debootstrap.log" >&2; fail "debootstrap failed (log: $root.debootstrap.log)"; }

trap unmount_all EXIT
$SUDO mount -t proc proc "$root/proc"
$SUDO cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
export DEBIAN_FRONTEND=noninteractive
$SUDO chroot "$root" apt-get update -qq
$SUDO chroot "$root" apt-get install -y -qq --no-install-recommends "${packages[@]}" >"$root.apt.log" 2>&1 ||
  { tail -20 "$root.apt.log" >&2; fail "apt-get install ${packages[*]} in $root failed (log: $root.apt.log)"; }
$SUDO chroot "$root" apt-get clean
version=$($SUDO chroot "$root" python3 -c 'import torch; print(torch.__version__)') ||
  fail "torch does not import in $root"
unmount_all
trap - EXIT

# scripts/torch2/python runs the root's python in place, with the root's
# loader and libraries. The libraries that Debian picks by alternatives
# (libblas.so.3 -> /etc/alternatives/...) are absolute links, which outside a
# chroot lead to the host's: their real folders go first on the library path.
lib=/usr/lib/x86_64-linux-gnu
dirs=()
for link in "$root$lib"/*; do
  [ -L "$link" ] || continue
  target=$(readlink "$link")
  case $target in /*) ;; *) continue ;; esac
  for _ in 1 2 3 4 5 6 7 8; do
    case $target in /*) ;; *) break ;; esac
    [ -L "$root$target" ] || break
    next=$(readlink "$root$target")
    case $next in /*) target=$next ;; *) target=$(dirname "$target")/$next ;; esac
  done
  d=$(dirname "$target")
  if [ -e "$root$target" ] && [ "$d" != "$lib" ] && [[ " ${dirs[*]} " != *" $d "* ]]; then dirs+=("$d"); fi
done
printf '%s\n' "${dirs[@]}" "$lib" /usr/lib | $SUDO tee "$root/.ctorchrun-torch2-library-path" >/dev/null

echo "torch $version" | $SUDO tee "$marker" >/dev/null
add_build_packages
size=$($SUDO du -sh --one-file-system "$root" | cut -f1)
say "done in $((SECONDS - start)) s: torch $version, $size in $root"

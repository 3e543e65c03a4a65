#!/usr/bin/env bash
# Makes a clean Debian 12 (bookworm) root, the "user's machine" that the
# package tests (label package, tests/package/) install the .deb and run the
# wheel's binaries in: debootstrap's minbase and nothing else installed, so
# that the .deb must pull every runtime package it needs. What those tests
# add to their throwaway copy of it (the .deb's dependencies, man-db, g++ and
# cmake for the CMake package check) is downloaded here once, into the root's
# apt cache, so that a test installs it without the network.
#   scripts/setup_clean_root.sh        (called by scripts/setup.sh)
# The root lives outside the repository, so that every clone shares it:
#   $CTORCHRUN_CLEAN_ROOT, default /var/lib/ctorchrun/bookworm-clean
# Idempotent: a finished root (its marker file) returns at once. A root left
# half-made by an interrupted run is removed and made again. Needs root (or
# sudo), about 1 GB free, and the Debian mirror of this machine's apt
# sources. Takes 1 to 2 minutes from nothing (mostly downloads).
set -euo pipefail

root=${CTORCHRUN_CLEAN_ROOT:-/var/lib/ctorchrun/bookworm-clean}
marker="$root/.ctorchrun-clean-complete"
# Downloaded, not installed: what the package tests add to their copy.
cached=(man-db g++ cmake make libgloo0 libspdlog1.10-fmt9 libfmt9 libssl3 libstdc++6 libgcc-s1)
need_kb=$((1024 * 1024))

say() { echo "setup_clean_root: $*"; }
fail() { echo "setup_clean_root: error: $*" >&2; exit 1; }
complete() { [ -f "$marker" ] && [ "$(cat "$marker")" = "${cached[*]}" ]; }

if complete; then exit 0; fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "making $root needs root (or sudo)"
  SUDO="sudo"
fi
command -v debootstrap >/dev/null 2>&1 ||
  fail "debootstrap is missing (scripts/setup.sh installs it: apt-get install debootstrap)"

# The Debian mirror this machine's apt already uses, as scripts/setup_torch2.sh finds it.
mirror=${CTORCHRUN_CLEAN_MIRROR:-}
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
[ -n "$mirror" ] || fail "no Debian mirror in /etc/apt/sources.list*; set CTORCHRUN_CLEAN_MIRROR"

parent=$(dirname "$root")
$SUDO mkdir -p "$parent"
# One setup at a time per root.
$SUDO touch "$root.lock"
exec 9<"$root.lock"
flock 9
if complete; then exit 0; fi

unmount_all() {
  local m
  for m in $(findmnt -rn -o TARGET | grep -F "$root/" | sort -r); do
    $SUDO umount "$m" 2>/dev/null || $SUDO umount -l "$m" || true
  done
}
if [ -e "$root" ]; then
  say "$root was left half-made (or with other cached packages): removing it and starting again"
  unmount_all
  $SUDO rm -rf --one-file-system "$root"
fi

avail_kb=$(df -Pk "$parent" | awk 'NR == 2 { print $4 }')
if [ "$avail_kb" -lt "$need_kb" ]; then
  fail "$parent has $((avail_kb / 1024)) MB free; the clean root needs about $((need_kb / 1024)) MB"
fi

start=$SECONDS
say "making a clean Debian 12 (bookworm) root in $root from $mirror"
$SUDO debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.debootstrap.log" 2>&1 ||
  { tail -20 "$root.debootstrap.log" >&2; fail "debootstrap failed (log: $root.debootstrap.log)"; }

trap unmount_all EXIT
$SUDO mount -t proc proc "$root/proc"
$SUDO cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
export DEBIAN_FRONTEND=noninteractive
$SUDO chroot "$root" apt-get update -qq
# Keep what is downloaded: the tests install from this cache.
echo 'Binary::apt::APT::Keep-Downloaded-Packages "true";' |
  $SUDO tee "$root/etc/apt/apt.conf.d/01ctorchrun-keep-debs" >/dev/null
$SUDO rm -f "$root/etc/apt/apt.conf.d/docker-clean"
$SUDO chroot "$root" apt-get install -y -qq --download-only --no-install-recommends "${cached[@]}" \
  >"$root.apt.log" 2>&1 ||
  { tail -20 "$root.apt.log" >&2; fail "apt-get install --download-only ${cached[*]} in $root failed (log: $root.apt.log)"; }
unmount_all
trap - EXIT

echo "${cached[*]}" | $SUDO tee "$marker" >/dev/null
size=$($SUDO du -sh --one-file-system "$root" | cut -f1)
say "done in $((SECONDS - start)) s: $size in $root"

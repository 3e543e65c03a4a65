#!/usr/bin/env bash
# Installs every dependency of ctorchrun by name with apt, then the Debian 13
# root with torch 2.6 that the torch2 tests run (scripts/setup_torch2.sh) and
# the clean Debian 12 root the package tests install into
# (scripts/setup_clean_root.sh).
# Idempotent: when everything is already installed it checks and returns
# quietly.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  clang clang-format libclang-rt-14-dev
  libboost-dev libboost-filesystem-dev libboost-system-dev
  libssl-dev openssl
  libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev catch2
  libgloo-dev
  openmpi-bin libopenmpi-dev
  python3-torch python3-numpy libtorch-dev python3-dev pybind11-dev
  python3-venv python3-pip python3-setuptools
  iproute2 procps psmisc
  elfutils
  dpkg-dev lintian
  etcd-server etcd-client
  slurm-wlm slurm-client munge
  debootstrap
  valgrind
  zsh tcsh
  prometheus chromium
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: done"
fi

"$(dirname "$0")/setup_torch2.sh"
"$(dirname "$0")/setup_clean_root.sh"

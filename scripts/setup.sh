#!/usr/bin/env bash
# Installs every dependency of ctorchrun by name with apt. Idempotent: when
# everything is already installed it checks and returns quietly.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  clang clang-format libclang-rt-14-dev
  libboost-dev libboost-filesystem-dev libboost-system-dev
  libssl-dev openssl
  libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev catch2
  libgloo-dev
  python3-torch python3-numpy
  iproute2 procps psmisc
  etcd-server etcd-client
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"

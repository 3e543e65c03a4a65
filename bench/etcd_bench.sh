#!/usr/bin/env bash
# The etcd-v3 rendezvous against real etcd on loopback:
#  1. rendezvous of 64 and 256 agents (ctorch-rdzv-bench --etcd) against one
#     etcd member: time to a completed round, requests and bytes per agent;
#  2. a 3-member cluster whose leader is SIGKILLed: time from the kill to the
#     first successful write through a surviving member (etcdctl put, 100 ms
#     per attempt), three times.
#   bench/etcd_bench.sh [--agents 64,256] [--runs 3]
# The losses measured with our own client and with torch jobs (the node
# hosting the workers' store; the leader under EtcdStore writes and under a
# job) are in bench/etcd_loss_bench.sh.
# Needs /usr/bin/etcd and /usr/bin/etcdctl (Debian's etcd-server,
# etcd-client) and a built build/bin/ctorch-rdzv-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
agents=64,256
runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --agents) agents=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    *) echo "usage: $0 [--agents N,N] [--runs R]" >&2; exit 2 ;;
  esac
done
bench=build/bin/ctorch-rdzv-bench
[ -x "$bench" ] || { echo "etcd_bench: build $bench first (scripts/build.sh)" >&2; exit 2; }
work=$(mktemp -d /tmp/ctorch_etcd_bench_XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do { kill -9 "$p" && wait "$p"; } 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# start_cluster N: starts N members, sets CLIENTS (comma list) and MEMBER_PIDS.
start_cluster() {
  local n=$1 token="bench$$_$RANDOM" initial="" i
  local -a cports pports
  for ((i = 0; i < n; i++)); do
    cports[i]=$(free_port); pports[i]=$(free_port)
    initial+="${initial:+,}m$i=http://127.0.0.1:${pports[i]}"
  done
  CLIENTS=""; MEMBER_PIDS=()
  for ((i = 0; i < n; i++)); do
    /usr/bin/etcd --name "m$i" --data-dir "$work/$token-m$i" \
      --listen-client-urls "http://127.0.0.1:${cports[i]}" \
      --advertise-client-urls "http://127.0.0.1:${cports[i]}" \
      --listen-peer-urls "http://127.0.0.1:${pports[i]}" \
      --initial-advertise-peer-urls "http://127.0.0.1:${pports[i]}" \
      --initial-cluster "$initial" --initial-cluster-token "$token" \
      --heartbeat-interval 50 --election-timeout 500 >"$work/$token-m$i.log" 2>&1 &
    pids+=($!); MEMBER_PIDS+=($!)
    CLIENTS+="${CLIENTS:+,}127.0.0.1:${cports[i]}"
  done
  for ((t = 0; t < 200; t++)); do
    if ETCDCTL_API=3 /usr/bin/etcdctl --endpoints="$CLIENTS" --command-timeout=1s \
        put /bench/ready 1 >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "etcd_bench: the cluster did not start" >&2; exit 1
}

echo "# machine: nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%FT%TZ)"
start_cluster 1
echo "== rendezvous against one etcd member ($CLIENTS)"
"$bench" --agents "$agents" --runs "$runs" --etcd "$CLIENTS"

echo "== leader loss in a 3-member cluster: kill -> first successful write"
for ((r = 0; r < runs; r++)); do
  start_cluster 3
  leader=""
  IFS=, read -ra eps <<<"$CLIENTS"
  for i in "${!eps[@]}"; do
    if ETCDCTL_API=3 /usr/bin/etcdctl --endpoints="${eps[i]}" endpoint status -w simple 2>/dev/null |
        awk -F', ' '{ exit !($5 == "true") }'; then leader=$i; fi
  done
  [ -n "$leader" ] || { echo "etcd_bench: no leader found" >&2; exit 1; }
  others=""
  for i in "${!eps[@]}"; do [ "$i" = "$leader" ] || others+="${others:+,}${eps[i]}"; done
  t0=$(date +%s.%N)
  { kill -9 "${MEMBER_PIDS[leader]}" && wait "${MEMBER_PIDS[leader]}"; } 2>/dev/null || true
  ok=""
  for ((t = 0; t < 200; t++)); do
    if ETCDCTL_API=3 /usr/bin/etcdctl --endpoints="$others" --command-timeout=100ms \
        put /bench/after 1 >/dev/null 2>&1; then ok=1; break; fi
  done
  t1=$(date +%s.%N)
  if [ -n "$ok" ]; then
    echo "run $r: leader m$leader killed -> first write after $(echo "$t1 - $t0" | bc) s"
  else
    echo "run $r: no write within 200 attempts"
  fi
  for p in "${MEMBER_PIDS[@]}"; do { kill -9 "$p" && wait "$p"; } 2>/dev/null || true; done
done
echo "# load at the end $(cut -d' ' -f1-3 /proc/loadavg)"

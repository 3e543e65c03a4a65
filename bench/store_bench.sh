#!/usr/bin/env bash
# Store benchmark: ctorch-store-bench against ctorch-store and against torch
# 1.13's own TCPStore server, same machine, same run, alternating servers per
# measurement so that machine noise hits both alike.
#   bench/store_bench.sh [--quick]   (build first: scripts/build.sh)
# Prints one JSON line per measurement and a markdown table of medians.
#   bench/store_bench.sh --floor [PAIRS] [SECONDS]   (defaults 7 and 5)
# Compares ctorch-store with bench/floor_store.c, the least any server must
# pay here: PAIRS interleaved floor/ours runs of 32 v113 clients, --op mixed,
# then the median of each and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${CTORCHRUN_PYTHON:-/usr/bin/python3}
bench=build/bin/ctorch-store-bench
seconds=2
reps=3
clients_list="1 8 32 128"
ops="set get add mixed"
storms="1024 2048"
if [ "${1:-}" = "--quick" ]; then seconds=1; reps=1; clients_list="32"; ops="mixed"; storms="1024"; fi
floor_mode=0
if [ "${1:-}" = "--floor" ]; then floor_mode=1; reps=${2:-7}; seconds=${3:-5}; fi

out=$(mktemp -d)
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$out"; }
pids=()
trap cleanup EXIT

start() {  # start NAME CMD... ; sets port_NAME
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1 &
  pids+=($!)
  eval "pid_$name=$!"
  for _ in $(seq 1 300); do
    p=$(sed -n 's/^listening on .*:\([0-9][0-9]*\)$/\1/p' "$out/$name.log")
    [ -n "$p" ] && { eval "port_$name=$p"; return; }
    sleep 0.05
  done
  cat "$out/$name.log"; echo "could not start $name"; exit 1
}
start ctorch build/bin/ctorch-store --host 127.0.0.1 --port 0
if [ "$floor_mode" = 1 ]; then
  start floor build/bin/floor_store 0
  results=$out/floor.jsonl
  for r in $(seq 1 "$reps"); do
    for server in floor ctorch; do
      eval "port=\$port_$server"
      line=$("$bench" --port "$port" --dialect v113 --clients 32 --seconds "$seconds" --op mixed | tail -n 1)
      echo "{\"server\":\"$server\",\"rep\":$r,${line#\{}" | tee -a "$results"
    done
  done
  "$python" - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = {s: statistics.median(r["ops_per_s"] for r in rows if r["server"] == s) for s in ("floor", "ctorch")}
print(f"floor median {med['floor']:,.0f} ops/s, ctorch-store median {med['ctorch']:,.0f} ops/s, "
      f"ratio {med['ctorch'] / med['floor']:.3f} over {len(rows) // 2} pairs")
PY
  exit 0
fi
start torch "$python" tests/torch/torch_store_server.py --port 0 --duration 3600

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # user+system, 1/100 s
tick_hz=$(getconf CLK_TCK)

results=$out/results.jsonl
load() {  # load OP CLIENTS PIPELINE
  for r in $(seq 1 "$reps"); do
    for server in ctorch torch; do
      eval "port=\$port_$server; pid=\$pid_$server"
      before=$(cpu_ticks "$pid")
      line=$("$bench" --port "$port" --clients "$2" --seconds "$seconds" --op "$1" --pipeline "$3" | tail -n 1)
      after=$(cpu_ticks "$pid")
      echo "{\"server\":\"$server\",\"rep\":$r,\"server_cpu_ticks\":$(( after - before ))e0/$tick_hz,${line#\{}" |
        sed 's|"server_cpu_ticks":\([0-9]*\)e0/\([0-9]*\)|"server_cpu_ticks":\1,"tick_hz":\2|' | tee -a "$results"
    done
  done
}
for op in $ops; do
  for k in $clients_list; do load "$op" "$k" 1; done
done
load mixed 32 8
for n in $storms; do
  for r in $(seq 1 "$reps"); do
    for server in ctorch torch; do
      eval "port=\$port_$server"
      line=$("$bench" --port "$port" --storm "$n" | tail -n 1)
      echo "{\"server\":\"$server\",\"rep\":$r,${line#\{}" | tee -a "$results"
    done
  done
done

"$python" - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def cpu_us_per_op(server, **match):
    v = [r["server_cpu_ticks"] / r["tick_hz"] * 1e6 / r["ops"] for r in rows
         if r["server"] == server and r["mode"] == "load" and all(r.get(k) == m for k, m in match.items())]
    return statistics.median(v)
def med(server, key, **match):
    v = [r[key] for r in rows if r["server"] == server and all(r.get(k) == m for k, m in match.items())]
    return statistics.median(v) if v else None
print()
print("| op | clients x in flight | ctorch ops/s | torch ops/s | ratio | ctorch p50/p99 us | torch p50/p99 us | server CPU us/op ctorch / torch |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
loads = sorted({(r["op"], r["clients"], r["pipeline"]) for r in rows if r["mode"] == "load"},
               key=lambda t: (t[2], ["set", "get", "add", "mixed"].index(t[0]), t[1]))
for op, k, d in loads:
    m = dict(op=op, clients=k, pipeline=d)
    a, b = med("ctorch", "ops_per_s", **m), med("torch", "ops_per_s", **m)
    print(f"| {op} | {k} x {d} | {a:,.0f} | {b:,.0f} | {a/b:.2f}x | "
          f"{med('ctorch','p50_us',**m):.0f}/{med('ctorch','p99_us',**m):.0f} | "
          f"{med('torch','p50_us',**m):.0f}/{med('torch','p99_us',**m):.0f} | "
          f"{cpu_us_per_op('ctorch', **m):.1f} / {cpu_us_per_op('torch', **m):.1f} |")
print()
print("| storm clients | ctorch s | torch s | speed-up |")
print("| --- | --- | --- | --- |")
for n in sorted({r["clients"] for r in rows if r["mode"] == "storm"}):
    a, b = med("ctorch", "storm_s", mode="storm", clients=n), med("torch", "storm_s", mode="storm", clients=n)
    print(f"| {n} | {a:.3f} | {b:.3f} | {b/a:.2f}x |")
PY

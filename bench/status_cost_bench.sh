#!/usr/bin/env bash
# What --status_port costs the agent: its CPU time (utime + stime of the
# agent process alone, from /proc) over a window while a real Prometheus
# scrapes /metrics every second and the live page is open in headless
# Chromium (it polls /status every second), against the same job with no
# --status_port. The job: --nproc_per_node=4 idle --no_python workers.
#   bench/status_cost_bench.sh [SECONDS (30)] [REPS (3)]
# Off and on alternate; the last line is JSON with each mode's median share
# of one core and every run's figure.
# Needs prometheus and chromium (scripts/setup.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
reps=${2:-3}
bin=${CTORCHRUN_BIN:-build/bin/ctorchrun}
for tool in prometheus chromium; do
  command -v "$tool" >/dev/null || { echo "status_cost_bench: $tool is missing (scripts/setup.sh)"; exit 1; }
done
work=$(mktemp -d /tmp/status_cost_XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks() { awk '{ s=$0; sub(/^.*\) /, "", s); split(s, f, " "); print f[12] + f[13] }' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

# One window: prints the agent's CPU share of one core (percent) and, when
# on, the requests Prometheus and the page made.
window() {
  local mode=$1 d="$work/$1.$2" port agent prom chrome
  mkdir -p "$d"
  port=$(free_port)
  local extra=()
  [ "$mode" = on ] && extra=(--status_port="$port" --status_host=127.0.0.1)
  "$bin" --nproc_per_node=4 "${extra[@]}" --no_python /bin/sleep $((seconds + 10)) >"$d/agent.log" 2>&1 &
  agent=$!
  pids+=("$agent")
  if [ "$mode" = on ]; then
    printf 'global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: c\n    static_configs:\n      - targets: ["127.0.0.1:%s"]\n' "$port" >"$d/prom.yml"
    prometheus --config.file="$d/prom.yml" --storage.tsdb.path="$d/data" \
      --web.listen-address=127.0.0.1:"$(free_port)" --log.level=warn >"$d/prom.log" 2>&1 &
    prom=$!
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
      --disable-background-networking --disable-component-update --disable-sync \
      --user-data-dir="$d/chrome" "http://127.0.0.1:$port/" >"$d/chrome.log" 2>&1 &
    chrome=$!
    pids+=("$prom" "$chrome")
  fi
  sleep 3  # start-up, the first scrapes and the page's first load
  local t0 t1
  t0=$(ticks "$agent")
  sleep "$seconds"
  t1=$(ticks "$agent")
  echo "$mode $(python3 -c "print(round(100.0 * ($t1 - $t0) / $hz / $seconds, 3))")"
  [ "$mode" = on ] && kill "$prom" "$chrome" 2>/dev/null
  kill "$agent" 2>/dev/null || true
  wait "$agent" 2>/dev/null || true
  [ "$mode" = on ] && { wait "$prom" 2>/dev/null || true; wait "$chrome" 2>/dev/null || true; }
  return 0
}

results=()
for r in $(seq 1 "$reps"); do
  if [ $((r % 2)) = 1 ]; then order="off on"; else order="on off"; fi
  for mode in $order; do
    line=$(window "$mode" "$r")
    echo "run $r: $line% of a core"
    results+=("$line")
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import json, statistics, sys
by = {}
for line in sys.stdin:
    mode, share = line.split()
    by.setdefault(mode, []).append(float(share))
print(json.dumps({m + "_percent_of_core_median": statistics.median(v) for m, v in by.items()}
                 | {m + "_runs": v for m, v in by.items()}))'

#!/usr/bin/env bash
# Instructions per store operation, ctorch-store against bench/floor_store.c:
# the measure of the server's own work that machine noise does not move.
#   bench/store_callgrind.sh [SECONDS] [CLIENTS] [REPS]   (defaults 3, 32, 5; build first)
#   PROFILE=1 bench/store_callgrind.sh   also prints ctorch-store's costliest
#                                        functions (callgrind_annotate)
# Each server runs under valgrind --tool=callgrind with instrumentation off; once it
# listens, instrumentation is switched on, ctorch-store-bench drives SECONDS of
# --op mixed load from CLIENTS v113 clients, and the counts are dumped. Every
# instruction the server executes in that window (event loop, parser, table,
# system-call wrappers; not the kernel) is divided by the operations the
# client completed. REPS interleaved pairs; the last line gives each server's
# median and their ratio. With many clients the count per operation moves a
# little with the machine's load (how many requests one wake-up of the event
# loop finds), so compare medians; with one client it repeats to within 1%.
# Needs valgrind (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-3}
clients=${2:-32}
reps=${3:-5}
bench=build/bin/ctorch-store-bench
command -v valgrind >/dev/null || { echo "store_callgrind: valgrind is not installed (scripts/setup.sh installs it)"; exit 1; }
out=$(mktemp -d /tmp/store_callgrind.XXXXXX)
pid=""
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$out"; }
trap cleanup EXIT

# Sends a callgrind_control command to $pid. Commands reach a valgrind'ed
# process only while it runs: wake the idle server with a signal it ignores
# (valgrind sees it, the server does no work for it), not a connection, whose
# handling would be counted.
control() {
  callgrind_control "$@" "$pid" >/dev/null 2>&1 &
  local c=$!
  for _ in $(seq 1 300); do
    kill -0 "$c" 2>/dev/null || break
    kill -WINCH "$pid" 2>/dev/null || true
    sleep 0.1
  done
  wait "$c" || true
}

measure() {  # measure NAME CMD...  -> prints NAME instructions/op
  local name=$1; shift
  rm -f "$out/$name".*
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/$name.%p" \
    "$@" >"$out/$name.log" 2>&1 &
  pid=$!
  local port=""
  for _ in $(seq 1 600); do
    port=$(sed -n 's/^listening on .*:\([0-9][0-9]*\)$/\1/p' "$out/$name.log")
    [ -n "$port" ] && break
    sleep 0.05
  done
  [ -n "$port" ] || { cat "$out/$name.log"; echo "store_callgrind: $name did not start"; exit 1; }
  # A short warm-up so that first-connection work (accepts, table growth)
  # stays out of the window.
  "$bench" --port "$port" --dialect v113 --clients "$clients" --seconds 0.5 --op mixed >/dev/null
  control -i on
  local line
  line=$("$bench" --port "$port" --dialect v113 --clients "$clients" --seconds "$seconds" --op mixed | tail -n 1)
  control -d
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=""
  local ops instr
  ops=$(echo "$line" | sed -n 's/.*"ops":\([0-9]*\).*/\1/p')
  # The dump made while collecting (the last one written) holds the window.
  instr=$(cat "$out"/"$name".*.[0-9]* 2>/dev/null | sed -n 's/^summary: \([0-9]*\).*/\1/p' | sort -n | tail -n 1)
  [ -n "$ops" ] && [ -n "$instr" ] && [ "$ops" -gt 0 ] || { echo "store_callgrind: no figures for $name"; ls "$out"; exit 1; }
  if [ -n "${PROFILE:-}" ] && [ "$name" = ctorch ]; then
    callgrind_annotate --inclusive=no "$(ls "$out"/"$name".*.[0-9]* | tail -n 1)" 2>/dev/null |
      sed -n '/^Ir *file:function/,$p' | head -n 40 | cut -c1-160
  fi
  echo "$name: $instr instructions / $ops operations = $(( instr / ops )) per operation"
  eval "all_$name+=\" $(( instr / ops ))\""
}
all_floor=""
all_ctorch=""
for _ in $(seq 1 "$reps"); do
  measure floor build/bin/floor_store 0
  measure ctorch build/bin/ctorch-store --host 127.0.0.1 --port 0
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
m_floor=$(median "$all_floor")
m_ctorch=$(median "$all_ctorch")
echo "median of $reps, $clients clients: floor $m_floor, ctorch-store $m_ctorch instructions per operation," \
  "ratio $(awk -v a="$m_ctorch" -v b="$m_floor" 'BEGIN { printf "%.2f", a / b }')"

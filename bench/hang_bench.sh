#!/usr/bin/env bash
# --hang_timeout: how long after a rank stalls the job is declared hung, and
# how long the diagnosis takes, on the 2-node x 2-worker torch gloo job of
# tests/launcher/hang_test.cc (rank 3 sleeps forever before its step-5 work,
# in attempt 0 only; the job restarts and finishes).
#   bench/hang_bench.sh [RUNS (5)] [TIMEOUT_S (5)]
# Per run: detection = hang_detected (the verdict, node 1's events) minus the
# moment rank 3 fell asleep (written by the worker, same host clock); it
# includes the other ranks' last 0.3 s of step work before they block in
# all_reduce. diagnosis = hang_diagnosed's diagnosis_ms (SIGSTOP, eu-stack,
# SIGABRT and the stacks read back). The last line is JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
timeout_s=${2:-5}
bin=${CTORCHRUN_BIN:-build/bin/ctorchrun}
export CTORCHRUN_PYTHON=${CTORCHRUN_PYTHON:-/usr/bin/python3}
work=$(mktemp -d /tmp/hang_bench_XXXXXX)
trap 'rm -rf "$work"' EXIT
results=()
for run in $(seq 1 "$runs"); do
  d="$work/run$run"
  mkdir -p "$d"
  port=$((20000 + RANDOM % 12000))
  for n in 0 1; do
    timeout 120 "$bin" --nnodes=2 --node_rank=$n --nproc_per_node=2 --master_port=$port \
      --hang_timeout="$timeout_s" --max_restarts=1 --log_dir="$d/logs$n" \
      --events_file="$d/events$n.json" tests/torch/hang_worker.py hang --done-dir "$d" \
      >"$d/out$n.log" 2>&1 &
  done
  wait
  line=$(/usr/bin/python3 - "$d" "$timeout_s" <<'PY'
import datetime, json, sys
d, timeout = sys.argv[1], float(sys.argv[2])
def when(e):
    return datetime.datetime.strptime(e["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()
ev = [json.loads(l) for l in open(f"{d}/events1.json")]
hung = [e for e in ev if e["event"] == "hang_detected"][0]
diag = [e for e in ev if e["event"] == "hang_diagnosed"][0]
fin = [e for e in ev if e["event"] == "finished"][0]
slept = float(open(f"{d}/sleep_at").read())
print(json.dumps({"timeout_s": timeout, "detection_s": round(when(hung) - slept, 3),
                  "over_timeout_s": round(when(hung) - slept - timeout, 3),
                  "diagnosis_ms": diag["diagnosis_ms"], "first_stalled_rank":
                  hung["first_stalled_rank"], "exit_code": fin["exit_code"]}))
PY
)
  echo "run $run: $line"
  results+=("$line")
done
/usr/bin/python3 - "${results[@]}" <<'PY'
import json, statistics, sys
rs = [json.loads(a) for a in sys.argv[1:]]
det = [r["detection_s"] for r in rs]
print(json.dumps({"runs": len(rs), "timeout_s": rs[0]["timeout_s"],
                  "detection_median_s": statistics.median(det), "detection_max_s": max(det),
                  "diagnosis_median_ms": statistics.median(r["diagnosis_ms"] for r in rs),
                  "first_stalled_always_3": all(r["first_stalled_rank"] == 3 for r in rs),
                  "all_exit_0": all(r["exit_code"] == 0 for r in rs)}))
PY

#!/usr/bin/env bash
# A communication-bound DDP training step on gloo and on ctorch, alternately
# in one run (bench/torch_ddp_bench.py under ctorchrun), the unmodified gloo
# script under `ctorchrun --cpu_backend ctorch`, plus the same step
# with no all_reduce at all (every step under no_sync: the floor the
# communication adds to). Prints the load average, one JSON line per run and
# a table of medians over the repetitions.
#   bench/torch_ddp_bench.sh          (build first: scripts/build.sh)
# Environment: NPROC (default 2), REPS (default 3), STEPS (default 10),
# BATCH (default 1), LAYERS (default 4), HIDDEN (default 4096: 67 M parameters).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${CTORCHRUN_PYTHON:-/usr/bin/python3}
export CTORCHRUN_PYTHON=$python
nproc=${NPROC:-2}
reps=${REPS:-3}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)," \
  "$(nproc) cores, $nproc ranks"
for rep in $(seq 1 "$reps"); do
  # "gloo --cpu_backend ctorch": the script unmodified (it asks for gloo), the
  # launcher's --cpu_backend ctorch putting its groups on ctorch.
  for run in "gloo" "ctorch" "gloo --cpu_backend ctorch" "ctorch --no-comm"; do
    launcher=()
    if [[ $run == *--cpu_backend* ]]; then launcher=(--cpu_backend ctorch); run=gloo; fi
    build/bin/ctorchrun --nproc_per_node="$nproc" --master_port=$((20000 + RANDOM % 12000)) \
      "${launcher[@]}" \
      bench/torch_ddp_bench.py --backend $run --steps "${STEPS:-10}" --batch "${BATCH:-1}" \
      --layers "${LAYERS:-4}" --hidden "${HIDDEN:-4096}" 2>/dev/null | tee -a "$out"
  done
done
"$python" - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
med = {b: statistics.median(r["median_ms"] for r in rows if r["backend"] == b)
       for b in dict.fromkeys(r["backend"] for r in rows)}
r = rows[0]
print(f"\nDDP step, {r['world']} ranks, {r['params'] / 1e6:.1f} M parameters, batch {r['batch']} "
      "(median over repetitions of each run's median step)\n")
print("| run | step ms | gloo / run |")
print("| --- | ---: | ---: |")
for b, ms in med.items():
    print(f"| {b} | {ms:.1f} | {med['gloo'] / ms:.2f}x |")
floor = med.get("ctorch-nocomm")
if floor:
    g, c = med["gloo"] - floor, med["ctorch"] - floor
    print(f"\nwhat the all_reduces add to the step: gloo {g:.1f} ms, ctorch {c:.1f} ms"
          + (f" ({g / c:.2f}x less)" if c > 0 else ""))
PY

#!/usr/bin/env bash
# Collective benchmark: ctorch-collective-bench (libctorch_dist on gloo)
# against torch.distributed with gloo (torch 1.13), 2 ranks under ctorchrun,
# same machine, one run, interleaved pairs: for each op a sweep of every size
# with ours, then one with torch's, REPS times (default 3), so machine noise
# hits both alike; the table keeps each side's best (lowest) time per size.
#   bench/collective_bench.sh [--quick] [OPS...]   (build first: scripts/build.sh)
# BACKEND=nccl compares the nccl backends instead (torch 2.x with CUDA; one
# rank per GPU: NPROC defaults to 1 there, 2 for gloo; MAX to 1G).
# Prints one JSON line per measurement and a markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${CTORCHRUN_PYTHON:-/usr/bin/python3}
export CTORCHRUN_PYTHON=$python
backend=${BACKEND:-gloo}
nproc=${NPROC:-$([ "$backend" = nccl ] && echo 1 || echo 2)}
max=${MAX:-$([ "$backend" = nccl ] && echo 1G || echo 256M)}
if [ "${1:-}" = "--quick" ]; then max=1M; shift; fi
ops=${*:-all_reduce broadcast all_gather}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

port() { echo $((20000 + RANDOM % 12000)); }
reps=${REPS:-3}

for rep in $(seq 1 "$reps"); do
  for op in $ops; do
    build/bin/ctorchrun --nproc_per_node="$nproc" --master_port="$(port)" --no_python \
      build/bin/ctorch-collective-bench --backend "$backend" --op "$op" --min-bytes 4 \
      --max-bytes "$max" --json \
      2>/dev/null | sed 's/^/ours /' | tee -a "$out"
    build/bin/ctorchrun --nproc_per_node="$nproc" --master_port="$(port)" \
      bench/collective_bench_torch.py --backend "$backend" --op "$op" --min-bytes 4 \
      --max-bytes "$max" --json \
      2>/dev/null | sed 's/^/torch /' | tee -a "$out"
  done
done

"$python" - "$out" "$nproc" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    r = json.loads(text)
    pair = rows.setdefault((r["op"], r["bytes"]), {})
    if who not in pair or r["time_us"] < pair[who]["time_us"]:
        pair[who] = r
def ratio(a, t):
    # Bus bandwidth is 0 at world size 1: compare algorithm bandwidth there.
    key = "busbw_GBps" if t["busbw_GBps"] > 0 else "algbw_GBps"
    return f"{a[key] / t[key]:.2f}x" + ("" if key == "busbw_GBps" else " (algbw)")
def size(b):
    for unit, n in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n: return f"{b // n} {unit}"
    return f"{b} B"
for op in dict.fromkeys(k[0] for k in rows):
    print(f"\n{op}, {sys.argv[2]} ranks\n")
    print("| size | ours time (us) | torch time (us) | ours busbw (GB/s) | torch busbw (GB/s) | ours / torch busbw |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for (o, b), pair in sorted(rows.items()):
        if o != op or "ours" not in pair or "torch" not in pair: continue
        a, t = pair["ours"], pair["torch"]
        print(f"| {size(b)} | {a['time_us']:.1f} | {t['time_us']:.1f} | {a['busbw_GBps']:.3f} | "
              f"{t['busbw_GBps']:.3f} | {ratio(a, t)} |")
PY

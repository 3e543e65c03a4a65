#!/usr/bin/env bash
# Collective benchmark, four systems in one run on this host, nccl-tests'
# definitions (bytes, mean time of the slowest rank, algbw, busbw):
#   shm    ctorch-collective-bench, libctorch_dist's default between ranks of
#          one host (the shared-memory path; single copy off)
#   gloo   the same with CTORCHRUN_DIST_SHM=0 (gloo over loopback TCP)
#   shm-cma    shm with CTORCHRUN_DIST_SHM_CMA=1 (the single-copy all_reduce
#          switched on; not in the default set)
#   shm-nocma  shm with CTORCHRUN_DIST_SHM_CMA=0 (the default, said
#          explicitly; not in the default set)
#   torch  torch.distributed with gloo (bench/collective_bench_torch.py;
#          all_reduce, broadcast, all_gather, reduce_scatter, barrier)
#   ctorch torch.distributed with ctorchrun's own backend (the same script,
#          --backend ctorch: torch_backend/, `import ctorch`; not in the
#          default set: SYSTEMS="ctorch torch" compares the two)
#   unmodified  the torch script asking for gloo, run under
#          `ctorchrun --cpu_backend ctorch` (its groups on ctorch without
#          `import ctorch`; not in the default set)
#   mpi    Open MPI (build/bin/ctorch-mpi-bench under mpirun --oversubscribe
#          --allow-run-as-root; built when CMake finds MPI)
# For each repetition, world size and op, the four sweep every size in turn,
# so that machine noise hits all alike; the tables give each system's median
# time per size over the repetitions.
#   bench/collective_bench.sh [--quick] [OPS...]     (build first: scripts/build.sh)
# Environment: NPROCS (default "2 4"), REPS (default 3), MIN (default 4),
# MAX (default 256M),
# SYSTEMS (default "shm gloo torch mpi"). Prints the load average, the
# memory-bandwidth floor (build/bin/ctorch-membw), one JSON line per
# measurement and a markdown table per op and world size.
# BACKEND=nccl compares the nccl backends instead (ours against torch 2.x
# with CUDA; one rank per GPU: NPROCS defaults to 1 there; MAX to 1G).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${CTORCHRUN_PYTHON:-/usr/bin/python3}
export CTORCHRUN_PYTHON=$python
backend=${BACKEND:-gloo}
if [ "$backend" = nccl ]; then
  nprocs=${NPROCS:-${NPROC:-1}}
  max=${MAX:-1G}
  systems=${SYSTEMS:-ours torch}
else
  nprocs=${NPROCS:-${NPROC:-2 4}}
  max=${MAX:-256M}
  systems=${SYSTEMS:-shm gloo torch mpi}
fi
if [ "${1:-}" = "--quick" ]; then max=1M; shift; fi
ops=${*:-all_reduce broadcast all_gather}
min=${MIN:-4}
reps=${REPS:-3}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

port() { echo $((20000 + RANDOM % 12000)); }

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)," \
  "$(nproc) cores"
if [ -x build/bin/ctorch-membw ]; then
  echo "# memory-bandwidth floor: $(build/bin/ctorch-membw)"
fi

ours() {  # SHM_SWITCH NPROC OP [CMA_SWITCH]
  CTORCHRUN_DIST_SHM_CMA=${4:-${CTORCHRUN_DIST_SHM_CMA:-0}} CTORCHRUN_DIST_SHM=$1 \
    build/bin/ctorchrun --nproc_per_node="$2" --master_port="$(port)" \
    --no_python build/bin/ctorch-collective-bench --backend "$backend" --op "$3" \
    --min-bytes "$min" --max-bytes "$max" --json 2>/dev/null
}

for rep in $(seq 1 "$reps"); do
  for n in $nprocs; do
    for op in $ops; do
      for who in $systems; do
        case $who in
          shm | ours)
            # ctorch-collective-bench has no barrier. (This case runs in the
            # pipeline's subshell: `continue` would not reach the loop.)
            if [ "$op" != barrier ]; then ours 1 "$n" "$op"; fi
            ;;
          gloo) ours 0 "$n" "$op" ;;
          shm-nocma) ours 1 "$n" "$op" 0 ;;
          shm-cma) ours 1 "$n" "$op" 1 ;;
          torch | ctorch | unmodified)
            tb=$backend
            if [ "$who" = ctorch ]; then tb=ctorch; fi
            cpu_backend=gloo
            if [ "$who" = unmodified ]; then cpu_backend=ctorch; fi
            case $op in
              all_reduce | broadcast | all_gather | reduce_scatter | barrier)
                build/bin/ctorchrun --nproc_per_node="$n" --master_port="$(port)" \
                  --cpu_backend "$cpu_backend" \
                  bench/collective_bench_torch.py --backend "$tb" --op "$op" --min-bytes "$min" \
                  --max-bytes "$max" --json 2>/dev/null
                ;;
            esac
            ;;
          mpi)
            if [ ! -x build/bin/ctorch-mpi-bench ] || ! command -v mpirun >/dev/null; then
              echo "collective_bench: no MPI (install openmpi-bin libopenmpi-dev, rebuild)" >&2
            else
              mpirun --oversubscribe --allow-run-as-root -np "$n" build/bin/ctorch-mpi-bench \
                --op "$op" --min-bytes "$min" --max-bytes "$max" 2>/dev/null
            fi
            ;;
        esac | sed "s/^/$who /" | tee -a "$out"
      done
    done
  done
done

"$python" - "$out" "$systems" <<'PY'
import json, statistics, sys
systems = sys.argv[2].split()
times = {}
for line in open(sys.argv[1]):
    who, _, text = line.partition(" ")
    try:
        r = json.loads(text)
    except ValueError:
        continue
    times.setdefault((r["op"], r["world"], r["bytes"]), {}).setdefault(who, []).append(r)
def size(b):
    for unit, n in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n: return f"{b // n} {unit}"
    return f"{b} B"
def median(rows):
    t = statistics.median(r["time_us"] for r in rows)
    r = rows[0]
    algbw = r["bytes"] / t / 1e3
    factor = r["busbw_GBps"] / r["algbw_GBps"] if r["algbw_GBps"] > 0 else 0
    return t, algbw * factor if factor > 0 else algbw
for op, world in dict.fromkeys((k[0], k[1]) for k in times):
    print(f"\n{op}, {world} ranks (median of the repetitions; busbw in GB/s, algbw where busbw is 0)\n")
    head = ["size"] + [f"{s} us" for s in systems] + [f"{s} busbw" for s in systems]
    ratios = [("shm", "mpi"), ("shm", "torch")] if "shm" in systems else []
    if "ctorch" in systems: ratios += [("ctorch", "torch")] + ([("ctorch", "shm")] if "shm" in systems else [])
    if "unmodified" in systems: ratios += [("unmodified", "torch")] + ([("unmodified", "ctorch")] if "ctorch" in systems else [])
    if "shm-nocma" in systems: ratios.append(("shm-nocma", "torch"))
    if "shm-cma" in systems: ratios.append(("shm-cma", "shm"))
    head += [f"{a}/{b}" for a, b in ratios]
    print("| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    for (o, w, b), per in sorted(times.items()):
        if (o, w) != (op, world): continue
        m = {s: median(per[s]) for s in systems if s in per}
        cells = [size(b)]
        cells += [f"{m[s][0]:.1f}" if s in m else "-" for s in systems]
        cells += [f"{m[s][1]:.3f}" if s in m else "-" for s in systems]
        for a, c in ratios:
            if a in m and c in m and m[c][1] > 0:
                cells.append(f"{m[a][1] / m[c][1]:.2f}x")
            elif a in m and c in m and m[a][0] > 0:  # no bandwidth (barrier): time ratio
                cells.append(f"{m[c][0] / m[a][0]:.2f}x")
            else:
                cells.append("-")
        print("| " + " | ".join(cells) + " |")
PY

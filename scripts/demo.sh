#!/usr/bin/env bash
# Sets up, builds, and runs an example: ctorch-store serving real PyTorch
# (torch 1.13) processes: two gloo workers rendezvous through it exactly as
# they would through torchrun's agent store, then all_reduce.
set -euo pipefail
cd "$(dirname "$0")/.."
export CTORCHRUN_PYTHON=${CTORCHRUN_PYTHON:-/usr/bin/python3}

scripts/setup.sh
scripts/build.sh >/dev/null
echo "demo: built build/bin/ctorch-store"

log=$(mktemp)
build/bin/ctorch-store --host 127.0.0.1 --port 0 >"$log" 2>&1 &
store_pid=$!
trap 'kill "$store_pid" 2>/dev/null || true; wait "$store_pid" 2>/dev/null || true; rm -f "$log"' EXIT
port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^listening on .*:\([0-9][0-9]*\)$/\1/p' "$log")
  [ -n "$port" ] && break
  sleep 0.05
done
[ -n "$port" ] || { cat "$log"; echo "demo: ctorch-store did not start"; exit 1; }
echo "demo: ctorch-store listening on 127.0.0.1:$port"

echo "demo: two torch gloo workers init_process_group + all_reduce through it"
"$CTORCHRUN_PYTHON" tests/torch/run_gloo_pair.py --host 127.0.0.1 --port "$port" --world 2

echo "demo: a torch TCPStore client's view"
"$CTORCHRUN_PYTHON" - "$port" <<'PY'
import sys, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, datetime.timedelta(seconds=10))
store.set("greeting", "hello from torch " + __import__("torch").__version__)
print("  get(greeting) ->", store.get("greeting").decode())
print("  add(counter, 5) ->", store.add("counter", 5))
print("  num_keys() ->", store.num_keys(), "(the workers' keys included)")
PY
echo "demo: done"

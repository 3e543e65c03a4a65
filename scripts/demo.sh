#!/usr/bin/env bash
# Sets up, builds, and runs an example job: a real PyTorch DDP training script
# (examples/ddp_train.py, torch 1.13, gloo, 2 workers) under ctorchrun, where
# rank 1 crashes at the start of epoch 1; ctorchrun restarts every worker, they
# resume from the checkpoint of epoch 0, and the result is bit-identical to a
# run that never crashed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CTORCHRUN_PYTHON=${CTORCHRUN_PYTHON:-/usr/bin/python3}

scripts/setup.sh
scripts/build.sh >/dev/null
echo "demo: built build/bin/ctorchrun"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo
echo "demo: 1. a clean run: ctorchrun --standalone --nproc_per_node=2 examples/ddp_train.py --epochs 3"
build/bin/ctorchrun --standalone --nproc_per_node=2 \
  examples/ddp_train.py --workdir "$work/clean" --epochs 3

echo
echo "demo: 2. the same job, rank 1 crashing (exit 3) at the start of epoch 1, --max_restarts=1"
build/bin/ctorchrun --standalone --nproc_per_node=2 --max_restarts=1 \
  examples/ddp_train.py --workdir "$work/crash" --epochs 3 --fail-once-at-epoch 1

clean=$("$CTORCHRUN_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$work/clean/result.json")
crash=$("$CTORCHRUN_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$work/crash/result.json")
how=$("$CTORCHRUN_PYTHON" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("attempt %s, resumed from epoch %s" % (r["attempt"], r["resumed_from"]))' "$work/crash/result.json")
echo
echo "demo: final parameters, clean run:           sha256 $clean"
echo "demo: final parameters, crashed and resumed: sha256 $crash ($how)"
if [ "$clean" = "$crash" ]; then
  echo "demo: identical: the restarted job resumed from its checkpoint and lost nothing"
else
  echo "demo: the digests differ"
  exit 1
fi

echo
echo "demo: 3. a C++ worker on libctorch_dist: build/bin/ctorch-train-example, clean and crashing at epoch 3"
build/bin/ctorchrun --standalone --nproc_per_node=2 --no_python \
  build/bin/ctorch-train-example --workdir "$work/cxx-clean" --epochs 5
build/bin/ctorchrun --standalone --nproc_per_node=2 --max_restarts=1 --no_python \
  build/bin/ctorch-train-example --workdir "$work/cxx-crash" --epochs 5 --fail-once-at-epoch 3
cxx_clean=$("$CTORCHRUN_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$work/cxx-clean/result.json")
cxx_crash=$("$CTORCHRUN_PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$work/cxx-crash/result.json")
echo "demo: C++ trainer, clean run:           sha256 $cxx_clean"
echo "demo: C++ trainer, crashed and resumed: sha256 $cxx_crash"
if [ "$cxx_clean" = "$cxx_crash" ]; then
  echo "demo: identical: the C++ workers resumed from their checkpoint and lost nothing"
else
  echo "demo: the C++ trainer's digests differ"
  exit 1
fi

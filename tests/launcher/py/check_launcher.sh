#!/bin/bash
# Runs the launcher worker scripts (examples/ddp_train.py, dump_env.py,
# fail_worker.py) under a torchrun-compatible launcher and checks the outcomes.
#
# Usage: tests/launcher/py/check_launcher.sh [WORKDIR]
#   LAUNCHER   launcher command and leading flags (word-split), default
#              "/usr/bin/torchrun --redirects 9:1 --tee 9:1 --monitor_interval 0.1"
#              (Debian's torchrun crashes on Python 3.11 without the
#              --redirects/--tee pair; any rank >= nproc is harmless).
#   PYTHON     interpreter for the helpers, default /usr/bin/python3
#   TIMEOUT_S  bound on each launcher run, default 120
# Prints one PASS/FAIL line per check with its wall time, then `N passed, M failed`;
# exits 0 only when all passed. Works with the reference torchrun (torch 1.13).
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PY_DIR="$ROOT/tests/launcher/py"
LAUNCHER=${LAUNCHER:-"/usr/bin/torchrun --redirects 9:1 --tee 9:1 --monitor_interval 0.1"}
PYTHON=${PYTHON:-/usr/bin/python3}
TIMEOUT_S=${TIMEOUT_S:-120}
W=${1:-$(mktemp -d /tmp/check_launcher.XXXXXX)}
mkdir -p "$W"
passed=0
failed=0

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }
# launch NAME NPROC [launcher flags...] -- script args...; output in $W/NAME.log, rc in $RC, secs in $SECS
launch() {
  local name=$1 nproc=$2
  shift 2
  local flags=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  local t0
  t0=$(now)
  # shellcheck disable=SC2086
  timeout "$TIMEOUT_S" $LAUNCHER --nproc_per_node "$nproc" --master_addr 127.0.0.1 --master_port "$(free_port)" \
    "${flags[@]}" "$@" >"$W/$name.log" 2>&1
  RC=$?
  SECS=$(printf '%.2f' "$(echo "$(now) - $t0" | bc)")
}
check() { # check NAME CONDITION-TEXT COMMAND...
  local name=$1 what=$2
  shift 2
  if "$@"; then
    passed=$((passed + 1)); echo "PASS $name (${SECS}s): $what"
  else
    failed=$((failed + 1)); echo "FAIL $name (${SECS}s): $what (rc=$RC, log $W/$name.log)"
  fi
}
json() { "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@" 2>/dev/null; }

# 1. Uninterrupted DDP training, then a run that fails once (rank 1, epoch 1) and resumes.
launch ddp_plain 2 -- "$ROOT/examples/ddp_train.py" --workdir "$W/ddp_plain" --epochs 3
check ddp_plain "rc 0 and result.json written" \
  test "$RC" = 0 -a -n "$(json "$W/ddp_plain/result.json" 'd["digest"]')"
launch ddp_resume 2 --max_restarts 1 -- "$ROOT/examples/ddp_train.py" --workdir "$W/ddp_resume" --epochs 3 --fail-once-at-epoch 1
check ddp_resume "rc 0, attempt 1, resumed_from 1, same digest as ddp_plain" \
  test "$RC" = 0 -a "$(json "$W/ddp_resume/result.json" '(d["attempt"], d["resumed_from"], d["digest"])')" \
  = "(1, 1, '$(json "$W/ddp_plain/result.json" 'd["digest"]')')"

# 2. Worker environment: two runs, compared.
for run in env1 env2; do
  DUMP_DIR="$W/$run" launch "$run" 2 -- "$PY_DIR/dump_env.py" --init-pg
  check "$run" "rc 0 and env_rank0/1.json written" test "$RC" = 0 -a -f "$W/$run/env_rank0.json" -a -f "$W/$run/env_rank1.json"
done
"$PYTHON" "$PY_DIR/compare_env.py" "$W/env1" "$W/env2" >"$W/compare_env.log" 2>&1
RC=$?; SECS=0
check compare_env "$(tail -1 "$W/compare_env.log")" test "$RC" = 0

# 3. Failures.
launch exit3 2 -- "$PY_DIR/fail_worker.py" --rank 1 --code 3 --delay 0.5 --sleep 30
check exit3 "rank 1 exits 3, peer sleeping 30 s: launcher rc 1 well before 30 s" \
  test "$RC" = 1 -a "$(echo "$SECS < 25" | bc)" = 1
launch raise 2 --log_dir "$W/raise_logs" -- "$PY_DIR/fail_worker.py" --rank 0 --raise --delay 0.5 --sleep 30
ERR=$(find "$W/raise_logs" -path '*/attempt_0/0/error.json' 2>/dev/null | head -1)
check raise "rc 1; log_dir/<run>/attempt_0/0/error.json says 'ValueError: boom from rank 0'" \
  test "$RC" = 1 -a "$(json "${ERR:-/nonexistent}" 'd["message"]["message"]')" = "ValueError: boom from rank 0"
launch segv 2 -- "$PY_DIR/fail_worker.py" --rank 0 --signal SEGV --delay 0.5 --sleep 30
check segv "rc 1 and the summary shows exitcode -11" \
  test "$RC" = 1 -a "$(grep -c 'exitcode  : -11' "$W/segv.log")" -ge 1

# 4. Restarts: rank 1 fails on attempts 0 and 1, then everything succeeds.
launch flaky 2 --max_restarts 3 -- "$PY_DIR/fail_worker.py" --rank 1 --fail-until-attempt 2 --code 4 --delay 0.5 --sleep 1 --stamp-dir "$W/flaky_stamps"
check flaky "rc 0 with start stamps for attempts 0, 1, 2 of both ranks" \
  test "$RC" = 0 -a "$(cd "$W/flaky_stamps" 2>/dev/null && printf '%s ' attempt*)" \
  = "attempt0_rank0 attempt0_rank1 attempt1_rank0 attempt1_rank1 attempt2_rank0 attempt2_rank1 "

echo "workdir: $W"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]

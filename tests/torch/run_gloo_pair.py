#!/usr/bin/env python3
"""Launch real torch gloo workers against a running store server, torchrun-style.

Usage: python3 run_gloo_pair.py --host 127.0.0.1 --port P [--world 2]
                 [--attempt 0] [--deadline-s 50] [--worker-timeout-s 30]

Starts `world` copies of gloo_worker.py with the python that runs this script
(sys.executable: torch 1.13's /usr/bin/python3, or scripts/torch2/python), each in its own
session/process group, with the environment torchrun gives workers of a static
rendezvous (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT=0 unless --attempt,
OMP_NUM_THREADS=1), so they are pure clients of the server at host:port.
Waits up to --deadline-s (default 50, keeping the whole run under 60 s), then
kills the process group of every straggler. Per worker, checks that it exited 0
and printed `rank R ok ...` after `rank R torch <version>` with this python's
torch (major.minor: a worker of another torch fails); prints `ok <name>` / `FAIL <name>: <detail>`, a
final `N passed, M failed`, and exits 0 only if all passed. Output of failed
workers goes to stderr.

The gloo keys a run leaves in the store (`//worker/attempt_N/default_pg/...`
with torch 1.13, `/default_pg/...` with torch 2.x: peer addresses, barrier
counter) are read as-is by a later run (with the same attempt number, on 1.13),
whose workers then fail (wrong address size, connect to dead ports). Use a
fresh server per run; with torch 1.13 a new --attempt (exported as
TORCHELASTIC_RESTART_COUNT, hence a new key prefix) for each run on one server
also does.
"""
import argparse
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

PYTHON = sys.executable
TORCH = ".".join(importlib.metadata.version("torch").split(".")[:2])  # e.g. 2.6
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_worker.py")
ALARM_S = 58  # last-resort bound on the whole script


def kill_group(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)  # the worker's own group (start_new_session)
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--attempt", type=int, default=0,
                    help="TORCHELASTIC_RESTART_COUNT for the workers (key prefix)")
    ap.add_argument("--deadline-s", type=float, default=50.0)
    ap.add_argument("--worker-timeout-s", type=float, default=30.0)
    a = ap.parse_args()

    procs, logs = [], []

    def on_alarm(*_):
        for p in procs:
            kill_group(p)
        print(f"FAIL watchdog: run exceeded {ALARM_S}s", flush=True)
        print(f"0 passed, {2 * a.world + 1} failed", flush=True)
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(ALARM_S)

    for rank in range(a.world):
        env = dict(os.environ,
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.world),
                   MASTER_ADDR=a.host, MASTER_PORT=str(a.port),
                   TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT=str(a.attempt), OMP_NUM_THREADS="1")
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [PYTHON, WORKER, "--timeout-s", str(a.worker_timeout_s)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    deadline = time.monotonic() + a.deadline_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    timed_out = [p.poll() is None for p in procs]
    for p in procs:
        kill_group(p)

    passed = failed = 0
    for rank, (p, log, late) in enumerate(zip(procs, logs, timed_out)):
        log.seek(0)
        out = log.read()
        results = [
            (f"worker{rank}_exit_0",
             None if p.returncode == 0 else
             f"killed after {a.deadline_s:.0f}s" if late else f"exit status {p.returncode}"),
            (f"worker{rank}_ok_line",
             None if re.search(rf"^rank {rank} torch {re.escape(TORCH)}\.[^\n]*\n(.*\n)*"
                               rf"rank {rank} ok \S+$", out, re.M)
             else f"no `rank R ok` line after `rank R torch {TORCH}.*`"),
        ]
        for name, err in results:
            if err is None:
                passed += 1
                print(f"ok {name}", flush=True)
            else:
                failed += 1
                print(f"FAIL {name}: {err}", flush=True)
        if any(err for _, err in results):
            sys.stderr.write(f"--- worker {rank} output ---\n{out[-4000:]}\n")
    signal.alarm(0)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Node-loss benchmark: for a c10d job of --nnodes=1:2 running on two nodes,
# the time from one node's loss (SIGKILL of the second agent, its process
# group and everything it started) to the survivor's workers running again,
# for torchrun (torch 1.13) and for ctorchrun, same machine, one run,
# launchers alternating per run so that machine noise hits both alike. On
# loopback.
#
#   bench/c10d_loss_bench.sh [--runs N] [--ctorchrun PATH] [--only torchrun|ctorchrun]
#     [--torchrun PATH] [--python PY]   (torch 2.6: --torchrun scripts/torch2/torchrun
#     --python scripts/torch2/python)
#                            [--deadline S] [--startup-deadline S] [--keep-logs DIR]
#
# Each run, for each launcher, two agents with the same command line
#   LAUNCHER --redirects 9:1 --tee 9:1 --monitor_interval 0.1 --nnodes=1:2
#     --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:P
#     --rdzv_id=X --rdzv_conf=last_call_timeout=1 --max_restarts=5
#     bench/c10d_join_worker.py
# (P a free port found by a bind test, X fresh), each in its own session
# (setsid): agent 1 starts and, once the endpoint accepts connections (agent
# 1 hosts the store), agent 2. When both workers have stepped 3 times at
# world=2 (bench/c10d_join_worker.py: one gloo all_reduce every 0.2 s, one
# "STEP t=<time.time()> world=<n> rank=<r>" line each) the harness records
# T0 = time.time() and SIGKILLs agent 2's process group and, by pid, every
# process agent 2 started (its descendants and whatever carries agent 2's
# tag in its environment: workers may sit in other groups), and checks
# for 2 s that all of them are gone (any left is reported with the run).
# Results, on the one host clock:
#   survivor stepping again: agent 1's first STEP line after its first START
#     line with t > T0 (a line of the old worker, finishing a step as the
#     peer dies, does not count), minus T0; the world it reports;
#   worker started: that START line's t minus T0 (the survivor's new worker
#     process began, before importing torch);
#   restart spent: TORCHELASTIC_RESTART_COUNT of the survivor's worker before
#     the loss and of its new worker, read from /proc/PID/environ (the pid is
#     on the START line), and the launcher's log lines about it after T0
#     (ctorchrun: "no restart charged"; torchrun: "attempts left",
#     "restart_count="; both launchers run with LOGLEVEL=INFO, which
#     torchrun needs to log these).
# A run has --deadline seconds (default 90) from T0; a run without a new
# step by then is reported as a timeout, or as failed when agent 1 exited,
# and is left out of the median (never hidden: each run is printed). Then
# everything is stopped (stop file, SIGTERM to the process groups and to
# each descendant by pid, SIGKILL after 15 s) and the harness checks with
# pgrep and /proc that none of its processes is left.
#
# torchrun is Debian's /usr/bin/torchrun (Python 3.11 needs its
# --redirects/--tee workaround; ctorchrun accepts the same flags). ctorchrun:
# --ctorchrun PATH, else build/bin/ctorchrun, else build/cli/ctorchrun
# (build: scripts/build.sh, or ninja -C build ctorchrun). Workers run on
# /usr/bin/python3 (CTORCHRUN_PYTHON). The process handling (sessions, tags,
# kills, leftover checks) is bench/benchproc.py's.
set -euo pipefail
cd "$(dirname "$0")/.."
exec /usr/bin/python3 - "$@" <<'PY'
import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import benchproc as bp  # noqa: E402

PYTHON = "/usr/bin/python3"
WORKER = "bench/c10d_join_worker.py"
# Launcher log lines about restarts and lost nodes, kept when they follow T0.
NOTE = re.compile(r"restart|attempts left|gives way|lost|FAILED|Detected|heartbeat|dead",
                  re.IGNORECASE)

ap = argparse.ArgumentParser(prog="bench/c10d_loss_bench.sh")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--ctorchrun", default=None, help="ctorchrun binary")
ap.add_argument("--torchrun", default="/usr/bin/torchrun")
ap.add_argument("--python", default=PYTHON,
                help="the workers' python (scripts/torch2/python: torch 2.6)")
ap.add_argument("--only", choices=["torchrun", "ctorchrun"], default=None)
ap.add_argument("--deadline", type=float, default=90.0, help="seconds from the loss")
ap.add_argument("--startup-deadline", type=float, default=60.0,
                help="seconds for both agents to step 3 times at world=2")
ap.add_argument("--keep-logs", default=None, help="copy every agent's log into this folder")
args = ap.parse_args()
if args.runs < 1:
    sys.exit("--runs must be at least 1")

launchers = {"torchrun": args.torchrun}
if args.only != "torchrun":
    path = args.ctorchrun or next((p for p in ("build/bin/ctorchrun", "build/cli/ctorchrun")
                                   if os.access(p, os.X_OK)), None)
    if not path or not os.access(path, os.X_OK):
        sys.exit("no ctorchrun binary: build it (ninja -C build ctorchrun) or pass --ctorchrun PATH"
                 " (or --only torchrun)")
    launchers["ctorchrun"] = os.path.abspath(path)
if args.only == "ctorchrun":
    del launchers["torchrun"]
if "torchrun" in launchers and not os.access(launchers["torchrun"], os.X_OK):
    sys.exit(f"no torchrun at {launchers['torchrun']}")

tag = bp.Tag(f"clb{os.getpid()}x{random.randrange(1 << 30):x}", "CLB_TAG", "CLB_NODE")
top = tempfile.mkdtemp(prefix="c10d_loss_bench.")
bp.exit_on_signals()


def measure(launcher, run):
    path = launchers[launcher]
    work = os.path.join(top, f"{launcher}-{run}")
    os.makedirs(os.path.join(work, "tmp"))
    port = bp.free_port()
    rdzv_id = f"{tag}_{launcher}_{run}"
    stop_file = os.path.join(work, "stop")
    env = dict(os.environ)
    env.update(tag.env(), CJB_STOP_FILE=stop_file,
               CJB_MAX_SECONDS=str(int(args.startup_deadline + args.deadline + 30)),
               CTORCHRUN_PYTHON=args.python, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               LOGLEVEL="INFO", TMPDIR=os.path.join(work, "tmp"))
    cmd = [path, "--redirects", "9:1", "--tee", "9:1", "--monitor_interval", "0.1",
           "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
           "--rdzv_conf=last_call_timeout=1", "--max_restarts=5", WORKER]
    res = {"launcher": launcher, "run": run, "port": port, "status": None}
    a1 = a2 = None
    try:
        a1 = bp.Agent("agent1", cmd, dict(env, **tag.env(1)), os.path.join(work, "agent1.log"),
                      notes=NOTE)
        t_a1 = time.time()
        end = time.monotonic() + args.startup_deadline
        while not bp.accepts(port):  # agent 1 hosts the store: it must bind first
            if a1.proc.poll() is not None:
                res.update(status=f"failed: agent 1 exited rc={a1.proc.returncode} before "
                                  "binding the endpoint", agent1_tail=a1.tail())
                return res
            if time.monotonic() > end:
                res.update(status="timeout: the endpoint did not accept connections within "
                                  f"{args.startup_deadline:g} s", agent1_tail=a1.tail())
                return res
            time.sleep(0.02)
        a2 = bp.Agent("agent2", cmd, dict(env, **tag.env(2)), os.path.join(work, "agent2.log"),
                      notes=NOTE)
        res["agent2_start_after_agent1_s"] = round(time.time() - t_a1, 3)
        while True:  # both nodes stepping together
            a1.poll()
            a2.poll()
            if a1.steps(2) >= 3 and a2.steps(2) >= 3:
                break
            for n, a in ((1, a1), (2, a2)):
                if a.proc.poll() is not None:
                    res.update(status=f"failed: agent {n} exited rc={a.proc.returncode} before "
                                      "the world of 2 stepped",
                               agent1_tail=a1.tail(), agent2_tail=a2.tail())
                    return res
            if time.monotonic() > end:
                res.update(status=f"timeout: no world of 2 stepping within {args.startup_deadline:g} s",
                           agent1_tail=a1.tail(), agent2_tail=a2.tail())
                return res
            time.sleep(0.02)
        res["world2_stepping_after_agent1_s"] = round(time.time() - t_a1, 3)
        a1.poll()
        old = a1.last_start()
        res["restart_count_before"] = bp.restart_count(old[4]) if old else None
        seen = len(a1.events)
        t0, survived = bp.kill_node(tag, a2, 2)
        res["t0"] = t0
        if survived:
            res["node2_alive_after_kill"] = survived
        end = time.monotonic() + args.deadline
        counts = {}  # pid of a worker started after the loss -> its TORCHELASTIC_RESTART_COUNT
        while True:
            a1.poll()
            starts, step = a1.after(t0)
            for e in starts:
                if e[4] not in counts:
                    counts[e[4]] = bp.restart_count(e[4]) or "?"
            if step is not None:
                res.update(status="ok", survivor_step_s=round(step[1] - t0, 4),
                           survivor_world=step[2],
                           worker_started_s=round(starts[0][1] - t0, 4),
                           worker_start_to_step_s=round(step[1] - starts[-1][1], 4),
                           workers_started=len(starts),
                           restart_count_after=counts[starts[-1][4]])
                break
            if a1.proc.poll() is not None:
                a1.poll()
                if a1.after(t0)[1] is None:
                    res.update(status=f"failed: agent 1 exited rc={a1.proc.returncode} after "
                                      f"{time.time() - t0:.2f} s without a new step",
                               agent1_tail=a1.tail())
                    break
                continue
            if time.monotonic() > end:
                res.update(status=f"timeout: no new step within {args.deadline:g} s of the loss",
                           worker_started_s=round(starts[0][1] - t0, 4) if starts else None,
                           agent1_tail=a1.tail())
                break
            time.sleep(0.02)
        a1.poll()
        res["agent1_notes_after_loss"] = [e[1] for e in a1.events[seen:] if e[0] == "note"][:20]
        return res
    finally:
        bp.end_run(tag, res, [a1, a2], stop_file, args.keep_logs, f"{launcher}-{run}")


results = []
orphans = []
try:
    print(f"# c10d loss bench: nproc {len(os.sched_getaffinity(0))}, load average {bp.load()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, runs {args.runs}, "
          f"deadline {args.deadline:g} s", flush=True)
    for name, path in launchers.items():
        print(f"# {name}: {path}", flush=True)
    bp.alternate(launchers, args.runs, measure, results)
finally:
    # Nothing of ours may outlive the harness: agents carry the tag in their
    # --rdzv_id, everything they start in its environment.
    orphans = bp.end_harness(tag, top)
    if args.keep_logs:
        print(f"# logs in {args.keep_logs}", flush=True)

print(f"# load average at the end {bp.load()}")
print()
print("| launcher | loss -> survivor stepping again, median | each run (s) "
      "| loss -> worker started, median | survivor's world | restart count before -> after | ok / runs |")
print("| --- | --- | --- | --- | --- | --- | --- |")
medians = {}
for name in launchers:
    rs = [r for r in results if r["launcher"] == name]
    ok = [r for r in rs if r["status"] == "ok"]
    each = ", ".join(f"{r['survivor_step_s']:.3f}" if r["status"] == "ok"
                     else r["status"].split(":")[0] for r in rs)
    worlds = ", ".join(sorted({str(r["survivor_world"]) for r in ok})) or "-"
    counts = ", ".join(f"{r.get('restart_count_before')} -> {r.get('restart_count_after')}" for r in ok) or "-"
    if ok:
        medians[name] = statistics.median(r["survivor_step_s"] for r in ok)
        ms = statistics.median(r["worker_started_s"] for r in ok)
        print(f"| {name} | {medians[name]:.3f} s | {each} | {ms:.3f} s | {worlds} | {counts} "
              f"| {len(ok)} / {len(rs)} |")
    else:
        print(f"| {name} | - | {each} | - | - | - | 0 / {len(rs)} |")
if "torchrun" in medians and "ctorchrun" in medians:
    print(f"\ntorchrun / ctorchrun: {medians['torchrun'] / medians['ctorchrun']:.1f}x")
elif len(launchers) == 2:
    print("\ntorchrun / ctorchrun: - (a launcher has no successful run)")
for r in results:
    if r["status"] != "ok":
        print(f"\n{r['launcher']} run {r['run']}: {r['status']}")
        for key in ("agent1_tail", "agent2_tail"):
            for line in r.get(key, []):
                print(f"  {key[:6]}| {line}")
sys.exit(1 if orphans else 0)
PY

#!/usr/bin/env bash
# Elastic growth benchmark: for a c10d job of --nnodes=1:2, the time from a
# second node's arrival to the grown world's workers running, for torchrun
# (torch 1.13) and for ctorchrun, same machine, one run, launchers
# alternating per run so that machine noise hits both alike. On loopback.
#
#   bench/c10d_join_bench.sh [--runs N] [--ctorchrun PATH] [--only torchrun|ctorchrun]
#     [--torchrun PATH] [--python PY]   (torch 2.6: --torchrun scripts/torch2/torchrun
#     --python scripts/torch2/python)
#                            [--deadline S] [--nnodes SPEC] [--lead-delay S] [--keep-logs DIR]
#
# Each run, for each launcher, two agents with the same command line
#   LAUNCHER --redirects 9:1 --tee 9:1 --monitor_interval 0.1 --nnodes=1:2
#     --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:P
#     --rdzv_id=X --rdzv_conf=last_call_timeout=1 --max_restarts=5
#     bench/c10d_join_worker.py
# (P a free port found by a bind test, X fresh): agent 1 starts, forms a
# world of 1 and steps (bench/c10d_join_worker.py: one gloo all_reduce every
# 0.2 s, one "STEP t=<time.time()> world=<n> rank=<r>" line each); once it has
# stepped 3 times the harness records T0 = time.time() and starts agent 2.
# T1 = the first STEP line with world=2 (either node's; agent 2's own first
# line is reported too). Result: T1 - T0. Both clocks are the same host's
# time.time(). Also reported: the first START line of a world=2 worker (the
# grown world's worker process began, before importing torch) minus T0. A run has --deadline seconds (default 60) from T0; a run that
# ends without a world=2 step is reported as a timeout, or as refused when
# agent 2 exited first, and is left out of the median (never hidden: each
# run is printed). Then both agents and every process they started are
# stopped (stop file, SIGTERM to their process groups and to each
# descendant by pid, SIGKILL after 15 s) and the harness checks with pgrep
# and /proc that none of its processes is left.
#
# --nnodes=2 (fixed size; agent 1 cannot step alone) starts agent 2
# --lead-delay seconds (default 3) after agent 1 instead: the same
# measurement from the second agent's start to the first world=2 step.
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
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import benchproc as bp  # noqa: E402

PYTHON = "/usr/bin/python3"
WORKER = "bench/c10d_join_worker.py"

ap = argparse.ArgumentParser(prog="bench/c10d_join_bench.sh")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--ctorchrun", default=None, help="ctorchrun binary")
ap.add_argument("--torchrun", default="/usr/bin/torchrun")
ap.add_argument("--python", default=PYTHON,
                help="the workers' python (scripts/torch2/python: torch 2.6)")
ap.add_argument("--only", choices=["torchrun", "ctorchrun"], default=None)
ap.add_argument("--deadline", type=float, default=60.0, help="seconds from agent 2's start")
ap.add_argument("--startup-deadline", type=float, default=60.0,
                help="seconds for agent 1 to step alone")
ap.add_argument("--nnodes", default="1:2")
ap.add_argument("--lead-delay", type=float, default=3.0,
                help="fixed-size --nnodes: seconds between the two agents' starts")
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
min_nodes = int(args.nnodes.split(":")[0])
grows = ":" in args.nnodes and min_nodes < int(args.nnodes.split(":")[1])

tag = bp.Tag(f"cjb{os.getpid()}x{random.randrange(1 << 30):x}", "CJB_TAG", "CJB_NODE")
top = tempfile.mkdtemp(prefix="c10d_join_bench.")
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
               TMPDIR=os.path.join(work, "tmp"))
    cmd = [path, "--redirects", "9:1", "--tee", "9:1", "--monitor_interval", "0.1",
           f"--nnodes={args.nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
           "--rdzv_conf=last_call_timeout=1", "--max_restarts=5", WORKER]
    res = {"launcher": launcher, "run": run, "port": port, "status": None}
    a1 = a2 = None
    try:
        a1 = bp.Agent("agent1", cmd, env, os.path.join(work, "agent1.log"))
        t_a1 = time.time()
        end = time.monotonic() + args.startup_deadline
        while True:  # agent 1 alone: stepping (elastic), or just started (fixed size)
            a1.poll()
            if grows and a1.steps(1) >= 3:
                break
            if not grows and time.time() - t_a1 >= args.lead_delay:
                break
            if a1.proc.poll() is not None:
                res.update(status=f"failed: agent 1 exited rc={a1.proc.returncode} before stepping",
                           agent1_tail=a1.tail(6))
                return res
            if time.monotonic() > end:
                res.update(status=f"timeout: agent 1 did not step within {args.startup_deadline:g} s",
                           agent1_tail=a1.tail(6))
                return res
            time.sleep(0.02)
        if grows:
            res["agent1_first_world1_step_s"] = round(a1.first_step(1) - t_a1, 3)
        t0 = time.time()
        a2 = bp.Agent("agent2", cmd, env, os.path.join(work, "agent2.log"))
        res["t0"] = t0
        end = time.monotonic() + args.deadline
        grace_end = None
        while True:
            a1.poll()
            a2.poll()
            f1, f2 = a1.first_step(2), a2.first_step(2)
            if f2 is not None and grace_end is None:
                grace_end = time.monotonic() + 2.0  # let agent 1's line arrive too
            if f1 is not None and f2 is not None or (grace_end and time.monotonic() > grace_end):
                firsts = [t for t in (f1, f2) if t is not None]
                starts = [t for t in (a1.first_start(2), a2.first_start(2)) if t is not None]
                res.update(status="ok", first_world2_step_s=round(min(firsts) - t0, 4),
                           agent2_first_world2_step_s=round(f2 - t0, 4),
                           agent1_first_world2_step_s=None if f1 is None else round(f1 - t0, 4),
                           first_world2_worker_start_s=round(min(starts) - t0, 4) if starts else None)
                return res
            if a2.proc.poll() is not None and f2 is None:
                a2.poll()
                if a2.first_step(2) is None:
                    res.update(status=f"refused: agent 2 exited rc={a2.proc.returncode} after "
                                      f"{time.time() - t0:.2f} s without a world=2 step",
                               agent2_tail=a2.tail(6))
                    return res
            if a1.proc.poll() is not None and f1 is None and f2 is None:
                res.update(status=f"failed: agent 1 exited rc={a1.proc.returncode}",
                           agent1_tail=a1.tail(6), agent2_tail=a2.tail(6))
                return res
            if time.monotonic() > end:
                res.update(status=f"timeout: no world=2 step within {args.deadline:g} s of agent 2's start",
                           agent1_tail=a1.tail(6), agent2_tail=a2.tail(6))
                return res
            time.sleep(0.02)
    finally:
        bp.end_run(tag, res, [a1, a2], stop_file, args.keep_logs, f"{launcher}-{run}")


results = []
orphans = []
try:
    print(f"# c10d join bench: nproc {len(os.sched_getaffinity(0))}, load average {bp.load()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, nnodes {args.nnodes}, runs {args.runs}, "
          f"deadline {args.deadline:g} s", flush=True)
    for name, path in launchers.items():
        print(f"# {name}: {path}", flush=True)
    bp.alternate(launchers, args.runs, measure, results)
finally:
    # Nothing of ours may outlive the harness: agents carry the tag in their
    # --rdzv_id, workers in their environment.
    orphans = bp.end_harness(tag, top)
    if args.keep_logs:
        print(f"# logs in {args.keep_logs}", flush=True)

print(f"# load average at the end {bp.load()}")
print()
print("| launcher | arrival -> first world=2 step, median | each run (s) "
      "| agent 2's first world=2 step, median | first world=2 worker started, median | ok / runs |")
print("| --- | --- | --- | --- | --- | --- |")
medians = {}
for name in launchers:
    rs = [r for r in results if r["launcher"] == name]
    ok = [r for r in rs if r["status"] == "ok"]
    each = ", ".join(f"{r['first_world2_step_s']:.3f}" if r["status"] == "ok"
                     else r["status"].split(":")[0] for r in rs)
    if ok:
        medians[name] = statistics.median(r["first_world2_step_s"] for r in ok)
        m2 = statistics.median(r["agent2_first_world2_step_s"] for r in ok)
        starts = [r["first_world2_worker_start_s"] for r in ok if r["first_world2_worker_start_s"] is not None]
        ms = f"{statistics.median(starts):.3f} s" if starts else "-"
        print(f"| {name} | {medians[name]:.3f} s | {each} | {m2:.3f} s | {ms} | {len(ok)} / {len(rs)} |")
    else:
        print(f"| {name} | - | {each} | - | - | 0 / {len(rs)} |")
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

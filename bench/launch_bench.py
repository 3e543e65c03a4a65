#!/usr/bin/env python3
"""Launch and restart benchmark: ctorchrun against torchrun, same machine, same run.

    /usr/bin/python3 bench/launch_bench.py [--runs N] [--nproc 4] [--torchrun-python PY]

1. launch: wall time of `LAUNCHER --nproc_per_node=4 --no_python /bin/true`,
   end to end (start of the command to its exit), N runs each, alternating
   with the floor: `sh -c '/bin/true & ... & wait'` (a shell spawning the same
   4 processes and waiting for them), measured in the same loop.
2. restart: with build/bin/stamp_worker, rank 1 fails at once in attempt 0;
   measured from the failing worker's exit stamp to the start of the last
   replacement worker of attempt 1 (and the whole job's wall time).

torchrun is Debian's /usr/bin/torchrun (torch 1.13) with the flags it needs on
Python 3.11 (--redirects 9:1 --tee 9:1) and torch 2.x's default
--monitor_interval 0.1; with --torchrun-python PY it is `PY -m
torch.distributed.run` (scripts/torch2/python: Debian 13's torch 2.6, from
scripts/setup_torch2.sh). Prints a markdown table of medians and ratios.
"""
import argparse
import glob
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTORCHRUN = os.path.join(ROOT, "build", "bin", "ctorchrun")
STAMP = os.path.join(ROOT, "build", "bin", "stamp_worker")
TORCHRUN = ["/usr/bin/python3", "/usr/bin/torchrun", "--redirects", "9:1", "--tee", "9:1",
            "--monitor_interval", "0.1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(name, torchrun):
    port = str(free_port())
    if name == "ctorchrun":
        return [CTORCHRUN, "--master_port", port]
    return torchrun + ["--master_addr", "127.0.0.1", "--master_port", port]


def run(cmd, timeout=120):
    env = dict(os.environ, LOGLEVEL="WARNING")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
    return dt


def read_ns(path):
    with open(path) as f:
        return int(f.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--torchrun-python", help="run torchrun as PY -m torch.distributed.run")
    a = ap.parse_args()
    torchrun = TORCHRUN
    if a.torchrun_python:
        torchrun = [a.torchrun_python, "-m", "torch.distributed.run", "--redirects", "9:1",
                    "--tee", "9:1", "--monitor_interval", "0.1"]
    version = subprocess.run(torchrun[:1] + ["-c", "import importlib.metadata as m; "
                                             "print(m.version('torch'))"],
                             capture_output=True, text=True).stdout.strip()
    names = ["ctorchrun", "torchrun"]
    launch = {n: [] for n in names}
    floor = []
    # Where ctorchrun's own time goes, by difference: the process alone
    # (start, dynamic linking, exit), one worker, four workers.
    bare, one = [], []
    floor_cmd = ["/bin/sh", "-c", " & ".join(["/bin/true"] * a.nproc) + " & wait"]
    restart = {n: [] for n in names}
    restart_job = {n: [] for n in names}
    for _ in range(a.runs):
        floor.append(run(floor_cmd))
        bare.append(run([CTORCHRUN, "--version"]))
        one.append(run(launcher("ctorchrun", torchrun) + ["--nproc_per_node", "1", "--no_python",
                                                            "/bin/true"]))
        for n in names:
            launch[n].append(run(launcher(n, torchrun) + ["--nproc_per_node", str(a.nproc), "--no_python", "/bin/true"]))
    for _ in range(max(3, a.runs // 2)):
        for n in names:
            with tempfile.TemporaryDirectory() as d:
                wall = run(launcher(n, torchrun) + ["--nproc_per_node", str(a.nproc), "--max_restarts", "1",
                                          "--no_python", STAMP, d, "1"])
                fail = read_ns(os.path.join(d, "fail_1"))
                starts = [read_ns(p) for p in glob.glob(os.path.join(d, "start_1_*"))]
                if len(starts) != a.nproc:
                    sys.exit(f"{n}: {len(starts)} replacement workers started, expected {a.nproc}")
                restart[n].append((max(starts) - fail) / 1e6)
                restart_job[n].append(wall)

    med = {k: {n: statistics.median(v[n]) for n in names} for k, v in
           (("launch", launch), ("restart", restart), ("restart_job", restart_job))}
    print(f"machine: {os.cpu_count()} CPUs; torchrun: torch {version}; runs: launch {a.runs} each, "
          f"restart {len(restart['ctorchrun'])} each")
    print()
    print("| measurement | ctorchrun (median) | torchrun (median) | torchrun / ctorchrun |")
    print("| --- | --- | --- | --- |")
    print(f"| launch `--nproc_per_node={a.nproc} --no_python /bin/true`, wall | "
          f"{med['launch']['ctorchrun']*1e3:.1f} ms | {med['launch']['torchrun']*1e3:.0f} ms | "
          f"{med['launch']['torchrun']/med['launch']['ctorchrun']:.0f}x |")
    print(f"| failing worker's exit -> all {a.nproc} replacements running | "
          f"{med['restart']['ctorchrun']:.1f} ms | {med['restart']['torchrun']:.0f} ms | "
          f"{med['restart']['torchrun']/med['restart']['ctorchrun']:.0f}x |")
    print(f"| whole fail -> restart -> success job, wall | "
          f"{med['restart_job']['ctorchrun']*1e3:.1f} ms | {med['restart_job']['torchrun']*1e3:.0f} ms | "
          f"{med['restart_job']['torchrun']/med['restart_job']['ctorchrun']:.0f}x |")
    fl = statistics.median(floor)
    print(f"| floor: `sh` spawning {a.nproc} `/bin/true` and waiting, wall | {fl*1e3:.1f} ms | | "
          f"ctorchrun / floor: {med['launch']['ctorchrun']/fl:.1f}x |")
    v, o = statistics.median(bare), statistics.median(one)
    n = med['launch']['ctorchrun']
    print()
    print("ctorchrun's launch by phase (medians, by difference):")
    print()
    print("| phase | ms | share |")
    print("| --- | --- | --- |")
    print(f"| process start, dynamic linking, exit (`ctorchrun --version`) | {v*1e3:.1f} | {v/n:.0%} |")
    print(f"| agent set-up and shut-down around one worker (store bound, threads, watcher process, "
          f"log directory; `--nproc_per_node=1` minus the above) | {(o-v)*1e3:.1f} | {(o-v)/n:.0%} |")
    print(f"| {a.nproc - 1} more workers (spawn, output, exit; {((n-o)/max(a.nproc-1,1))*1e3:.2f} ms each) | "
          f"{(n-o)*1e3:.1f} | {(n-o)/n:.0%} |")
    print()
    print("raw floor ms:", [round(x * 1e3, 1) for x in floor])
    print("raw launch ms:", {n: [round(x * 1e3, 1) for x in launch[n]] for n in names})
    print("raw restart ms:", {n: [round(x, 1) for x in restart[n]] for n in names})


if __name__ == "__main__":
    main()

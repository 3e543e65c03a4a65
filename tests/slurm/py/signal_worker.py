#!/usr/bin/env python3
"""A checkpointing worker for the Slurm signal tests (no torch needed).

Usage: signal_worker.py WORKDIR STEPS

Counts from the step in WORKDIR/ckpt.json (rank 0's, 0 when missing) to STEPS,
0.1 s a step, writing its step to WORKDIR/progress.<RANK>. On SIGTERM, SIGINT
or SIGUSR1 it appends "<SIGNAME> <pid>" to WORKDIR/sig.<SLURM_RESTART_COUNT>.<RANK>
(a second copy of a signal adds a second line), waits 1 s for any duplicate,
rank 0 checkpoints, and it dies by the same signal (default action). At the end
rank 0 writes WORKDIR/done.json: where it resumed from, TORCHELASTIC_RESTART_COUNT
and SLURM_RESTART_COUNT. A watchdog ends it after 120 s.
"""
import json
import os
import signal
import sys
import threading
import time

workdir, steps = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
requeues = os.environ.get("SLURM_RESTART_COUNT", "0")
got = []


def on_signal(sig, _frame):
    with open(os.path.join(workdir, f"sig.{requeues}.{rank}"), "a") as f:
        f.write(f"{signal.Signals(sig).name} {os.getpid()}\n")
    got.append(sig)


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(s, on_signal)
threading.Timer(120, lambda: os._exit(9)).start()

ckpt = os.path.join(workdir, "ckpt.json")
start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
step = start
while step < steps:
    if got:
        time.sleep(1)  # a duplicate would arrive now
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(ckpt + ".tmp", ckpt)
        sig = got[0]
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(5)
        os._exit(1)
    time.sleep(0.1)
    step += 1
    with open(os.path.join(workdir, f"progress.{rank}"), "w") as f:
        f.write(str(step))
if rank == 0:
    with open(os.path.join(workdir, "done.json"), "w") as f:
        json.dump({"resumed_from": start,
                   "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                   "slurm_restart_count": requeues}, f)
os._exit(0)

#!/usr/bin/env python3
"""A torch gloo training loop for the --hang_timeout tests.

Usage: python3 hang_worker.py MODE --steps N --step-s S --done-dir DIR

Each step does S seconds of CPU work, then an all_reduce; after the last step
the rank writes DIR/rank<R> and exits 0. MODE decides what goes wrong:
  hang        rank WORLD_SIZE-1 sleeps forever before its step-5 work, in
              attempt 0 only (TORCHELASTIC_RESTART_COUNT): a true hang
  slow        the last rank's step 2 takes --long-s seconds of CPU (others wait)
  checkpoint  rank 0 writes a file for --long-s seconds at step 2 (others wait)
  loader      at step 2 every rank waits on a child process that works for
              --long-s seconds (half the ranks' children burn CPU, half do I/O)
  compile     at step 2 every rank spends --long-s seconds of CPU, as a long
              torch.compile would, before its first collective there
  flood       every rank prints to stdout until the pipe, which nobody
              reads, is full: each blocks in write(), a hang
  none        nothing
A watchdog ends the worker after --limit-s seconds whatever happens.
"""
import argparse
import datetime
import multiprocessing
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def burn(seconds):
    end = time.time() + seconds
    x = 0
    while time.time() < end:
        x += 1
    return x


def write_for(path, seconds):
    end = time.time() + seconds
    with open(path, "wb") as f:
        while time.time() < end:
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.01)


def flood(rank):
    line = f"rank {rank} " + "x" * 1000
    while True:
        print(line)


def child_work(kind, seconds, path):
    if kind == "cpu":
        burn(seconds)
    else:
        write_for(path, seconds)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.3)
    p.add_argument("--long-s", type=float, default=6.0)
    p.add_argument("--limit-s", type=float, default=90.0)
    p.add_argument("--done-dir", required=True)
    a = p.parse_args()
    threading.Timer(a.limit_s, lambda: os._exit(9)).start()

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for step in range(a.steps):
        if a.mode == "hang" and step == 5 and rank == world - 1 and attempt == 0:
            print(f"rank {rank} sleeps forever at step {step}", flush=True)
            with open(os.path.join(a.done_dir, "sleep_at"), "w") as f:
                f.write(f"{time.time()}\n")
            time.sleep(3600)
        if a.mode == "flood" and step == 1:
            flood(rank)
        work = a.step_s
        if step == 2:
            if a.mode == "slow" and rank == world - 1:
                work = a.long_s
            elif a.mode == "checkpoint" and rank == 0:
                write_for(os.path.join(a.done_dir, "checkpoint.bin"), a.long_s)
            elif a.mode == "loader":
                kind = "cpu" if rank % 2 == 0 else "io"
                ctx = multiprocessing.get_context("fork")
                child = ctx.Process(target=child_work, args=(
                    kind, a.long_s, os.path.join(a.done_dir, f"loader{rank}.bin")))
                child.start()
                child.join()
            elif a.mode == "compile":
                work = a.long_s
        burn(work)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == world, t
    dist.barrier()
    with open(os.path.join(a.done_dir, f"rank{rank}"), "w") as f:
        f.write(f"attempt {attempt}\n")
    print(f"rank {rank} done in attempt {attempt}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One torch worker: gloo process group over an already-running store server.

Usage: python3 gloo_worker.py [--timeout-s 30]   (torch 1.13 or 2.x)

Environment (as torchrun sets it for workers): MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, plus TORCHELASTIC_USE_AGENT_STORE=True and
TORCHELASTIC_RESTART_COUNT=0 so that torch's env:// rendezvous makes the
worker a pure client of the store at MASTER_ADDR:MASTER_PORT (keys under
`/worker/attempt_0/` with torch 1.13; torch 2.x leaves out the attempt prefix)
instead of starting a server on rank 0.

Runs init_process_group("gloo"), all_reduce of [rank+1.0]*4 (expects the sum
over ranks), barrier, broadcast from rank 0; prints `rank R torch <version>`
(torch.__version__, first) and `rank R ok <sum>` and
exits 0, or prints `rank R FAIL: ...` and exits 1. A watchdog ends the worker
--timeout-s + 15 seconds after start whatever happens.
"""
import argparse
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

BROADCAST_VALUE = 42.0


def run(rank, world, timeout_s):
    print(f"rank {rank} torch {torch.__version__}", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.full((4,), rank + 1.0)
    dist.all_reduce(t)
    total = world * (world + 1) / 2
    if not torch.equal(t, torch.full((4,), total)):
        return f"all_reduce gave {t.tolist()}, want {total} everywhere"
    dist.barrier()
    b = torch.full((4,), BROADCAST_VALUE) if rank == 0 else torch.zeros(4)
    dist.broadcast(b, src=0)
    if not torch.equal(b, torch.full((4,), BROADCAST_VALUE)):
        return f"broadcast gave {b.tolist()}, want {BROADCAST_VALUE} everywhere"
    dist.destroy_process_group()
    print(f"rank {rank} ok {total}", flush=True)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="init_process_group timeout (store and collectives)")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def fire():
        print(f"rank {rank} FAIL: watchdog after {a.timeout_s + 15:.0f}s", flush=True)
        os._exit(1)

    watchdog = threading.Timer(a.timeout_s + 15, fire)
    watchdog.daemon = True
    watchdog.start()
    try:
        err = run(rank, world, a.timeout_s)
    except Exception as e:  # report any torch error as this worker's failure
        err = f"{type(e).__name__}: {e}"
    if err:
        print(f"rank {rank} FAIL: {err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

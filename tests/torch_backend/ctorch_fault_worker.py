"""A rank SIGKILLed in the middle of all_reduces: the survivors' calls fail fast.

    ctorch_fault_worker.py --workdir DIR

Attempt 0 (TORCHELASTIC_RESTART_COUNT=0): every rank all_reduces 1 MiB in a
loop (rank 0 waits on each call's Future, the others on its Work); rank 1
writes the time into DIR/killed and SIGKILLs itself after 50 calls. Every
other rank catches the error of its next call and writes, into
DIR/survivor_<rank>, a JSON line with the seconds from the kill to the error
and the error's text, then exits 1. SIGTERM from the launcher (which stops
the survivors once it sees the death) is held until then: the measure is the
backend's own detection, not the launcher's. A later attempt runs 20
all_reduces, checks their sums and exits 0.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ctorch  # noqa: F401


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # Python runs a handler only between bytecodes: a call blocked in the
    # backend finishes (or fails) first.
    signal.signal(signal.SIGTERM, lambda *_: None)
    dist.init_process_group("ctorch")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1 << 18)
    if attempt > 0:
        for _ in range(20):
            t.fill_(1.0)
            dist.all_reduce(t)
            assert t[0].item() == world, t[0].item()
        dist.destroy_process_group()
        return
    for i in range(1_000_000):
        if rank == 1 and i == 50:
            with open(os.path.join(a.workdir, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if rank == 0:
                dist.all_reduce(t, async_op=True).get_future().wait()
            else:
                dist.all_reduce(t)
        except RuntimeError as e:
            now = time.time()
            killed = float(open(os.path.join(a.workdir, "killed")).read())
            with open(os.path.join(a.workdir, f"survivor_{rank}"), "w") as f:
                f.write(json.dumps({"seconds": now - killed, "error": str(e)}))
            sys.exit(1)
    sys.exit(2)  # never reached: rank 1 died


if __name__ == "__main__":
    main()

# A torch worker that trains with checkpoints, for launcher tests of losses:
# one gloo all_reduce per step (every 0.1 s); after each step rank 0 writes
# the step reached to $CKPT (a temporary file renamed over it). It starts
# from the checkpoint's step (rank 0 reads it and broadcasts it, so every
# rank agrees), prints "RESUMED from=<k> world=<n> rank=<r> restart=<c>
# count=<t>" (c the restarts charged, t TORCHELASTIC_RESTART_COUNT),
# and at $TOTAL_STEPS prints "FINISHED steps=<total> world=<n> rank=<r>" and
# exits 0. A sum that is not the world size exits 4; 120 s without finishing
# exits 3.
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ckpt = os.environ["CKPT"]
total = int(os.environ.get("TOTAL_STEPS", "60"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
world, rank = dist.get_world_size(), dist.get_rank()
start = torch.zeros(1, dtype=torch.int64)
if rank == 0:
    try:
        with open(ckpt) as f:
            start[0] = int(json.load(f)["step"])
    except FileNotFoundError:
        pass
dist.broadcast(start, 0)
first = int(start.item())
print(f"RESUMED from={first} world={world} rank={rank} "
      f"restart={os.environ['CTORCHRUN_FAILED_RESTARTS']} "
      f"count={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
x = torch.ones(1)
deadline = time.time() + 120
for step in range(first + 1, total + 1):
    if time.time() > deadline:
        sys.exit(3)
    dist.all_reduce(x.fill_(1.0))
    if int(x.item()) != world:
        sys.exit(4)
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(ckpt + ".tmp", ckpt)
    time.sleep(0.1)
print(f"FINISHED steps={total} world={world} rank={rank}", flush=True)

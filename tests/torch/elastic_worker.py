# A torch worker for elastic launcher tests: joins the gloo group from the
# launcher's environment. At any world size but the one the test waits for
# (ELASTIC_TARGET_WORLD) it all-reduces every 0.1 s until the launcher stops it
# (a re-formation) or a peer vanishes (the all-reduce fails), and gives up
# with exit 3 after 60 s. At that size it does five all-reduces, prints
# "GROWN rank=<r> world=<n> sum=<s> restart=<k> count=<c>" and exits 0: k the
# restarts charged (CTORCHRUN_FAILED_RESTARTS), c TORCHELASTIC_RESTART_COUNT
# (re-formations too).
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

target = int(os.environ["ELASTIC_TARGET_WORLD"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
world, rank = dist.get_world_size(), dist.get_rank()
print(f"JOINED rank={rank} world={world}", flush=True)
x = torch.ones(1)
if world != target:
    deadline = time.time() + 60
    while time.time() < deadline:
        dist.all_reduce(x.fill_(1.0))
        time.sleep(0.1)
    sys.exit(3)
for _ in range(5):
    dist.all_reduce(x.fill_(1.0))
print(f"GROWN rank={rank} world={world} sum={int(x.item())} "
      f"restart={os.environ['CTORCHRUN_FAILED_RESTARTS']} "
      f"count={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)

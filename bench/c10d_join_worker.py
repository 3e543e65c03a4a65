#!/usr/bin/python3
# Worker for bench/c10d_join_bench.sh: joins the job's gloo group from the
# launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), then
# every 0.2 s all-reduces a small tensor and prints one line per step:
#   START t=<time.time()> world=<WORLD_SIZE> rank=<RANK> pid=<pid>   (on entry)
#   STEP t=<time.time()> world=<n> rank=<r> step=<k>                 (after each all_reduce)
# It stops by itself, exit 0, after CJB_MAX_SECONDS (default 60) or as soon
# as the file named by CJB_STOP_FILE exists, so a forgotten job never hangs.
import datetime
import os
import sys
import time

start = time.time()
print(f"START t={start:.6f} world={os.environ.get('WORLD_SIZE', '?')} "
      f"rank={os.environ.get('RANK', '?')} pid={os.getpid()}", flush=True)

max_seconds = float(os.environ.get("CJB_MAX_SECONDS", "60"))
stop_file = os.environ.get("CJB_STOP_FILE", "")
interval = float(os.environ.get("CJB_STEP_SECONDS", "0.2"))


def should_stop():
    return time.time() - start > max_seconds or (stop_file and os.path.exists(stop_file))


if should_stop():
    sys.exit(0)

import torch  # noqa: E402  (after the cheap checks: importing torch takes a while)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(1.0, max_seconds)))
world, rank = dist.get_world_size(), dist.get_rank()
x = torch.ones(4)
step = 0
while not should_stop():
    dist.all_reduce(x.fill_(1.0))
    step += 1
    print(f"STEP t={time.time():.6f} world={world} rank={rank} step={step}", flush=True)
    time.sleep(interval)
print(f"STOP t={time.time():.6f} world={world} rank={rank} steps={step}", flush=True)

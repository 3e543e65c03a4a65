#!/usr/bin/env python3
"""Worker using torch's own file-timer client, for the file-timer tests.

Usage (as a launcher's worker script, with TORCHELASTIC_ENABLE_FILE_TIMER=1):
    timer_worker.py [--rank R] [--after A] [--sleep S] [--stuck-attempts N]
                    [--record DIR] [--after-others]

Every rank configures torch's FileTimerClient on $TORCHELASTIC_TIMER_FILE (as
a script run by torchrun with the file timer on does). Rank R (default 0)
then runs, on the attempts below N (TORCHELASTIC_RESTART_COUNT; default: every
attempt), `with expires(after=A): time.sleep(S)` (default A=1, S=5): stuck
longer than its timer, so the agent's server kills it. Every other rank, and
rank R on later attempts, runs the same block with a timer that does not
expire (`expires(after=60)` around a 0.2 s sleep) and exits 0.

--record DIR writes DIR/attempt<A>_rank<R> with the worker's pid when the
block starts, and DIR/done_attempt<A>_rank<R> when it ends.

--after-others (with --record): the stuck rank enters its block only once
every other rank's done_attempt<A>_rank<r> is there (at most 120 s), so that
a slow start of the others (importing torch on a busy machine) never has
them stopped by the stuck rank's kill before their block ran.
"""

import argparse
import os
import sys
import time

from torch.distributed.elastic.timer import FileTimerClient, configure, expires


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--after", type=float, default=1.0)
    p.add_argument("--sleep", type=float, default=5.0)
    p.add_argument("--stuck-attempts", type=int, default=1 << 30)
    p.add_argument("--record", default="")
    p.add_argument("--after-others", action="store_true")
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.environ["TORCHELASTIC_TIMER_FILE"]
    configure(FileTimerClient(path))
    stuck = rank == a.rank and attempt < a.stuck_attempts
    print(f"timer_worker rank={rank} attempt={attempt} pid={os.getpid()} stuck={stuck} "
          f"timer_file={path}", flush=True)
    if a.record:
        with open(os.path.join(a.record, f"attempt{attempt}_rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
    if stuck and a.after_others and a.record:
        world = int(os.environ["WORLD_SIZE"])
        others = [os.path.join(a.record, f"done_attempt{attempt}_rank{r}")
                  for r in range(world) if r != rank]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    if stuck:
        with expires(after=a.after):
            time.sleep(a.sleep)
    else:
        with expires(after=60):
            time.sleep(0.2)
    if a.record:
        with open(os.path.join(a.record, f"done_attempt{attempt}_rank{rank}"), "w") as f:
            f.write("1")
    print(f"timer_worker rank={rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

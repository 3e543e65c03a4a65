#!/usr/bin/env python3
"""Worker that dumps its environment, for comparing launchers.

Usage (as a launcher's worker script):
    DUMP_DIR=/tmp/envs torchrun ... tests/launcher/py/dump_env.py [--init-pg] [--dump-dir D]

Writes dict(os.environ), as seen when the process starts, as JSON (sorted keys)
to $DUMP_DIR/env_rank<RANK>.json (atomically: temp file + os.replace), and
exits 0. --dump-dir overrides DUMP_DIR. With --init-pg (or DUMP_INIT_PG=gloo
in the environment) it first runs init_process_group("gloo") (env://), an
all_reduce of [rank+1] (checked against the expected sum) and a barrier, and
destroys the group; the dump is written after that, so its presence also
proves the collective worked.

Exit codes: 0 ok, 2 usage (no DUMP_DIR or no RANK), 1 the collective gave a
wrong answer (exceptions also give 1, with error.json written by @record).
"""
import argparse
import json
import os
import sys

ENV_AT_START = dict(os.environ)


def parse_args(argv):
    p = argparse.ArgumentParser(description="dump the worker environment as JSON")
    p.add_argument("--init-pg", action="store_true", help="init_process_group('gloo') + all_reduce + barrier first")
    p.add_argument("--dump-dir", default=None, help="directory (default: $DUMP_DIR)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    return p.parse_args(argv)


def run_collective(timeout_s):
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    want = world * (world + 1) / 2
    if t.item() != want:
        print(f"dump_env rank {rank}: all_reduce gave {t.item()}, want {want}", file=sys.stderr, flush=True)
        return False
    return True


def main(argv=None):
    args = parse_args(argv)
    dump_dir = args.dump_dir or os.environ.get("DUMP_DIR")
    rank = os.environ.get("RANK")
    if not dump_dir or rank is None:
        print("dump_env: need DUMP_DIR (or --dump-dir) and RANK in the environment", file=sys.stderr)
        return 2
    if args.init_pg or os.environ.get("DUMP_INIT_PG") == "gloo":
        from torch.distributed.elastic.multiprocessing.errors import record

        if not record(run_collective)(args.timeout_s):
            return 1
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"env_rank{rank}.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(ENV_AT_START, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    print(f"dump_env rank {rank}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An unmodified gloo script, for ctorchrun --cpu_backend: it never imports ctorch.

    cpu_backend_worker.py MODE

MODE says how the default group is made: "gloo" (init_process_group("gloo")),
"default" (init_process_group() with no backend: torch 2.x's CPU default;
torch 1.x has none and takes "gloo"), "pairs" ("cpu:gloo,cuda:nccl" on torch
2.x, "cpu:gloo" where torch has no NCCL, "gloo" on 1.x) or "ctorch" (init_process_group("ctorch") without
`import ctorch`: torch 2.5+'s backend autoload). It also makes a
new_group(backend="gloo") and a new_group() inheriting the default, checks an
all_reduce and a broadcast on each, and prints, per group:

    GROUP <name> asked=<dist.get_backend()> runs=<the CPU backend's name()> ok

and, last, "WORKER_DONE rank=<r>".
"""

import os
import sys
import threading

import torch
import torch.distributed as dist

mode = sys.argv[1]
major = int(torch.__version__.split(".")[0])
if mode == "default":
    dist.init_process_group() if major >= 2 else dist.init_process_group("gloo")
elif mode == "pairs":
    pairs = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "cpu:gloo"
    dist.init_process_group(pairs if major >= 2 else "gloo")
else:
    dist.init_process_group(mode)

rank, size = dist.get_rank(), dist.get_world_size()


def runs_on(group):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if hasattr(pg, "_get_backend"):
        pg = pg._get_backend(torch.device("cpu"))
    return pg.name()


def check(name, group):
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, group=group)
    expected = float(size * (size + 1) // 2)
    assert torch.all(t == expected), f"{name}: all_reduce gave {t[0].item()}, not {expected}"
    b = torch.arange(10, dtype=torch.int64) * (rank + 1)
    dist.broadcast(b, src=0, group=group)
    assert torch.equal(b, torch.arange(10, dtype=torch.int64)), f"{name}: broadcast {b}"
    print(f"GROUP {name} asked={dist.get_backend(group)} runs={runs_on(group)} ok", flush=True)


check("world", None)
check("new_gloo", dist.new_group(backend="gloo"))
check("new_default", dist.new_group())
dist.barrier()
print(f"WORKER_DONE rank={rank} sitecustomize={os.environ.get('USER_SITECUSTOMIZE', 'no')}",
      flush=True)
# torch 2.6's gloo teardown was seen once to hold one rank in
# destroy_process_group for minutes after its peer had finished (a loaded
# machine, plain gloo, no ctorch). This worker is about which backend runs
# the groups, not teardown: the teardown is still made, but bounded.
teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
teardown.start()
teardown.join(30)
if teardown.is_alive():
    print(f"TEARDOWN_STUCK rank={rank}", flush=True)
os._exit(0)

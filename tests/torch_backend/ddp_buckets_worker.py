"""DDP with several gradient buckets in flight, unused parameters, no_sync and a comm hook.

    ddp_buckets_worker.py --backend {gloo,ctorch} [--steps N]

Rank 0 prints "digest <sha256 of the final parameters>"; the same job on
gloo and on ctorch must print the same digest at 2 ranks (a sum of two
values does not depend on its order). Every parameter is its own bucket
(bucket_cap_mb tiny), one layer is never used (find_unused_parameters),
every other step accumulates under no_sync(), and the buckets go through
torch's stock allreduce comm hook, whose futures the backend completes.
"""
import argparse
import hashlib
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
with warnings.catch_warnings():  # torch 2.6 on Python 3.13 warns about its own enum
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 4)
        self.unused = torch.nn.Linear(64, 64)  # never in the graph

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["gloo", "ctorch"], required=True)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if a.backend == "ctorch":
        import ctorch  # noqa: F401
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(a.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001, find_unused_parameters=True)
    model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(a.steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        if step % 2 == 0:
            with model.no_sync():  # accumulate locally, synchronise on the next step
                torch.nn.functional.mse_loss(model(x), y).backward()
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    h = hashlib.sha256()
    for _, param in model.module.named_parameters():
        h.update(param.detach().contiguous().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, h.hexdigest())
    assert len(set(digests)) == 1, f"ranks disagree: {digests}"
    if rank == 0:
        print("digest", digests[0], flush=True)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

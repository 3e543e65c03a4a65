"""FSDP on CPU (torch 2.x) on gloo or ctorch: rank 0 prints the final parameters' sum.

    fsdp_worker.py --backend {gloo,ctorch}

A small MLP sharded by FullyShardedDataParallel on the CPU (its all_gather
and reduce_scatter run on the backend), five SGD steps on per-rank data;
then the full parameters' float64 sum, printed with repr so that two runs
compare exactly.
"""
import argparse
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")  # FSDP's own deprecation notices


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["gloo", "ctorch"], required=True)
    a = p.parse_args()
    if a.backend == "ctorch":
        import ctorch  # noqa: F401
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    sharded = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        sharded(torch.randn(4, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(sharded):
        total = sum(p.double().sum().item() for p in sharded.parameters())
    if dist.get_rank() == 0:
        print("fsdp sum", repr(total), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

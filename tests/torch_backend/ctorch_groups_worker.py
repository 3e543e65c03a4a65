"""Groups that must share nothing: two subgroups at once, and (run twice at once) two jobs.

    ctorch_groups_worker.py --tag T [--rounds N]

At 4 ranks: subgroups {0,1} and {2,3} all_reduce at the same time, each
rank adding its own value and the job's tag, while the default group checks
the whole; each subgroup's all_gather shows its own members in order. Every sum is asserted. Two copies of this job with different
tags run at once on one host (two ctorchrun, two stores): a segment or key
shared by mistake shows as a wrong sum. Rank 0 prints "groups ok <tag>".
"""
import argparse

import torch
import torch.distributed as dist

import ctorch  # noqa: F401


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tag", type=int, required=True)
    p.add_argument("--rounds", type=int, default=200)
    a = p.parse_args()
    dist.init_process_group("ctorch")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    low = dist.new_group([0, 1], backend="ctorch")
    high = dist.new_group([2, 3], backend="ctorch")
    mine, members = (low, [0, 1]) if rank < 2 else (high, [2, 3])
    for i in range(a.rounds):
        t = torch.full((4099,), float(a.tag * 1000 + rank * 10 + i))
        dist.all_reduce(t, group=mine)
        want = sum(a.tag * 1000 + r * 10 + i for r in members)
        assert torch.all(t == want), (i, t[0].item(), want)
        whole = torch.full((64,), float(a.tag + rank))
        dist.all_reduce(whole)
        assert torch.all(whole == sum(a.tag + r for r in range(world))), whole[0].item()
    seen = torch.zeros(2)
    dist.all_gather_into_tensor(seen, torch.tensor([float(rank)]), group=mine)
    assert seen.tolist() == [float(r) for r in members], seen.tolist()
    dist.barrier()
    if rank == 0:
        print("groups ok", a.tag, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""torch.distributed (gloo, ctorch or nccl) counterpart of ctorch-collective-bench.

Run under ctorchrun or torchrun with the same flags; rank 0 prints one JSON
object per size with the same fields and the same definitions (nccl-tests
sizes and bus-bandwidth factors, mean time of the slowest rank), so the two
can be compared line by line. all_gather uses torch's list form, as users
call it (torch 1.13 has no all_gather_into_tensor for gloo). With --backend
nccl the tensors are on cuda:LOCAL_RANK, all_gather is all_gather_into_tensor
(ours' flat output) and every call is followed by torch.cuda.synchronize(), as
ours' blocking calls return once the device has finished. --backend ctorch
runs the same calls on ctorchrun's own backend (torch_backend/, `import
ctorch`), so that `ctorch` against `gloo` is torch.distributed against
torch.distributed. reduce_scatter is reduce_scatter_tensor where the backend
has it (torch 1.13's gloo has no reduce_scatter at all: it prints nothing);
barrier prints one row with bytes 0.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def parse_size(text):
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    digits = text.rstrip("BKMG")
    return int(digits) * units[text[len(digits):]]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="all_reduce",
                   choices=["all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"])
    p.add_argument("--min-bytes", default="4")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=-1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", default="gloo", choices=["gloo", "ctorch", "nccl"])
    a = p.parse_args()
    if a.backend == "ctorch":
        import ctorch  # noqa: F401  registers the backend
    device = "cpu"
    if a.backend == "nccl":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.op == "barrier":
        bench_barrier(a, rank, world)
        return
    if a.op == "reduce_scatter" and not reduce_scatter_works(world):
        dist.destroy_process_group()
        return
    nbytes = max(parse_size(a.min_bytes), 4)
    while nbytes <= parse_size(a.max_bytes):
        count = nbytes // 4
        if a.op in ("all_gather", "reduce_scatter"):
            count //= world
        if count == 0:
            nbytes *= 2
            continue
        t = torch.ones(count, dtype=torch.float32, device=device)
        flat = torch.empty(count * world, dtype=torch.float32, device=device)
        real_bytes = count * 4 * (world if a.op in ("all_gather", "reduce_scatter") else 1)
        iters = a.iters or min(max((1 << 30) // real_bytes, 5), 1000)
        warmup = a.warmup if a.warmup >= 0 else max(2, iters // 10)

        def run():
            if a.op == "all_reduce":
                dist.all_reduce(t)
            elif a.op == "broadcast":
                dist.broadcast(t, 0)
            elif a.op == "reduce_scatter":
                dist.reduce_scatter_tensor(t, flat)
            elif a.backend == "nccl":
                dist.all_gather_into_tensor(flat, t)
            else:
                out = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(out, t)
            if a.backend == "nccl":
                torch.cuda.synchronize()

        for _ in range(warmup):
            run()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        elapsed = torch.tensor([(time.perf_counter() - start) * 1e6 / iters], dtype=torch.float64,
                               device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        time_us = elapsed.item()
        algbw = real_bytes / time_us / 1e3
        factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0,
                  "all_gather": (world - 1) / world, "reduce_scatter": (world - 1) / world}[a.op]
        if rank == 0:
            print(json.dumps({"op": a.op, "bytes": real_bytes, "world": world, "time_us": time_us,
                              "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                              "backend": "torch-" + a.backend, "iters": iters}), flush=True)
        nbytes *= 2
    dist.barrier()
    dist.destroy_process_group()


def reduce_scatter_works(world):
    """Whether this backend has reduce_scatter_tensor (torch 1.13's gloo has none)."""
    if not hasattr(dist, "reduce_scatter_tensor"):
        return False
    try:
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world))
        return True
    except RuntimeError:
        return False


def bench_barrier(a, rank, world):
    iters = a.iters or 2000
    for _ in range(max(a.warmup, 50)):
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.barrier()
    elapsed = torch.tensor([(time.perf_counter() - start) * 1e6 / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"op": "barrier", "bytes": 0, "world": world, "time_us": elapsed.item(),
                          "algbw_GBps": 0.0, "busbw_GBps": 0.0, "backend": "torch-" + a.backend,
                          "iters": iters}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A communication-bound DDP training step, on gloo or ctorch (run under ctorchrun).

    ctorchrun --nproc_per_node=2 bench/torch_ddp_bench.py --backend ctorch [--steps 10]

An MLP of --layers square Linear layers of --hidden units (default 4 x
4096: 67 M parameters, 268 MB of float32 gradients a step), a batch of
--batch rows per rank, SGD; DDP's default buckets and all_reduce. After
--warmup steps, each of --steps steps is timed (forward, backward with its
gradient all_reduces, optimizer step) and rank 0 prints one JSON line:
backend, world, params, the median and minimum step time in ms.
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["gloo", "ctorch"], required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-comm", action="store_true",
                   help="every step under no_sync(): the step without its all_reduces (the floor)")
    a = p.parse_args()
    if a.backend == "ctorch":
        import ctorch  # noqa: F401
    dist.init_process_group(a.backend)
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.hidden)
    times = []
    for step in range(a.warmup + a.steps):
        dist.barrier()
        start = time.perf_counter()
        if a.no_comm:
            with model.no_sync():
                model(x).square().mean().backward()
        else:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step >= a.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        # Under ctorchrun --cpu_backend ctorch the script's gloo groups run on ctorch.
        via = " (--cpu_backend ctorch)" if os.environ.get("CTORCHRUN_CPU_BACKEND") == "ctorch" else ""
        print(json.dumps({"backend": a.backend + ("-nocomm" if a.no_comm else "") + via,
                          "world": dist.get_world_size(), "params": params,
                          "batch": a.batch, "median_ms": statistics.median(times),
                          "min_ms": min(times)}), flush=True)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A small, deterministic DistributedDataParallel training job for torchrun.

Runs unmodified under torchrun (or ctorchrun): env:// rendezvous, gloo, CPU.

    torchrun --nproc_per_node 2 examples/ddp_train.py --workdir /tmp/run1

Options:
    --workdir DIR            (required) where checkpoint.pt and result.json live
    --epochs E               number of epochs (default 3)
    --fail-once-at-epoch K   rank 1 exits with code 3 at the start of epoch K,
                             but only when TORCHELASTIC_RESTART_COUNT is "0"
                             (no effect with one process). Its peers then fail
                             in their next collective ("Connection reset/closed
                             by peer", exit 1, sometimes SIGABRT from gloo at
                             exit), so with a slow monitor interval the
                             launcher may report a peer as the root cause.
    --timeout-s S            process-group timeout (default 60)
    --backend B              gloo (default) or ctorch, ctorchrun's own runtime
                             (`import ctorch`; shared memory between ranks of
                             one host); the final parameters are the same

Epochs are numbered 0..E-1 everywhere: in --fail-once-at-epoch, in the
checkpoint's `next_epoch`, in result.json's `resumed_from` and in the log lines
(`epoch 2/3` is the last of 3). So `--fail-once-at-epoch 1` fails after the
checkpoint of epoch 0 was written, and the restarted attempt resumes from 1;
`--fail-once-at-epoch 0` fails before any checkpoint exists (a plain re-run).

What it does: a 2-layer MLP on a synthetic regression set generated from a
fixed seed, DistributedSampler (set_epoch every epoch), DDP, SGD with momentum,
MSE loss. After every epoch rank 0 writes DIR/checkpoint.pt atomically (temp
file + os.replace) holding the model, the optimizer state and the next epoch;
everyone then meets at a barrier. On start every rank loads the checkpoint if
there is one (map_location cpu). At the end rank 0 writes DIR/result.json:
    {"digest": sha256 hex of the final parameters (float32 bytes, in
               named_parameters() order),
     "world": WORLD_SIZE, "attempt": TORCHELASTIC_RESTART_COUNT,
     "epochs": E, "resumed_from": K or null, "loss": last epoch's mean loss}

Bit reproducibility for a given world size (uninterrupted run == run that
failed and resumed from a checkpoint): fixed seeds, one thread,
torch.use_deterministic_algorithms(True), no randomness during training
(no dropout), the sampler order depends only on (seed, epoch, world, rank), the
optimizer's momentum buffers are checkpointed, and gradients are averaged by a
DDP communication hook that all-gathers each bucket and sums it in rank order.
The hook matters for world > 2: with DDP's default all-reduce, runs with 3 and
4 ranks that resumed gave different digests from uninterrupted runs (2 ranks
did not), presumably because gloo's ring all-reduce adds up an element in an
order that depends on its offset in the bucket, and a fresh DDP uses a
different bucket layout in its first iteration than one that has rebuilt its
buckets. Summing the gathered copies in rank order makes every element's result
independent of the bucket layout.

Without torchrun (no RANK in the environment) it runs as a single process on
127.0.0.1 with a free port.
"""
import argparse
import datetime
import gc
import hashlib
import json
import os
import socket
import sys
import weakref

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

DATA_SEED = 1234
MODEL_SEED = 0
SAMPLER_SEED = 0
N_SAMPLES = 512
N_FEATURES = 8
HIDDEN = 16
BATCH_PER_RANK = 32
LR = 0.1
MOMENTUM = 0.9
FAIL_EXIT_CODE = 3


def parse_args(argv):
    p = argparse.ArgumentParser(description="tiny deterministic DDP training job")
    p.add_argument("--workdir", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fail-once-at-epoch", type=int, default=None, metavar="K")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--backend", choices=["gloo", "ctorch"], default="gloo")
    return p.parse_args(argv)


def log(msg):
    print(msg, flush=True)


def make_dataset():
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    w = 0.35 * torch.randn(N_FEATURES, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def make_model():
    torch.manual_seed(MODEL_SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def ordered_allreduce_hook(state, bucket):
    """Average a gradient bucket over ranks, summing in rank order (deterministic)."""
    world = dist.get_world_size()
    buf = bucket.buffer()
    gathered = [torch.empty_like(buf) for _ in range(world)]
    fut = dist.all_gather(gathered, buf, async_op=True).get_future()

    def combine(f):
        f.value()  # re-raises if the all_gather failed (a peer died): never use garbage
        out = gathered[0].clone()
        for t in gathered[1:]:
            out.add_(t)
        return out.div_(world)

    return fut.then(combine)


def ordered_sum(values):
    """Sum a small float64 vector over ranks in rank order (deterministic)."""
    t = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    out = gathered[0].clone()
    for g in gathered[1:]:
        out.add_(g)
    return out.tolist()


def params_digest(model):
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def atomic_write_bytes(path, write_fn):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def standalone_env():
    """Fill in a single-process env:// setup when not started by a launcher."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@record
def main(argv=None):
    args = parse_args(argv)
    standalone_env()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    if args.backend == "ctorch":
        import ctorch  # noqa: F401  registers the backend (on the path under ctorchrun)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    world = dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(args.workdir, exist_ok=True)
    ckpt_path = os.path.join(args.workdir, "checkpoint.pt")
    result_path = os.path.join(args.workdir, "result.json")

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start_epoch = 0
    resumed_from = None
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = resumed_from = int(ckpt["next_epoch"])
        if rank == 0:
            note = "" if ckpt.get("world") == world else f" (checkpoint was written by world {ckpt.get('world')})"
            log(f"resuming from {ckpt_path} at epoch {start_epoch}/{args.epochs} (attempt {attempt}){note}")

    ddp = DDP(model)
    ddp.register_comm_hook(state=None, hook=ordered_allreduce_hook)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED)
    loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler, num_workers=0)
    loss_fn = torch.nn.MSELoss()

    mean_loss = None
    for epoch in range(start_epoch, args.epochs):
        if args.fail_once_at_epoch == epoch and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            log(f"rank 1: simulated failure at the start of epoch {epoch} (attempt {attempt}), exit {FAIL_EXIT_CODE}")
            sys.stderr.flush()
            os._exit(FAIL_EXIT_CODE)
        sampler.set_epoch(epoch)
        ddp.train()
        loss_sum, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(x)
            count += len(x)
        total_loss, total_count = ordered_sum([loss_sum, float(count)])
        mean_loss = total_loss / total_count
        if rank == 0:
            log(f"epoch {epoch}/{args.epochs} loss {mean_loss:.4f} (attempt {attempt})")
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "next_epoch": epoch + 1,
                "world": world,
            }
            atomic_write_bytes(ckpt_path, lambda f: torch.save(state, f))
        dist.barrier()  # nobody goes on (or fails) while the checkpoint is half-written

    digest = params_digest(model)
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on the final parameters: {digests}")
    if rank == 0:
        result = {
            "digest": digest,
            "world": world,
            "attempt": attempt,
            "epochs": args.epochs,
            "resumed_from": resumed_from,
            "loss": mean_loss,
        }
        atomic_write_bytes(result_path, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
        log(f"done: world {world} attempt {attempt} digest {digest}")
    dist.barrier()
    ddp_ref = weakref.ref(ddp)
    del ddp
    shutdown(ddp_ref)


def shutdown(ddp_ref):
    """Free DDP, then the process group, in an order that cannot deadlock (torch 1.13).

    DDP's C++ Reducer holds a reference to the process group. If the Reducer is
    the last holder, ~ProcessGroupGloo runs inside the Reducer's destructor with
    the GIL held and joins gloo's worker threads, while a worker thread may be
    freeing a tensor that has a Python object and so waits for the GIL: the
    process hangs at exit (seen in about 1 of 5 runs with 4 ranks). So the
    caller drops its DDP reference first, cycles are collected here, and the
    last reference left is the Python ProcessGroup object's, whose destructor
    releases the GIL (pytorch issue #56297).
    """
    gc.collect()
    if ddp_ref() is not None:
        print(f"rank {dist.get_rank()}: warning: DDP still referenced at shutdown", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

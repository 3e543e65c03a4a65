"""Every operation of the ctorch backend, against gloo and a float64 reference.

Run under ctorchrun at any world size. The default group is ctorch; a second
group over the same ranks is gloo. Every rank can make every rank's input
(seeded by op, type and rank), so each result is checked against a
reference computed here in float64 (int64 for integers) from all inputs, and
against gloo on the same inputs where gloo does the operation (it raises
otherwise: torch 1.13's gloo has no reduce_scatter, AVG or bfloat16):
exactly where the order of summation is the same (integers, MIN, MAX, and
any reduction of two ranks), within a stated tolerance where it is not.
Then asynchronous work, non-contiguous tensors, and the errors it must
raise. Each rank prints "FAIL ..." lines and exits 1 on any failure, else
prints "ctorch ops: N checks passed".
"""
import datetime
import inspect
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist

import ctorch

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
ALL = FLOATS + INTS + [torch.bool]
# Relative tolerance against the float64 reference, by type; sums of up to
# four values in the type's own precision.
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}
COUNT = 37  # odd: no chunk or vector width divides it
BIG = 300_001  # past the shared-memory path's large-message threshold

failures = []
checks = 0


def fail(text):
    failures.append(text)
    print(f"FAIL rank {dist.get_rank()}: {text}", flush=True)


def same(name, got, want, rtol=0.0):
    global checks
    checks += 1
    if got.dtype != want.dtype or got.shape != want.shape:
        fail(f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
        return
    if rtol == 0.0:
        if not torch.equal(got, want):
            diff = (got != want).nonzero()[:3].flatten().tolist()
            fail(f"{name}: differs at {diff}: got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")
    elif not torch.allclose(got.double(), want.double(), rtol=rtol, atol=rtol):
        err = (got.double() - want.double()).abs().max().item()
        fail(f"{name}: off by {err} (rtol {rtol})")


def make(dtype, rank, n, salt, op=None):
    product = op is not None and op == R.PRODUCT
    # A seed every rank computes alike (Python's hash() of a str is salted per process).
    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}/{dtype}/{rank}/{n}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype in INTS:
        lo, hi = (1, 4) if product else ((0, 4) if dtype == torch.uint8 else (-3, 4))
        return torch.randint(lo, hi, (n,), generator=g).to(dtype)
    if product:
        return (0.5 + torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def reference(inputs, op, dtype):
    wide = torch.int64 if dtype in INTS or dtype == torch.bool else torch.float64
    stack = torch.stack([t.to(wide) for t in inputs])
    if op == R.SUM:
        out = stack.sum(0)
    elif op == R.AVG:
        out = stack.sum(0) / len(inputs)
    elif op == R.PRODUCT:
        out = stack.prod(0)
    elif op == R.MIN:
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(dtype)


def reductions(dtype):
    if dtype == torch.bool:
        return [R.MIN, R.MAX, R.PRODUCT]
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    return ops + [R.AVG] if dtype in FLOATS else ops


def tolerance(dtype, op, world):
    if dtype not in FLOATS or op in (R.MIN, R.MAX):
        return 0.0
    return RTOL[dtype] * world


def exact_with_gloo(dtype, op, world):
    return dtype not in FLOATS or op in (R.MIN, R.MAX) or world <= 2


def with_gloo(gloo, fn):
    """fn(gloo)'s result, or None where gloo refuses the call."""
    try:
        return fn(gloo)
    except (RuntimeError, ValueError, AttributeError):
        return None


def op_name(op):
    return {R.SUM: "SUM", R.AVG: "AVG", R.PRODUCT: "PRODUCT", R.MIN: "MIN", R.MAX: "MAX"}[op]


def check_reduction(name, dtype, op, world, ours, want, theirs):
    same(f"{name} {dtype} {op_name(op)}", ours, want, tolerance(dtype, op, world))
    if theirs is not None:
        rtol = 0.0 if exact_with_gloo(dtype, op, world) else tolerance(dtype, op, world)
        same(f"{name} {dtype} {op_name(op)} vs gloo", ours, theirs, rtol)


def all_reduce_cases(gloo, rank, world):
    for dtype in ALL:
        for op in reductions(dtype):
            for n in ([COUNT, BIG] if dtype == torch.float32 and op == R.SUM else [COUNT]):
                inputs = [make(dtype, r, n, "ar", op) for r in range(world)]
                ours = inputs[rank].clone()
                dist.all_reduce(ours, op=op)
                theirs = with_gloo(gloo, lambda g: _run(dist.all_reduce, inputs[rank].clone(), op=op, group=g))
                check_reduction(f"all_reduce[{n}]", dtype, op, world, ours, reference(inputs, op, dtype), theirs)


def _run(fn, t, **kw):
    fn(t, **kw)
    return t


def reduce_cases(gloo, rank, world):
    for dtype in ALL:
        for op in reductions(dtype):
            root = world - 1
            inputs = [make(dtype, r, COUNT, "red", op) for r in range(world)]
            ours = inputs[rank].clone()
            dist.reduce(ours, root, op=op)
            theirs = with_gloo(gloo, lambda g: _run(dist.reduce, inputs[rank].clone(), dst=root, op=op, group=g))
            if rank == root:
                check_reduction("reduce", dtype, op, world, ours, reference(inputs, op, dtype), theirs)


def reduce_scatter_cases(gloo, rank, world):
    for dtype in ALL:
        for op in reductions(dtype):
            inputs = [make(dtype, r, COUNT * world, "rs", op) for r in range(world)]
            want = reference(inputs, op, dtype)[rank * COUNT:(rank + 1) * COUNT]
            ours = torch.empty(COUNT, dtype=dtype)
            dist.reduce_scatter_tensor(ours, inputs[rank].clone(), op=op)
            # Against gloo for SUM only: torch 2.6's gloo reduce_scatter_tensor
            # sums whatever op it is given (the float64 reference holds for all).
            theirs = torch.empty(COUNT, dtype=dtype)
            if op != R.SUM or with_gloo(gloo, lambda g: dist.reduce_scatter_tensor(
                    theirs, inputs[rank].clone(), op=op, group=g) or 1) is None:
                theirs = None
            check_reduction("reduce_scatter_tensor", dtype, op, world, ours, want, theirs)
            listed = torch.empty(COUNT, dtype=dtype)
            dist.reduce_scatter(listed, list(inputs[rank].clone().chunk(world)), op=op)
            same(f"reduce_scatter (list) {dtype} {op_name(op)}", listed, ours)


def movement_cases(gloo, rank, world):
    for dtype in ALL:
        inputs = [make(dtype, r, COUNT, "mv") for r in range(world)]
        root = world // 2
        t = inputs[rank].clone()
        dist.broadcast(t, root)
        same(f"broadcast {dtype}", t, inputs[root])
        out = [torch.empty(COUNT, dtype=dtype) for _ in range(world)]
        dist.all_gather(out, inputs[rank])
        for r in range(world):
            same(f"all_gather {dtype} from {r}", out[r], inputs[r])
        flat = torch.empty(COUNT * world, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[rank])
        same(f"all_gather_into_tensor {dtype}", flat, torch.cat(inputs))
        gathered = [torch.empty(COUNT, dtype=dtype) for _ in range(world)] if rank == root else None
        dist.gather(inputs[rank], gathered, dst=root)
        if rank == root:
            for r in range(world):
                same(f"gather {dtype} from {r}", gathered[r], inputs[r])
        pieces = [make(dtype, r, COUNT, "sc") for r in range(world)]
        got = torch.empty(COUNT, dtype=dtype)
        dist.scatter(got, pieces if rank == root else None, src=root)
        same(f"scatter {dtype}", got, pieces[rank])
        send = torch.cat([make(dtype, rank * world + j, 3, "a2a") for j in range(world)])
        recv = torch.empty(3 * world, dtype=dtype)
        dist.all_to_all_single(recv, send)
        want = torch.cat([make(dtype, j * world + rank, 3, "a2a") for j in range(world)])
        same(f"all_to_all_single {dtype}", recv, want)
        outs = [torch.empty(3, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, list(send.chunk(world)))
        same(f"all_to_all (list) {dtype}", torch.cat(outs), want)
        if world > 1:
            peer = (rank + 1) % world
            source = (rank - 1) % world
            got = torch.empty(COUNT, dtype=dtype)
            if rank % 2 == 0:
                dist.send(inputs[rank], peer, tag=7)
                dist.recv(got, source, tag=7)
            else:
                dist.recv(got, source, tag=7)
                dist.send(inputs[rank], peer, tag=7)
            same(f"send/recv {dtype}", got, inputs[source])
    dist.barrier()


def coalesced_cases(rank, world):
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced will be deprecated")
    tensors = [make(torch.float32, rank, n, f"co{n}") for n in (5, 1, 17)]
    dist.all_reduce_coalesced([t for t in tensors], op=R.SUM)
    for i, n in enumerate((5, 1, 17)):
        want = reference([make(torch.float32, r, n, f"co{n}") for r in range(world)], R.SUM, torch.float32)
        same(f"all_reduce_coalesced[{i}]", tensors[i], want, tolerance(torch.float32, R.SUM, world))


def coalesced_gather_cases(rank, world):
    ins = [make(torch.float32, rank, n, f"agc{n}") for n in (3, 8)]
    outs = [[torch.empty(n) for _ in range(world)] for n in (3, 8)]
    dist.all_gather_coalesced(outs, ins)
    for i, n in enumerate((3, 8)):
        for r in range(world):
            same(f"all_gather_coalesced[{i}] from {r}", outs[i][r], make(torch.float32, r, n, f"agc{n}"))
    manager = getattr(dist.distributed_c10d, "_coalescing_manager", None)
    if manager is None or "async_ops" not in inspect.signature(manager).parameters:
        return  # torch 1.13: no coalescing of the tensor forms
    # torch 2.x's coalescing manager (as FSDP uses it): one call per kind.
    gathered = [torch.empty(n * world) for n in (3, 8)]
    with manager(async_ops=True) as cm:
        for out, inp in zip(gathered, ins):
            dist.all_gather_into_tensor(out, inp)
    cm.wait()
    for i, n in enumerate((3, 8)):
        want = torch.cat([make(torch.float32, r, n, f"agc{n}") for r in range(world)])
        same(f"coalesced all_gather_into_tensor[{i}]", gathered[i], want)
    sources = [make(torch.float32, rank, n * world, f"rsc{n}") for n in (3, 8)]
    scattered = [torch.empty(n) for n in (3, 8)]
    with manager(async_ops=True) as cm:
        for out, inp in zip(scattered, sources):
            dist.reduce_scatter_tensor(out, inp, op=R.MAX)
    cm.wait()
    for i, n in enumerate((3, 8)):
        full = reference([make(torch.float32, r, n * world, f"rsc{n}") for r in range(world)], R.MAX,
                         torch.float32)
        same(f"coalesced reduce_scatter_tensor[{i}]", scattered[i], full[rank * n:(rank + 1) * n])


def noncontiguous_cases(rank, world):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    view = base.t()  # not contiguous: reduced, then written back through the view
    dist.all_reduce(view)
    want = sum(torch.arange(24, dtype=torch.float32).reshape(4, 6) + r for r in range(world))
    same("all_reduce of a transposed view", base, want)
    col = torch.zeros(5, 2)
    dist.broadcast(col[:, 1], 0) if rank != 0 else dist.broadcast(col[:, 1].add_(3), 0)
    same("broadcast into a strided column", col[:, 1], torch.full((5,), 3.0))
    outs = [torch.zeros(3, 2)[:, 0] for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    for r in range(world):
        same(f"all_gather into strided outputs {r}", outs[r], torch.full((3,), float(r)))


def async_cases(rank, world):
    ts = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]  # several in flight, torch's order
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        same(f"async all_reduce {i}", t, torch.full((1000,), float(sum(r + i for r in range(world)))))
        same(f"async all_reduce {i} completed", torch.tensor(works[i].is_completed()), torch.tensor(True))
    t = torch.ones(8)
    fut = dist.all_reduce(t, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    same("future then()", doubled, torch.full((8,), 2.0 * world))
    if world > 1:
        # Work.wait(timeout) gives up while the op still runs; a later wait() completes it.
        t = torch.ones(4)
        if rank == 1:
            time.sleep(1.0)
        work = dist.all_reduce(t, async_op=True)
        if rank == 0:
            try:
                work.wait(timeout=datetime.timedelta(milliseconds=100))
                fail("Work.wait(100 ms) returned while a peer was a second late")
            except RuntimeError as e:
                same("wait(timeout) message", torch.tensor("did not complete within" in str(e)), torch.tensor(True))
        work.wait()
        same("all_reduce after a timed-out wait", t, torch.full((4,), float(world)))


def expect_error(name, fn, *words):
    global checks
    checks += 1
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            fail(f"{name}: the error does not say {missing}: {e}")
        return
    fail(f"{name}: no error")


def error_cases(rank, world):
    expect_error("BAND", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.BAND), "ctorch", "allreduce")
    expect_error("AVG of int", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG), "floating")
    expect_error("sparse", lambda: dist.all_reduce(torch.eye(2).to_sparse()), "dense")
    # torch sums complex tensors as their real view: that reaches ctorch as float32.
    z = torch.full((2,), complex(rank, 1), dtype=torch.complex64)
    dist.all_reduce(z)
    same("complex SUM", z, torch.full((2,), complex(sum(range(world)), world), dtype=torch.complex64))
    expect_error("a type ctorch lacks", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)), "ctorch", "Short")
    expect_error("SUM of bool", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)), "bool")
    if world > 1:
        expect_error("uneven all_to_all_single",
                     lambda: dist.all_to_all_single(torch.empty(world + 1), torch.ones(world + 1),
                                                    [2] + [1] * (world - 1), [2] + [1] * (world - 1)),
                     "all_to_all_single", "uneven")
        # A call that differs across ranks: every rank raises, and the group stays usable.
        expect_error("count mismatch", lambda: dist.all_reduce(torch.ones(4 + rank)), "rank")
        t = torch.ones(3)
        dist.all_reduce(t)
        same("all_reduce after a mismatch", t, torch.full((3,), float(world)))


def main():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--transport", help="the transport to expect (default: shm, gloo for one rank)")
    a = p.parse_args()
    dist.init_process_group("ctorch", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    want_transport = a.transport or ("gloo" if world == 1 else "shm")
    if ctorch.transport() != want_transport:
        fail(f"transport {ctorch.transport()}, want {want_transport}")
    all_reduce_cases(gloo, rank, world)
    reduce_cases(gloo, rank, world)
    reduce_scatter_cases(gloo, rank, world)
    movement_cases(gloo, rank, world)
    coalesced_cases(rank, world)
    coalesced_gather_cases(rank, world)
    noncontiguous_cases(rank, world)
    async_cases(rank, world)
    error_cases(rank, world)
    dist.barrier()
    print(f"ctorch ops: rank {rank} of {world}: {checks} checks, {len(failures)} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

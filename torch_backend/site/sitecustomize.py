"""ctorchrun --cpu_backend ctorch: an unmodified script's gloo groups run on ctorch.

ctorchrun puts this folder first on the workers' PYTHONPATH, so Python runs
this module at startup; it imports nothing heavy. When torch.distributed's
distributed_c10d module is first imported, its _new_process_group_helper
(through which init_process_group, new_group and everything built on them
create groups) is wrapped: a group asked for as gloo is created on ctorch
instead, for CPU tensors only:

  "gloo"                      -> "ctorch" (torch 1.x), "cpu:ctorch,cuda:gloo" (2.x)
  "cpu:gloo,cuda:nccl"        -> "cpu:ctorch,cuda:nccl"
  no backend (2.x, CPU host)  -> "cpu:ctorch"

Any other backend (nccl, mpi, a plugin) is untouched. The group is then
recorded under the backend the script asked for, so dist.get_backend() keeps
answering "gloo". Rank 0 of each group says on stderr that it runs on ctorch,
and over which transport. Where the workers' torch has no ctorch build, the
worker with RANK 0 warns once and every group stays on gloo.

Then the next sitecustomize on sys.path (the user's, the distribution's) runs
as if this one were not there.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _translate(backend, torch_major, cpu_host):
    """The backend string to create instead of `backend`, or None to keep it."""
    if backend is None:
        return None
    text = str(backend).lower()
    if text == "gloo":
        return "ctorch" if torch_major < 2 else "cpu:ctorch,cuda:gloo"
    if text == "undefined":
        return "cpu:ctorch" if torch_major >= 2 and cpu_host else None
    if ":" in text:
        pairs = [p.split(":", 1) for p in text.split(",")]
        if ["cpu", "gloo"] not in pairs:
            return None
        return ",".join(f"{d}:{'ctorch' if [d, b] == ['cpu', 'gloo'] else b}" for d, b in pairs)
    return None


_ctorch = None  # the ctorch module once imported; False when it cannot be


def _load_ctorch():
    global _ctorch
    if _ctorch is None:
        try:
            import ctorch

            _ctorch = ctorch
        except Exception as e:  # no build for this torch, a broken install
            _ctorch = False
            if os.environ.get("RANK", "0") == "0":
                print(
                    f"[ctorchrun] warning: --cpu_backend ctorch: {e}; the job's gloo process "
                    f"groups stay on gloo",
                    file=sys.stderr,
                    flush=True,
                )
    return _ctorch


def _pg_map(c10d):
    world = getattr(c10d, "_world", None)
    return world.pg_map if world is not None else c10d._pg_map


def _cpu_host():
    try:
        import torch

        return torch._C._get_accelerator().type == "cpu"
    except Exception:
        return True  # torch before 2.6 has no accelerator query: undefined is gloo there


def _wrap(c10d):
    import inspect

    import torch

    helper = c10d._new_process_group_helper
    if getattr(helper, "_ctorch_cpu_backend", False):
        return
    signature = inspect.signature(helper)
    major = int(torch.__version__.split(".")[0])

    def _new_process_group_helper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        asked = bound.arguments.get("backend")
        instead = _translate(asked, major, _cpu_host())
        if instead is None or not _load_ctorch():
            return helper(*args, **kwargs)
        bound.arguments["backend"] = c10d.Backend(instead) if ":" not in instead else instead
        result = helper(*bound.args, **bound.kwargs)
        pg = result[0] if isinstance(result, tuple) else result
        _record_as_asked(c10d, pg, asked)
        return result

    _new_process_group_helper._ctorch_cpu_backend = True
    c10d._new_process_group_helper = _new_process_group_helper


def _record_as_asked(c10d, pg, asked):
    """Records `pg` under the backend the script asked for, and says what runs it."""
    pg_map = _pg_map(c10d)
    if pg is None or pg not in pg_map:
        return  # not a member of the group
    pg_map[pg] = (asked,) + tuple(pg_map[pg][1:])
    world = getattr(c10d, "_world", None)
    configs = getattr(world, "pg_backend_config", None)
    if configs is not None and pg in configs:
        try:
            configs[pg] = str(c10d.BackendConfig(c10d.Backend(asked)))
        except Exception:
            pass  # the real configuration stays
    if pg.rank() == 0:
        try:
            how = f"transport {_ctorch.transport(pg)}"
        except Exception as e:
            how = f"transport unknown: {e}"
        name = c10d._get_process_group_name(pg) if hasattr(c10d, "_get_process_group_name") else ""
        print(
            f"[ctorchrun] the {asked} process group {name!r} of {pg.size()} rank(s) runs on "
            f"ctorch (--cpu_backend ctorch), {how}",
            file=sys.stderr,
            flush=True,
        )


class _WrapAfterImport(importlib.abc.MetaPathFinder):
    """Wraps distributed_c10d's group factory once that module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed.distributed_c10d":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module):
            exec_module(module)
            try:
                _wrap(module)
            except Exception as e:  # never break the user's import
                print(f"[ctorchrun] warning: --cpu_backend ctorch not applied: {e}",
                      file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_then_wrap
        return spec


def _chain():
    """Runs the next sitecustomize on sys.path, which this one would hide."""
    rest, seen = [], False
    for entry in sys.path:
        if seen:
            rest.append(entry)
        elif os.path.realpath(entry or os.curdir) == _HERE:
            seen = True
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("CTORCHRUN_CPU_BACKEND") == "ctorch":
    sys.meta_path.insert(0, _WrapAfterImport())
_chain()

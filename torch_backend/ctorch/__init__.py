"""ctorch: ctorchrun's collective runtime (libctorch_dist) as a torch.distributed backend.

    import ctorch                      # registers the backend "ctorch"
    import torch.distributed as dist
    dist.init_process_group("ctorch")  # CPU tensors; "cpu:ctorch,cuda:nccl" on torch 2.x

Between ranks of one host the collectives move through shared memory; across
hosts through shared memory within each and gloo between them; as
libctorch_dist chooses for a C++ worker, with the same switches
(CTORCHRUN_DIST_SHM=0, CTORCHRUN_DIST_CHECK_CALLS=0). Under ctorchrun this
package is on the workers' import path already.

The compiled half is built per torch version (_C_torch<major>_<minor>); a
torch with no matching build raises ImportError naming the builds there are.
"""

import glob
import importlib
import os
import re

import torch
import torch.distributed as _dist

__all__ = ["transport", "torch_versions_built"]


def torch_versions_built():
    """The torch versions (major.minor) this package has a compiled module for."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = set()
    for path in glob.glob(os.path.join(here, "_C_torch*")):
        m = re.match(r"_C_torch(\d+)_(\d+)\.", os.path.basename(path))
        if m:
            found.add(f"{m.group(1)}.{m.group(2)}")
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def _load():
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if not m:
        raise ImportError(f"ctorch: cannot read torch's version {torch.__version__!r}")
    name = f"_C_torch{m.group(1)}_{m.group(2)}"
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        built = ", ".join(torch_versions_built()) or "none"
        raise ImportError(
            f"ctorch has no build for torch {torch.__version__} (built for: {built}); "
            f"build it against this torch: pip install --no-build-isolation --no-index "
            f"<ctorchrun>/torch_backend"
        ) from None


_C = _load()


def _create(dist_backend_opts, backend_options):
    del backend_options  # ctorch takes no options of its own
    return _C.create_process_group(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        dist_backend_opts.group_id,
    )


def _register():
    if "CTORCH" in _dist.Backend._plugins:
        return  # imported twice under two names: one registration
    kwargs = {"extended_api": True}
    if "devices" in _dist.Backend.register_backend.__code__.co_varnames:
        kwargs["devices"] = ["cpu"]
    _dist.Backend.register_backend("ctorch", _create, **kwargs)


def transport(group=None):
    """What moves `group`'s data (default: the default group): 'shm', 'hier' or 'gloo'."""
    pg = group if group is not None else _dist.distributed_c10d._get_default_group()
    if hasattr(pg, "_get_backend"):  # torch 2.x: the ctorch Backend under the ProcessGroup
        pg = pg._get_backend(torch.device("cpu"))
    return _C.transport(pg)


_register()

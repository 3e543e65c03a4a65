"""Test environment for Debian 13's torch 2.6, run through scripts/torch2/python.

Python imports this module at startup (the wrapper puts its folder first on
PYTHONPATH). It does three things, and imports nothing heavy:

1. TCPStore defaults to use_libuv=False. torch 2.6's TCPStore, client or
   server, defaults to use_libuv=True, but Debian builds torch without libuv,
   so that init_process_group() fails with "use_libuv was requested but
   PyTorch was build without libuv support". The TCPStore constructor gets
   use_libuv=False unless its caller passes it: direct TCPStore(...) calls,
   torchrun's c10d rendezvous, and the workers' client of a launcher's store
   (TORCHELASTIC_USE_AGENT_STORE=True), which no environment variable
   changes. USE_LIBUV=0 (unless set) is what torch's other paths pass on
   (env:// and tcp:// init without an agent store, torchrun's static
   rendezvous). An explicit use_libuv=True still fails, as it should.
2. sys.executable is the wrapper, so that what Python starts again
   (torchrun's workers, multiprocessing's spawn) runs torch 2.6 too.
3. The environment is put back as the wrapper was given it (PYTHONPATH), so
   that child processes see the caller's environment plus USE_LIBUV only.

Then the next sitecustomize on sys.path (ctorchrun's --cpu_backend hook, the
user's, Debian's) runs as if this one were not there.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

os.environ.setdefault("USE_LIBUV", "0")

_wrapper = os.environ.pop("CTORCHRUN_TORCH2_PYTHON", None)
if _wrapper:
    sys.executable = _wrapper
    sys._base_executable = _wrapper
    if "CTORCHRUN_TORCH2_PYTHONPATH" in os.environ:
        os.environ["PYTHONPATH"] = os.environ.pop("CTORCHRUN_TORCH2_PYTHONPATH")
    else:
        os.environ.pop("PYTHONPATH", None)


def _default_no_libuv(module):
    cls = getattr(module, "TCPStore", None)
    init = getattr(cls, "__init__", None)
    if init is None or getattr(init, "_ctorchrun_no_libuv", False):
        return

    def __init__(self, *args, **kwargs):
        # use_libuv is the 9th parameter: (host_name, port, world_size,
        # is_master, timeout, wait_for_workers, multi_tenant,
        # master_listen_fd, use_libuv).
        if len(args) < 9 and "use_libuv" not in kwargs:
            kwargs["use_libuv"] = False
        init(self, *args, **kwargs)

    __init__._ctorchrun_no_libuv = True
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches torch.distributed's TCPStore once that module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _default_no_libuv(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())


def _chain():
    """Runs the next sitecustomize on sys.path, which this one would hide."""
    here = os.path.dirname(os.path.realpath(__file__))
    rest, seen = [], False
    for entry in sys.path:
        if seen:
            rest.append(entry)
        elif os.path.realpath(entry or os.curdir) == here:
            seen = True
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()

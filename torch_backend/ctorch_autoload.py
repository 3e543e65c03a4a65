"""torch's backend autoload entry point for ctorch (torch 2.5 and later).

torch imports the entry points of group "torch.backends" at `import torch`
(unless TORCH_DEVICE_BACKEND_AUTOLOAD=0) and fails the whole import if one
raises, so this one never does: where ctorch has no build for the running
torch, init_process_group("ctorch") stays unknown, as it would be without
ctorch, and `import ctorch` says why.
"""


def load():
    try:
        import ctorch  # noqa: F401  (importing registers the backend)
    except Exception:
        pass

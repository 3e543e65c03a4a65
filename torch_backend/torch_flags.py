"""Prints what CMake needs to build a torch extension against this Python's torch.

One line each, after the word CTORCH_FLAG (so that whatever torch itself
prints on import, as a cpuinfo warning in a chroot without /proc, is told
apart): torch's version, its include directories and library
directories (comma-separated), Python's include directory, the extension
suffix, and torch's C++11 ABI flag (0 or 1). Exits non-zero, saying why on
stderr, when torch or its C++ headers are missing.
"""

import os
import sys
import sysconfig

try:
    import torch
except Exception as e:  # any failure to import means: no torch to build against
    sys.exit(f"no torch: {e}")

# What torch.utils.cpp_extension.include_paths() and library_paths() give,
# without importing it (it needs setuptools, which a plain Python may lack).
here = os.path.dirname(torch.__file__)
includes = [d for d in (os.path.join(here, "include"),
                        os.path.join(here, "include", "torch", "csrc", "api", "include"),
                        "/usr/include/torch/csrc/api/include") if os.path.isdir(d)]
libraries = [d for d in (os.path.join(here, "lib"),) if os.path.isdir(d)]
header = "torch/csrc/distributed/c10d/ProcessGroup.hpp"
if not any(os.path.exists(os.path.join(d, header)) for d in includes + ["/usr/include"]):
    sys.exit(f"torch {torch.__version__} has no C++ headers ({header}); install libtorch-dev")
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    sys.exit("no Python.h; install python3-dev")
for value in (torch.__version__, ",".join(includes), ",".join(libraries),
              sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"),
              int(torch._C._GLIBCXX_USE_CXX11_ABI)):
    print("CTORCH_FLAG", value)

"""Prints what CMake needs to build a torch extension against this Python's torch.

One line each: torch's version, its include directories and library
directories (comma-separated), Python's include directory, the extension
suffix, and torch's C++11 ABI flag (0 or 1). Exits non-zero, saying why on
stderr, when torch or its C++ headers are missing.
"""

import os
import sys
import sysconfig

try:
    import torch
    from torch.utils import cpp_extension
except Exception as e:  # any failure to import means: no torch to build against
    sys.exit(f"no torch: {e}")

includes = cpp_extension.include_paths()
header = "torch/csrc/distributed/c10d/ProcessGroup.hpp"
if not any(os.path.exists(os.path.join(d, header)) for d in includes + ["/usr/include"]):
    sys.exit(f"torch {torch.__version__} has no C++ headers ({header}); install libtorch-dev")
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    sys.exit("no Python.h; install python3-dev")
print(torch.__version__)
print(",".join(includes))
print(",".join(cpp_extension.library_paths()))
print(sysconfig.get_paths()["include"])
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))

"""Builds and installs the ctorch backend against the torch of the Python that runs it.

    /usr/bin/python3 -m venv --system-site-packages ~/venv   # sees Debian's torch
    ~/venv/bin/pip install --no-build-isolation --no-index ./torch_backend

(run from a ctorchrun checkout). It configures the checkout with CMake in
backend-only mode (libctorch_dist built static, then the torch extension:
CMakeLists.txt, CTORCHRUN_TORCH_BACKEND_ONLY) and installs the package
`ctorch` with the one module built for this torch. It needs what the
extension builds with: cmake, a C++17 compiler, the headers of torch
(Debian's libtorch-dev), Python, pybind11, spdlog, fmt, Boost and gloo
(scripts/setup.sh installs them). No network: --no-build-isolation uses the
installed setuptools and torch.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)


def project_version():
    text = open(os.path.join(CHECKOUT, "CMakeLists.txt")).read()
    return re.search(r"project\(ctorchrun VERSION ([0-9.]+)", text).group(1)


def module_name():
    import torch  # the torch this build is for (no build isolation)

    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return f"ctorch._C_torch{major}_{minor}"


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = os.path.abspath(self.build_temp)
        subprocess.check_call([
            "cmake", "-S", CHECKOUT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            "-DCTORCHRUN_TORCH_BACKEND_ONLY=ON", "-DCTORCHRUN_TORCH_BACKEND=ON",
            f"-DCTORCHRUN_TORCH_PYTHON={sys.executable}"])
        subprocess.check_call(["cmake", "--build", build, "--parallel", str(os.cpu_count() or 1)])
        leaf = ext.name.split(".")[-1]
        built = glob.glob(os.path.join(build, "python", "ctorch", leaf + ".*"))
        if len(built) != 1:
            raise RuntimeError(f"the CMake build made {built} for {leaf}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)


setup(
    name="ctorch",
    version=project_version(),
    description="ctorchrun's collective runtime (libctorch_dist) as the torch.distributed backend 'ctorch'",
    packages=["ctorch"],
    py_modules=["ctorch_autoload"],
    # torch 2.5+ imports these at `import torch`: init_process_group("ctorch")
    # then works without `import ctorch`.
    entry_points={"torch.backends": ["ctorch = ctorch_autoload:load"]},
    ext_modules=[Extension(module_name(), sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
)

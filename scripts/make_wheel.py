#!/usr/bin/env python3
"""Writes ctorchrun's wheel (scripts/package_wheel.sh): a plain zip, with
what the wheel format (PEP 427, PEP 491) asks for and nothing downloaded.

  ctorchrun-<v>.data/scripts/ctorchrun, ctorch-store, ctorch-status   pip puts them on PATH
  ctorchrun/__init__.py, __main__.py                   python -m ctorchrun
  ctorchrun-<v>.dist-info/METADATA, WHEEL, RECORD      RECORD: sha256 of each file

The dates inside are fixed (SOURCE_DATE_EPOCH, else 1980), so the same
binaries give the same wheel. No torchrun command: ctorchrun sits next to
torch's own.
"""

import argparse
import base64
import hashlib
import os
import time
import zipfile

INIT = '''"""ctorchrun, PyTorch's torchrun in C++: the binaries are on PATH
(ctorchrun, ctorch-store); `python -m ctorchrun ARGS` runs ctorchrun too."""

__version__ = "{version}"
'''

MAIN = '''"""python -m ctorchrun ARGS: runs the ctorchrun binary this wheel installed."""

import os
import shutil
import sys
import sysconfig


def binary(name="ctorchrun"):
    """The wheel's binary: in the scripts folder of the scheme it was installed
    with (a venv's bin/, ~/.local/bin for --user), else the first on PATH."""
    folders = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    user = sysconfig.get_preferred_scheme("user") if hasattr(sysconfig, "get_preferred_scheme") \\
        else os.name + "_user"
    try:
        folders.append(sysconfig.get_path("scripts", user))
    except KeyError:
        pass
    for folder in folders:
        path = os.path.join(folder or "", name)
        if folder and os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def main():
    path = binary()
    if path is None:
        sys.exit("ctorchrun: the ctorchrun binary is not installed next to this package")
    # The workers run on this interpreter, as torchrun's do, unless told
    # otherwise: ctorchrun alone takes python3 from PATH, which need not be
    # this one when the venv is not activated.
    if not os.environ.get("CTORCHRUN_PYTHON") and not os.environ.get("PYTHON_EXEC"):
        os.environ["CTORCHRUN_PYTHON"] = sys.executable
    os.execv(path, [path] + sys.argv[1:])


if __name__ == "__main__":
    main()
'''


def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def metadata(version):
    return (
        "Metadata-Version: 2.1\n"
        "Name: ctorchrun\n"
        f"Version: {version}\n"
        "Summary: PyTorch's torchrun launcher in C++ (ctorchrun, ctorch-store)\n"
        "Requires-Python: >=3\n"
        "Classifier: Operating System :: POSIX :: Linux\n"
        "Classifier: Programming Language :: C++\n"
        "Description-Content-Type: text/plain\n"
        "\n"
        "ctorchrun starts and watches the workers of a distributed PyTorch job, as\n"
        "torchrun does; ctorch-store is its TCPStore-compatible server. Both are\n"
        "static but for the C library (glibc 2.36 or later).\n"
    )


def wheel_file(tag):
    return ("Wheel-Version: 1.0\n"
            "Generator: ctorchrun scripts/make_wheel.py\n"
            "Root-Is-Purelib: false\n"
            f"Tag: {tag}\n")


def entries(version, tag, bin_dir):
    """(path in the wheel, bytes, executable) for every file but RECORD."""
    data = f"ctorchrun-{version}.data/scripts/"
    info = f"ctorchrun-{version}.dist-info/"
    out = [("ctorchrun/__init__.py", INIT.format(version=version).encode(), False),
           ("ctorchrun/__main__.py", MAIN.encode(), False)]
    for name in ("ctorchrun", "ctorch-store", "ctorch-status"):
        with open(os.path.join(bin_dir, name), "rb") as f:
            out.append((data + name, f.read(), True))
    out += [(info + "METADATA", metadata(version).encode(), False),
            (info + "WHEEL", wheel_file(tag).encode(), False),
            (info + "top_level.txt", b"ctorchrun\n", False)]
    return out


def write(path, files, record_path):
    epoch = max(int(os.environ.get("SOURCE_DATE_EPOCH", "315532800")), 315532800)
    stamp = time.gmtime(epoch)[:6]
    record = "".join(f"{p},{digest(d)},{len(d)}\n" for p, d, _ in files) + f"{record_path},,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d, executable in files + [(record_path, record.encode(), False)]:
            info = zipfile.ZipInfo(p, stamp)
            info.external_attr = (0o100755 if executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True)
    ap.add_argument("--platform", required=True, help="manylinux_2_36_x86_64")
    ap.add_argument("--bin", required=True, help="folder with ctorchrun, ctorch-store and ctorch-status")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tag = f"py3-none-{a.platform}"
    files = entries(a.version, tag, a.bin)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"ctorchrun-{a.version}-{tag}.whl")
    write(path, files, f"ctorchrun-{a.version}.dist-info/RECORD")
    print(f"make_wheel: {path} ({os.path.getsize(path) // 1024} KiB)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The gpu-labelled tests on a GPU machine that has no build tools (the device
# tool's machine: torch with CUDA, the nvidia-nccl wheel's libnccl).
#   tests/collectives/gpu_run.sh bundle [build]   here: copies the shared
#       libraries the test binaries need from outside the build (not glibc's,
#       not libnccl, not the driver) into build/gpu-libs; then carry build/bin,
#       build/lib and build/gpu-libs.
#   tests/collectives/gpu_run.sh run [build] [catch args]   there: runs
#       nccl_gpu_tests with build/lib, build/gpu-libs and the wheel's libnccl
#       on LD_LIBRARY_PATH, and the nccl bench at world size 1 (BENCH=1).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?bundle or run}
build=${2:-build}
case $mode in
  bundle)
    mkdir -p "$build/gpu-libs"
    for b in "$build"/bin/*; do ldd "$b" 2>/dev/null || true; done | awk '/=> \// {print $3}' |
      sort -u | grep -v -e "^$PWD/$build/" -e '/libc\.so' -e '/libm\.so' -e '/libpthread\.so' \
        -e '/libdl\.so' -e '/librt\.so' -e '/libgcc_s\.so' -e '/libnccl' \
        -e '/libcuda\.so' | while read -r lib; do cp -L "$lib" "$build/gpu-libs/"; done
    du -sh "$build/bin" "$build/lib" "$build/gpu-libs"
    ;;
  run)
    shift 2 || shift $#
    python=${CTORCHRUN_PYTHON:-python3}
    nccl_lib=$("$python" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
    export LD_LIBRARY_PATH="$PWD/$build/lib:$PWD/$build/gpu-libs:$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nvidia-smi -L || true
    "$build/bin/nccl_gpu_tests" "$@"
    if [ "${BENCH:-0}" = 1 ]; then
      BACKEND=nccl CTORCHRUN_PYTHON=$python bench/collective_bench.sh
    fi
    ;;
  *)
    echo "gpu_run.sh: bundle or run" >&2
    exit 2
    ;;
esac

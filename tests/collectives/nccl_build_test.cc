// The build never drops the nccl backend silently: where CUDA's NCCL is
// installed, CMake must have found it and built ctorchrun::dist_nccl.

#include <catch2/catch.hpp>
#include <filesystem>

TEST_CASE("nccl build: the nccl backend is built where /usr/local/cuda has NCCL", "[unit]") {
  const bool installed = std::filesystem::exists("/usr/local/cuda/include/nccl.h");
  INFO("CTORCHRUN_HAVE_NCCL=" << CTORCHRUN_HAVE_NCCL
                              << "; see CMake's 'ctorchrun: building ... nccl backend' line");
  if (installed) {
    CHECK(CTORCHRUN_HAVE_NCCL == 1);
  } else {
    SUCCEED("no NCCL under /usr/local/cuda: the build may go without the nccl backend");
  }
}

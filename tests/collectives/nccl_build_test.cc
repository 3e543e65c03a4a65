// The build never drops the nccl backend silently: where CUDA's NCCL is
// installed, CMake must have found it and built ctorchrun::dist_nccl; and
// ctorchrun::dist stays free of CUDA either way.

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

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

TEST_CASE("nccl build: libctorch_dist itself names neither NCCL nor CUDA", "[unit]") {
  std::ifstream in(CTORCHRUN_DIST_LIB, std::ios::binary);
  REQUIRE(in.good());
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() > 1000);
  CHECK(bytes.find("libnccl") == std::string::npos);
  CHECK(bytes.find("libcudart") == std::string::npos);
  CHECK(bytes.find("libcuda.so") == std::string::npos);
  CHECK(bytes.find("cudaMalloc") == std::string::npos);
}

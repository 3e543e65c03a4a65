#pragma once

// Device memory for the tools' --backend nccl (ctorch-train-example,
// ctorch-collective-bench): buffers on the group's CUDA device, and host
// buffers staged through it. Without the nccl backend in the build only CPU
// groups work and a CUDA device is a ConfigError.

#include <cstddef>
#include <functional>
#include <string>

#include "collectives/types.h"
#include "common/error.h"

#if CTORCHRUN_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "collectives/nccl/nccl_backend.h"
#endif

namespace ctorchrun::tools {

// Makes "nccl" a backend name when the build has it.
inline void register_gpu_backends() {
#if CTORCHRUN_HAVE_NCCL
  dist::register_nccl_backend();
#endif
}

// `bytes` of memory on `device` (a CUDA device), freed on destruction.
class DeviceMemory {
 public:
  DeviceMemory(dist::Device device, size_t bytes) : device_(device), bytes_(bytes) {
#if CTORCHRUN_HAVE_NCCL
    check(cudaSetDevice(device.index), "cudaSetDevice");
    if (bytes > 0) check(cudaMalloc(&data_, bytes), "cudaMalloc");
#else
    throw ConfigError("this build has no CUDA (no nccl backend); device " +
                      dist::to_string(device) + " cannot be used");
#endif
  }
  ~DeviceMemory() {
#if CTORCHRUN_HAVE_NCCL
    if (data_ != nullptr) cudaFree(data_);
#endif
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // A Buffer of `count` elements of `dtype` over this memory.
  dist::Buffer buffer(size_t count, dist::DataType dtype) const {
    return dist::Buffer{data_, count, dtype, device_};
  }
  void upload(const void* host, size_t bytes) {
#if CTORCHRUN_HAVE_NCCL
    if (bytes > 0) check(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice), "upload");
#else
    (void)host;
    (void)bytes;
#endif
  }
  void download(void* host, size_t bytes) const {
#if CTORCHRUN_HAVE_NCCL
    if (bytes > 0) check(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost), "download");
#else
    (void)host;
    (void)bytes;
#endif
  }

 private:
#if CTORCHRUN_HAVE_NCCL
  static void check(cudaError_t result, const char* what) {
    if (result != cudaSuccess) {
      throw IoError(std::string("CUDA ") + what + ": " + cudaGetErrorString(result));
    }
  }
#endif

  dist::Device device_;
  size_t bytes_;
  void* data_ = nullptr;
};

// Copies between host memory and a device Buffer (its bytes()).
inline void upload(const dist::Buffer& device, const void* host) {
#if CTORCHRUN_HAVE_NCCL
  cudaError_t r = cudaMemcpy(device.data, host, device.bytes(), cudaMemcpyHostToDevice);
  if (r != cudaSuccess) throw IoError(std::string("CUDA upload: ") + cudaGetErrorString(r));
#else
  (void)device;
  (void)host;
#endif
}
inline void download(void* host, const dist::Buffer& device) {
#if CTORCHRUN_HAVE_NCCL
  cudaError_t r = cudaMemcpy(host, device.data, device.bytes(), cudaMemcpyDeviceToHost);
  if (r != cudaSuccess) throw IoError(std::string("CUDA download: ") + cudaGetErrorString(r));
#else
  (void)host;
  (void)device;
#endif
}

// Runs `op` on `host` itself for a CPU device, else on a device copy that
// is uploaded before and downloaded after.
inline void staged(const dist::Buffer& host, dist::Device device,
                   const std::function<void(const dist::Buffer&)>& op) {
  if (device.type == dist::DeviceType::kCpu) {
    op(host);
    return;
  }
  DeviceMemory memory(device, host.bytes());
  memory.upload(host.data, host.bytes());
  op(memory.buffer(host.count, host.dtype));
  memory.download(host.data, host.bytes());
}

}  // namespace ctorchrun::tools

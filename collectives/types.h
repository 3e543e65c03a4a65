#pragma once

// Data types, reduction operations and devices of libctorch_dist, and the
// buffer description every collective takes.
//
// A Buffer is a view: a pointer to `count` contiguous elements of `dtype` on
// `device`. The caller owns the memory and keeps it alive (and untouched)
// until the operation that uses it has completed (Work::wait returned).

#include <cstddef>
#include <cstdint>
#include <string>

namespace ctorchrun::dist {

enum class DataType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt8, kUInt8, kInt32, kInt64 };

// kAverage is for floating types only; integers get a ConfigError.
enum class ReduceOp { kSum, kProduct, kMin, kMax, kAverage };

enum class DeviceType { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = -1;  // the CUDA device; -1 for the CPU
};

size_t element_size(DataType dtype);
bool is_floating(DataType dtype);
const char* to_string(DataType dtype);
const char* to_string(ReduceOp op);
std::string to_string(const Device& device);

// IEEE binary16 and bfloat16 conversions, round to nearest even.
uint16_t float_to_half(float value);
float half_to_float(uint16_t bits);
uint16_t float_to_bfloat16(float value);
float bfloat16_to_float(uint16_t bits);

// Marker types for 16-bit floating data held as raw bits.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

template <typename T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> {
  static constexpr DataType value = DataType::kFloat32;
};
template <>
struct DataTypeOf<double> {
  static constexpr DataType value = DataType::kFloat64;
};
template <>
struct DataTypeOf<Half> {
  static constexpr DataType value = DataType::kFloat16;
};
template <>
struct DataTypeOf<BFloat16> {
  static constexpr DataType value = DataType::kBFloat16;
};
template <>
struct DataTypeOf<int8_t> {
  static constexpr DataType value = DataType::kInt8;
};
template <>
struct DataTypeOf<uint8_t> {
  static constexpr DataType value = DataType::kUInt8;
};
template <>
struct DataTypeOf<int32_t> {
  static constexpr DataType value = DataType::kInt32;
};
template <>
struct DataTypeOf<int64_t> {
  static constexpr DataType value = DataType::kInt64;
};

struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  Device device{};

  size_t bytes() const { return count * element_size(dtype); }
};

// Buffer over `count` elements of a typed CPU array.
template <typename T>
Buffer make_buffer(T* data, size_t count, Device device = {}) {
  return Buffer{static_cast<void*>(data), count, DataTypeOf<T>::value, device};
}

}  // namespace ctorchrun::dist

#include "collectives/types.h"

#include <cstring>

#include "common/error.h"

namespace ctorchrun::dist {

size_t element_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
      return 1;
  }
  return 0;
}

bool is_floating(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 ||
         dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

const char* to_string(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAverage:
      return "average";
  }
  return "unknown";
}

std::string to_string(const Device& device) {
  if (device.type == DeviceType::kCpu) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

// Round to nearest even with the exponent rebias done in integer arithmetic
// and subnormals rounded by the FPU (adding 0.5 puts the half's subnormal
// mantissa in the float's low bits); F. Giesen's float_to_half_fast3_rtne.
uint16_t float_to_half(float value) {
  uint32_t f;
  std::memcpy(&f, &value, sizeof f);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t out;
  if (f >= (127u + 16u) << 23) {               // at least 65536, Inf or NaN
    out = f > (255u << 23) ? 0x7e00 : 0x7c00;  // NaN stays NaN (quiet)
  } else if (f < 113u << 23) {                 // half subnormal or zero
    float x;
    std::memcpy(&x, &f, sizeof x);
    x += 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    out = static_cast<uint16_t>(bits - (126u << 23));
  } else {
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;
    out = static_cast<uint16_t>(f >> 13);
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t f;
  if (exponent == 0) {
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    std::memcpy(&f, &magnitude, sizeof f);
    f |= sign;
  } else if (exponent == 31) {
    f = sign | 0x7f800000u | (mantissa << 13);
  } else {
    f = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

uint16_t float_to_bfloat16(float value) {
  uint32_t f;
  std::memcpy(&f, &value, sizeof f);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((f >> 16) | 0x40u);  // NaN
  f += 0x7fffu + ((f >> 16) & 1u);
  return static_cast<uint16_t>(f >> 16);
}

float bfloat16_to_float(uint16_t bits) {
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &f, sizeof out);
  return out;
}

}  // namespace ctorchrun::dist

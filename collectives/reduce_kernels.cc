#include "collectives/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/error.h"

namespace ctorchrun::dist::detail {
namespace {

struct Sum {
  template <typename T>
  static T apply(T a, T b) {
    return static_cast<T>(a + b);
  }
};
struct Product {
  template <typename T>
  static T apply(T a, T b) {
    return static_cast<T>(a * b);
  }
};
// Min and max pass a NaN on, as torch's minimum and maximum do, from
// either side: std::min(a, b) keeps a NaN only as its first argument, so
// paths that combine ranks in different orders (gloo's ring, the
// shared-memory ones) would disagree on whether a NaN survives.
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a < b || a != a) ? a : b;
    } else {
      return std::min(a, b);
    }
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) {
      return (a > b || a != a) ? a : b;
    } else {
      return std::max(a, b);
    }
  }
};

// Plain loops over native types; the compiler vectorises them.
template <typename T, typename Op>
void native(void* out, const void* a, const void* b, size_t count) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = Op::apply(x[i], y[i]);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float), typename Op>
void sixteen(void* out, const void* a, const void* b, size_t count) {
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = FromFloat(Op::apply(ToFloat(x[i]), ToFloat(y[i])));
}

template <typename Op>
ReduceFn for_op(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return native<float, Op>;
    case DataType::kFloat64:
      return native<double, Op>;
    case DataType::kFloat16:
      return sixteen<half_to_float, float_to_half, Op>;
    case DataType::kBFloat16:
      return sixteen<bfloat16_to_float, float_to_bfloat16, Op>;
    case DataType::kInt8:
      return native<int8_t, Op>;
    case DataType::kUInt8:
      return native<uint8_t, Op>;
    case DataType::kInt32:
      return native<int32_t, Op>;
    case DataType::kInt64:
      return native<int64_t, Op>;
  }
  CTORCHRUN_CHECK(false, "unknown data type");
  return nullptr;
}

}  // namespace

ReduceFn reduce_function(DataType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
      return for_op<Sum>(dtype);
    case ReduceOp::kProduct:
      return for_op<Product>(dtype);
    case ReduceOp::kMin:
      return for_op<Min>(dtype);
    case ReduceOp::kMax:
      return for_op<Max>(dtype);
  }
  CTORCHRUN_CHECK(false, "unknown reduce op");
  return nullptr;
}

void divide_in_place(void* data, size_t count, DataType dtype, int divisor) {
  switch (dtype) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(data);
      const auto d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] /= d;
      return;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(data);
      const auto d = static_cast<double>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] /= d;
      return;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < count; ++i)
        p[i] = float_to_half(half_to_float(p[i]) / static_cast<float>(divisor));
      return;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < count; ++i)
        p[i] = float_to_bfloat16(bfloat16_to_float(p[i]) / static_cast<float>(divisor));
      return;
    }
    default:
      CTORCHRUN_CHECK(false, "divide_in_place on an integer type");
  }
}

}  // namespace ctorchrun::dist::detail

#pragma once

// Element-wise reductions for every data type: out[i] = a[i] op b[i].
// out may alias a or b. Half and bfloat16 are computed in float and rounded
// back (to nearest even), one element at a time, as torch's CPU kernels do.
// The average is not an element-wise operation: see divide_in_place.

#include <cstddef>

#include "collectives/types.h"

namespace ctorchrun::dist::detail {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t count);

// The function for `op` on `dtype`; kAverage maps to kSum.
ReduceFn reduce_function(DataType dtype, ReduceOp op);

// data[i] /= divisor, for a floating `dtype` (the second half of an average).
void divide_in_place(void* data, size_t count, DataType dtype, int divisor);

}  // namespace ctorchrun::dist::detail

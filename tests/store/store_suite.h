#pragma once

// One behaviour suite for every Store implementation (c10d's StoreTestCommon
// idea): the same calls and the same expectations, whatever is behind Store.

#include <functional>
#include <memory>

#include "store/store.h"

namespace ctorchrun::testing {

// Hands out clients of one store. Every client sees the same keys.
using StoreFactory = std::function<std::shared_ptr<store::Store>()>;

// Runs every behaviour check with Catch2 assertions. Keys are unique to one
// call, so a suite can run twice against the same store.
void run_store_suite(const StoreFactory& make_client);

}  // namespace ctorchrun::testing

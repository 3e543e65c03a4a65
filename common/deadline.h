#pragma once
// Deadlines on the steady clock and durations as people read them in messages.

#include <algorithm>
#include <chrono>
#include <string>

namespace ctorchrun {

// Time left until `deadline`, never negative.
inline std::chrono::milliseconds left_until(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now()));
}

// "900s" from a second up (rounded), "250ms" below.
inline std::string format_duration(std::chrono::milliseconds d) {
  const auto ms = d.count();
  return ms >= 1000 ? std::to_string((ms + 500) / 1000) + "s" : std::to_string(ms) + "ms";
}

}  // namespace ctorchrun

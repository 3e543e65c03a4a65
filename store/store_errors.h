#pragma once

// Error messages shared by the Store implementations (internal to store/).

#include <chrono>
#include <string>
#include <vector>

namespace ctorchrun::store::detail {

// "wait for keys ['/a', '/b'] on <where> timed out after 300000ms"
std::string wait_timeout_message(const std::string& where, const std::vector<std::string>& keys,
                                 std::chrono::milliseconds timeout);

// "add on key 'k': stored value 'abc' is not an integer"
std::string non_integer_message(const std::string& key, const std::string& value);

// Throws ConfigError unless keys and values have the same length.
void check_multi_set_sizes(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values);

// A key or value made printable for a message: non-printable bytes as \xNN,
// long ones cut with "...".
std::string printable(const std::string& bytes, size_t max_len = 80);

}  // namespace ctorchrun::store::detail

#include "store/store_errors.h"

#include <cstdio>

#include "common/error.h"

namespace ctorchrun::store::detail {

std::string printable(const std::string& bytes, size_t max_len) {
  std::string out;
  for (size_t i = 0; i < bytes.size() && i < max_len; ++i) {
    unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (bytes.size() > max_len) out += "...";
  return out;
}

std::string wait_timeout_message(const std::string& where, const std::vector<std::string>& keys,
                                 std::chrono::milliseconds timeout) {
  std::string list;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) {
    if (i) list += ", ";
    list += "'" + printable(keys[i]) + "'";
  }
  if (keys.size() > 8) list += ", ... (" + std::to_string(keys.size()) + " keys)";
  return "wait for keys [" + list + "] on " + where + " timed out after " +
         std::to_string(timeout.count()) + "ms";
}

std::string non_integer_message(const std::string& key, const std::string& value) {
  return "add on key '" + printable(key) + "': stored value '" + printable(value) +
         "' is not an integer";
}

void check_multi_set_sizes(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw ConfigError("multi_set: " + std::to_string(keys.size()) + " keys but " +
                      std::to_string(values.size()) + " values");
  }
}

}  // namespace ctorchrun::store::detail

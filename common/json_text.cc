#include "common/json_text.h"

#include <algorithm>
#include <utility>

namespace ctorchrun::json_text {

namespace {

// U+FDD0 in UTF-8: the record escape's lead.
constexpr std::string_view kEscape = "\xEF\xB7\x90";

bool continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// The length of the valid UTF-8 character at text[i], 0 when the bytes there
// start none (RFC 3629's table: shortest forms, no surrogates, <= U+10FFFF).
size_t char_length(std::string_view text, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const size_t left = text.size() - i;
  const unsigned char c = at(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && continuation(at(1)) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || !continuation(at(1)) || !continuation(at(2))) return 0;
    if (c == 0xE0 && at(1) < 0xA0) return 0;   // overlong
    if (c == 0xED && at(1) >= 0xA0) return 0;  // a surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || !continuation(at(1)) || !continuation(at(2)) || !continuation(at(3))) {
      return 0;
    }
    if (c == 0xF0 && at(1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && at(1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool needs_escape(std::string_view text) {
  return !is_utf8(text) || text.find(kEscape) != std::string_view::npos;
}

// A copy of `j` with `f` applied to every string and object key.
template <typename F>
nlohmann::json map_strings(const nlohmann::json& j, F&& f) {
  if (j.is_string()) return f(j.get_ref<const std::string&>());
  if (j.is_array()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& v : j) out.push_back(map_strings(v, f));
    return out;
  }
  if (j.is_object()) {
    nlohmann::json out = nlohmann::json::object();
    for (auto it = j.begin(); it != j.end(); ++it) out[f(it.key())] = map_strings(it.value(), f);
    return out;
  }
  return j;
}

}  // namespace

bool is_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t n = char_length(text, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t end = 0;
  while (end < text.size()) {
    const size_t n = std::max<size_t>(1, char_length(text, end));
    if (end + n > max_bytes) break;
    end += n;
  }
  return std::string(text.substr(0, end));
}

std::string to_valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = char_length(text, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

std::string escape_bytes(std::string_view text) {
  if (!needs_escape(text)) return std::string(text);
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    const size_t n = char_length(text, i);
    if (n == 0) {
      const auto b = static_cast<unsigned char>(text[i]);
      out += kEscape;
      out += kHex[b >> 4];
      out += kHex[b & 0xF];
      ++i;
      continue;
    }
    if (text.compare(i, n, kEscape) == 0) out += kEscape;
    out.append(text, i, n);
    i += n;
  }
  return out;
}

std::string unescape_bytes(std::string_view text) {
  if (text.find(kEscape) == std::string_view::npos) return std::string(text);
  std::string out;
  out.reserve(text.size());
  const size_t e = kEscape.size();
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, e, kEscape) != 0) {
      out += text[i++];
      continue;
    }
    if (text.compare(i + e, e, kEscape) == 0) {
      out += kEscape;
      i += 2 * e;
    } else if (i + e + 2 <= text.size() && hex_value(text[i + e]) >= 0 &&
               hex_value(text[i + e + 1]) >= 0) {
      out += static_cast<char>(hex_value(text[i + e]) * 16 + hex_value(text[i + e + 1]));
      i += e + 2;
    } else {
      out += kEscape;  // starts no escape: kept
      i += e;
    }
  }
  return out;
}

std::string dump_record(const nlohmann::json& j) {
  return map_strings(j, [](const std::string& s) { return escape_bytes(s); }).dump();
}

nlohmann::json parse_record(std::string_view text) {
  auto j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded()) return j;
  return map_strings(j, [](const std::string& s) { return unescape_bytes(s); });
}

std::string dump_for_people(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ctorchrun::json_text

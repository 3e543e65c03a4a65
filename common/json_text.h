#pragma once

// JSON text from strings that may not be UTF-8: the one way the project turns
// a nlohmann::json into text, and reads back what it wrote.
//
// JSON text must be UTF-8, and nlohmann's dump() throws type_error.316 on a
// string that is not. Much of what the launcher writes holds the user's bytes:
// a --rdzv_id (torchrun takes any bytes), a program path, a host name, a
// Python source line, a worker's error message. Those bytes never make a
// dump fail here; what becomes of them depends on who reads the text:
//
//  - Records (dump_record / parse_record): what code reads back, where
//    identity matters (store records, the events file, the worker's
//    failure records). Lossless: every string and object key is escaped,
//    parse_record(dump_record(j)) == j for any bytes, and two different
//    strings stay different. The escape, inside a string:
//      a valid UTF-8 character other than U+FDD0   itself
//      U+FDD0                                      U+FDD0 U+FDD0
//      a byte that is not part of valid UTF-8      U+FDD0 and the byte as
//                                                  two upper-case hex digits
//    U+FDD0 is a Unicode noncharacter, set aside for internal use, so text
//    that is valid UTF-8 (nearly all of it) is written unchanged and reads
//    the same to any JSON reader. "Valid" is RFC 3629: shortest forms only,
//    no surrogates, nothing above U+10FFFF.
//  - Text for people (dump_for_people, to_valid_utf8): pages, summaries,
//    logs. Each invalid byte becomes U+FFFD; nothing to decode.
//
// utf8_prefix cuts text to a byte budget on a character boundary, so that a
// cut never makes invalid UTF-8 of valid text.
//
// Pure functions; thread-safe; they never throw (beyond std::bad_alloc).

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace ctorchrun::json_text {

// True when `text` is valid UTF-8.
bool is_utf8(std::string_view text);

// The longest prefix of `text` of at most `max_bytes` bytes that does not end
// inside a valid UTF-8 character (invalid bytes count as one character each).
std::string utf8_prefix(std::string_view text, size_t max_bytes);

// `text` with each byte that is not part of valid UTF-8 replaced by U+FFFD.
std::string to_valid_utf8(std::string_view text);

// The record escape above, for one string, and its inverse. unescape_bytes
// leaves a U+FDD0 that starts no escape as it is.
std::string escape_bytes(std::string_view text);
std::string unescape_bytes(std::string_view text);

// Compact JSON text of `j`, every string and key escaped (lossless).
std::string dump_record(const nlohmann::json& j);
// Parses text written by dump_record (or any JSON: unescaped text reads as
// itself), undoing the escape; a discarded value (is_discarded()) when
// `text` is not JSON. Never throws.
nlohmann::json parse_record(std::string_view text);

// Compact JSON text of `j` for people: invalid bytes become U+FFFD.
std::string dump_for_people(const nlohmann::json& j, int indent = -1);

}  // namespace ctorchrun::json_text

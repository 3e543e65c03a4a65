#pragma once

// Internal to etcd/: total parsing of the JSON gateway's responses. Every
// function throws ProtocolError, prefixed with `context` (endpoint and path),
// when a field has the wrong type or an impossible value. Absent fields read
// as their zero value, because the gateway omits zero-valued fields.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "etcd/types.h"

namespace ctorchrun::etcd::detail {

using nlohmann::json;

// The one JSON object `body` holds (surrounding whitespace allowed).
json parse_object(const std::string& body, const std::string& context);

// A 64-bit integer field: a decimal string (as the gateway writes int64) or
// a JSON integer. Absent -> 0.
std::int64_t int_field(const json& obj, const char* name, const std::string& context);
std::uint64_t uint_field(const json& obj, const char* name, const std::string& context);
// A base64 bytes field, decoded. Absent -> "".
std::string bytes_field(const json& obj, const char* name, const std::string& context);
std::string string_field(const json& obj, const char* name, const std::string& context);
bool bool_field(const json& obj, const char* name, const std::string& context);
// nullptr when absent; throws when present and not an object / array.
const json* object_field(const json& obj, const char* name, const std::string& context);
const json* array_field(const json& obj, const char* name, const std::string& context);

KeyValue parse_key_value(const json& kv, const std::string& context);
// A RangeResponse (top level, or inside a txn's response_range).
RangeResult parse_range(const json& resp, const std::string& context);
std::int64_t header_revision(const json& resp, const std::string& context);

// The body of an HTTP error answer: {"error": ..., "message": ..., "code": N}.
// Returns false when it is not one.
bool parse_error_body(const std::string& body, int& code, std::string& message);

// Scans `buffer` for complete top-level JSON objects (the gateway's stream
// of messages), erases them from the front and returns them as text. Bytes
// between objects must be whitespace; anything else throws.
std::vector<std::string> take_objects(std::string& buffer, const std::string& context);

// The smallest key after every key that starts with `prefix` (etcd's
// range_end for a prefix); "\0" (all keys) when there is none.
std::string prefix_end(const std::string& prefix);

}  // namespace ctorchrun::etcd::detail

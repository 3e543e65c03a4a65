#include "etcd/response_internal.h"

#include <charconv>
#include <limits>

#include "common/error.h"
#include "etcd/base64.h"

namespace ctorchrun::etcd::detail {
namespace {

[[noreturn]] void fail(const std::string& context, const std::string& what) {
  throw ProtocolError(context + ": " + what);
}

}  // namespace

json parse_object(const std::string& body, const std::string& context) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(context, "response is not JSON: '" + body.substr(0, 120) + "'");
  if (!j.is_object()) fail(context, "response is not a JSON object: '" + body.substr(0, 120) + "'");
  return j;
}

std::int64_t int_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return 0;
  if (it->is_number_integer()) {
    if (it->is_number_unsigned() &&
        it->get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
      fail(context, std::string("field '") + name + "' out of range");
    return it->get<std::int64_t>();
  }
  if (!it->is_string()) fail(context, std::string("field '") + name + "' is not an integer");
  const auto& s = it->get_ref<const std::string&>();
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    fail(context, std::string("field '") + name + "' is not a 64-bit integer: '" + s + "'");
  return v;
}

std::uint64_t uint_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return 0;
  if (it->is_number_unsigned()) return it->get<std::uint64_t>();
  if (!it->is_string())
    fail(context, std::string("field '") + name + "' is not an unsigned integer");
  const auto& s = it->get_ref<const std::string&>();
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    fail(context,
         std::string("field '") + name + "' is not an unsigned 64-bit integer: '" + s + "'");
  return v;
}

std::string bytes_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return {};
  if (!it->is_string()) fail(context, std::string("field '") + name + "' is not a string");
  auto decoded = base64_decode(it->get_ref<const std::string&>());
  if (!decoded) fail(context, std::string("field '") + name + "' is not base64");
  return std::move(*decoded);
}

std::string string_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return {};
  if (!it->is_string()) fail(context, std::string("field '") + name + "' is not a string");
  return it->get<std::string>();
}

bool bool_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return false;
  if (!it->is_boolean()) fail(context, std::string("field '") + name + "' is not a boolean");
  return it->get<bool>();
}

const json* object_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  if (!it->is_object()) fail(context, std::string("field '") + name + "' is not an object");
  return &*it;
}

const json* array_field(const json& obj, const char* name, const std::string& context) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  if (!it->is_array()) fail(context, std::string("field '") + name + "' is not an array");
  return &*it;
}

KeyValue parse_key_value(const json& kv, const std::string& context) {
  if (!kv.is_object()) fail(context, "a key-value is not an object");
  KeyValue out;
  out.key = bytes_field(kv, "key", context);
  out.value = bytes_field(kv, "value", context);
  out.create_revision = int_field(kv, "create_revision", context);
  out.mod_revision = int_field(kv, "mod_revision", context);
  out.version = int_field(kv, "version", context);
  out.lease = int_field(kv, "lease", context);
  if (out.key.empty()) fail(context, "a key-value has no key");
  if (out.mod_revision <= 0) fail(context, "key-value '" + out.key + "' has no mod_revision");
  return out;
}

std::int64_t header_revision(const json& resp, const std::string& context) {
  const json* header = object_field(resp, "header", context);
  if (!header) fail(context, "response has no header");
  const auto rev = int_field(*header, "revision", context);
  if (rev < 0) fail(context, "negative revision in header");
  return rev;
}

RangeResult parse_range(const json& resp, const std::string& context) {
  RangeResult out;
  out.revision = header_revision(resp, context);
  if (const json* kvs = array_field(resp, "kvs", context)) {
    for (const auto& kv : *kvs) out.kvs.push_back(parse_key_value(kv, context));
  }
  const auto count = int_field(resp, "count", context);
  if (count < std::int64_t(out.kvs.size()))
    fail(context, "range count " + std::to_string(count) + " below the " +
                      std::to_string(out.kvs.size()) + " keys returned");
  return out;
}

bool parse_error_body(const std::string& body, int& code, std::string& message) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return false;
  const auto c = j.find("code");
  if (c == j.end() || !c->is_number_integer()) return false;
  code = c->get<int>();
  for (const char* name : {"message", "error"}) {
    const auto m = j.find(name);
    if (m != j.end() && m->is_string()) {
      message = m->get<std::string>();
      return true;
    }
  }
  message = "(no message)";
  return true;
}

std::vector<std::string> take_objects(std::string& buffer, const std::string& context) {
  std::vector<std::string> out;
  std::size_t consumed = 0;
  std::size_t i = 0;
  while (i < buffer.size()) {
    const char c = buffer[i];
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
      ++i;
      consumed = i;
      continue;
    }
    if (c != '{') fail(context, "stream holds '" + buffer.substr(i, 40) + "' between messages");
    // Find the matching '}' outside strings.
    int depth = 0;
    bool in_string = false;
    bool escaped = false;
    std::size_t j = i;
    bool complete = false;
    for (; j < buffer.size(); ++j) {
      const char d = buffer[j];
      if (in_string) {
        if (escaped) {
          escaped = false;
        } else if (d == '\\') {
          escaped = true;
        } else if (d == '"') {
          in_string = false;
        }
        continue;
      }
      if (d == '"') {
        in_string = true;
      } else if (d == '{' || d == '[') {
        ++depth;
      } else if (d == '}' || d == ']') {
        if (--depth == 0) {
          complete = true;
          break;
        }
      }
    }
    if (!complete) break;
    out.push_back(buffer.substr(i, j + 1 - i));
    i = j + 1;
    consumed = i;
  }
  buffer.erase(0, consumed);
  return out;
}

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

}  // namespace ctorchrun::etcd::detail

// JSON text from bytes that may not be UTF-8 (common/json_text.h): records
// round-trip any bytes, text for people is always valid, cuts never split a
// character.

#include "common/json_text.h"

#include <catch2/catch.hpp>
#include <string>

using namespace ctorchrun::json_text;

namespace {

// Every byte value, and the shapes of UTF-8 that are not valid.
const std::string kAllBytes = [] {
  std::string s;
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);
  return s;
}();

const std::vector<std::string> kAwkward = {
    "",
    "plain",
    "\xff",              // never in UTF-8
    "/tmp/\xff/x",       // a path that is not UTF-8
    "caf\xc3",           // a character cut short at the end
    "\xc0\xaf",          // overlong '/'
    "\xed\xa0\x80",      // a surrogate
    "\xf4\x90\x80\x80",  // above U+10FFFF
    "\xef\xb7\x90",      // U+FDD0, the escape's own lead
    "\xef\xb7\x90"
    "FF",                        // ... followed by what an escape looks like
    "\xef\xb7\x90\xef\xb7\x90",  // twice
    "\xe4\xb8\xad\xe6\x96\x87",  // valid Chinese
    kAllBytes,
};

}  // namespace

TEST_CASE("json_text: records round-trip any bytes in strings and keys", "[unit]") {
  for (const auto& s : kAwkward) {
    INFO(escape_bytes(s));
    CHECK(unescape_bytes(escape_bytes(s)) == s);
    CHECK(is_utf8(escape_bytes(s)));
    nlohmann::json j = {{"run_id", s}, {"list", {s, 1, true}}, {"nested", {{s, s}}}};
    std::string text;
    REQUIRE_NOTHROW(text = dump_record(j));
    CHECK(is_utf8(text));
    // Any JSON reader takes it.
    CHECK_FALSE(nlohmann::json::parse(text, nullptr, false).is_discarded());
    auto back = parse_record(text);
    REQUIRE(back.is_object());
    CHECK(back["run_id"].get<std::string>() == s);
    CHECK(back["list"][0].get<std::string>() == s);
    CHECK(back["nested"][s].get<std::string>() == s);
  }
}

TEST_CASE("json_text: different bytes stay different records and valid text is written as it is",
          "[unit]") {
  for (size_t a = 0; a < kAwkward.size(); ++a) {
    for (size_t b = 0; b < kAwkward.size(); ++b) {
      if (a != b) CHECK(escape_bytes(kAwkward[a]) != escape_bytes(kAwkward[b]));
    }
  }
  // Two run ids that a replacement would merge.
  CHECK(dump_record({{"run_id", "job\xfe"}}) != dump_record({{"run_id", "job\xff"}}));
  CHECK(dump_record({{"run_id", "\xe4\xb8\xad"}}) == "{\"run_id\":\"\xe4\xb8\xad\"}");
  CHECK(parse_record("not json").is_discarded());
  CHECK(parse_record("{\"a\":\"b\"}")["a"] == "b");
}

TEST_CASE("json_text: text for people is valid UTF-8 with U+FFFD for bad bytes", "[unit]") {
  CHECK(to_valid_utf8("a\xff"
                      "b") ==
        "a\xef\xbf\xbd"
        "b");
  CHECK(to_valid_utf8("\xe4\xb8\xad") == "\xe4\xb8\xad");
  for (const auto& s : kAwkward) {
    CHECK(is_utf8(to_valid_utf8(s)));
    std::string text;
    REQUIRE_NOTHROW(text = dump_for_people({{"run_id", s}}));
    CHECK(is_utf8(text));
  }
}

TEST_CASE("json_text: a cut to a byte budget ends on a character boundary", "[unit]") {
  // "中" is 3 bytes, "é" 2, the emoji 4.
  const std::string zh = "\xe4\xb8\xad";
  const std::string e = "\xc3\xa9";
  const std::string emoji = "\xf0\x9f\x98\x80";
  CHECK(utf8_prefix("abc", 80) == "abc");
  CHECK(utf8_prefix("abc", 2) == "ab");
  CHECK(utf8_prefix("a" + zh, 2) == "a");
  CHECK(utf8_prefix("a" + zh, 3) == "a");
  CHECK(utf8_prefix("a" + zh, 4) == "a" + zh);
  CHECK(utf8_prefix(e + e, 3) == e);
  CHECK(utf8_prefix("ab" + emoji, 5) == "ab");
  // Invalid bytes count one each; never more than the budget.
  CHECK(utf8_prefix("\xff\xff\xff", 2) == "\xff\xff");
  for (size_t n = 0; n <= 40; ++n) {
    std::string line;
    for (int i = 0; i < 10; ++i) line += zh + e + emoji + "x";
    const std::string cut = utf8_prefix(line, n);
    CHECK(cut.size() <= n);
    CHECK(is_utf8(cut));
    CHECK(line.compare(0, cut.size(), cut) == 0);
  }
}

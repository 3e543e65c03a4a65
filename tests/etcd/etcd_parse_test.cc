// Pure parsing: base64, endpoints, and the gateway's JSON, without a server.

#include <catch2/catch.hpp>
#include <string>

#include "common/error.h"
#include "etcd/base64.h"
#include "etcd/http_internal.h"
#include "etcd/response_internal.h"

namespace ctorchrun::etcd {
namespace {

using detail::json;

TEST_CASE("etcd base64: every byte value and length round-trips", "[unit]") {
  std::string all;
  for (int i = 0; i < 256; ++i) all += char(i);
  for (std::size_t len = 0; len <= all.size(); ++len) {
    const std::string s = all.substr(256 - len);
    const auto decoded = base64_decode(base64_encode(s));
    REQUIRE(decoded);
    REQUIRE(*decoded == s);
  }
  CHECK(base64_encode("") == "");
  CHECK(base64_encode("a") == "YQ==");
  CHECK(base64_encode("ab") == "YWI=");
  CHECK(base64_encode("abc") == "YWJj");
  CHECK(base64_encode("\xff\xfe") == "//4=");
}

TEST_CASE("etcd base64: decode rejects everything but canonical encodings", "[unit]") {
  for (const char* bad : {"Y", "YQ", "YQ=", "YQ===", "Y===", "====", "YQ==YQ==", "Y Q==", "YQ=a",
                          "YR==", "YWJ=", "YW\n=", "-_=="}) {
    INFO(bad);
    CHECK_FALSE(base64_decode(bad));
  }
  CHECK_FALSE(base64_decode(std::string("YW\0j", 4)));
  CHECK(base64_decode("") == std::string());
}

TEST_CASE("etcd endpoints: host:port and bracketed IPv6 parse and others throw ConfigError",
          "[unit]") {
  auto a = detail::parse_endpoint("127.0.0.1:2379");
  CHECK(a.host == "127.0.0.1");
  CHECK(a.port == 2379);
  auto b = detail::parse_endpoint("[::1]:23790");
  CHECK(b.host == "::1");
  CHECK(b.port == 23790);
  CHECK(detail::parse_endpoint("localhost:1").host == "localhost");
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:", ":2379", "::1:2379", "[::1]2379",
                          "[::1]:", "h:0", "h:65536", "h:12a", "h:-1", "[::1:2379"}) {
    INFO(bad);
    CHECK_THROWS_AS(detail::parse_endpoint(bad), ConfigError);
  }
}

TEST_CASE("etcd responses: int64 strings and omitted zero fields parse", "[unit]") {
  const json resp = json::parse(R"({"header":{"cluster_id":"1","member_id":"2","revision":"7"},
      "kvs":[{"key":"YQ==","create_revision":"2","mod_revision":"7","version":"3","value":"MQ=="},
             {"key":"Yg==","mod_revision":"5"}],"count":"2"})");
  const RangeResult r = detail::parse_range(resp, "ctx");
  CHECK(r.revision == 7);
  REQUIRE(r.kvs.size() == 2);
  CHECK(r.kvs[0].key == "a");
  CHECK(r.kvs[0].value == "1");
  CHECK(r.kvs[0].create_revision == 2);
  CHECK(r.kvs[0].version == 3);
  CHECK(r.kvs[1].value.empty());  // an empty value is omitted
  CHECK(r.kvs[1].lease == 0);
  const json empty = json::parse(R"({"header":{"revision":"3"}})");
  CHECK(detail::parse_range(empty, "ctx").kvs.empty());
  CHECK(detail::bool_field(empty, "succeeded", "ctx") == false);
  CHECK(detail::uint_field(json::parse(R"({"m":"18446744073709551615"})"), "m", "ctx") ==
        18446744073709551615ull);
}

TEST_CASE(
    "etcd responses: wrong types and impossible values throw ProtocolError naming the context",
    "[unit]") {
  const char* bad[] = {
      R"({"kvs":[]})",                                      // no header
      R"({"header":{"revision":"x7"}})",                    // not a number
      R"({"header":{"revision":"99999999999999999999"}})",  // overflow
      R"({"header":{"revision":true}})",                    // wrong type
      R"({"header":{"revision":"7"},"kvs":{}})",            // kvs not an array
      R"({"header":{"revision":"7"},"kvs":[{"key":"YQ","mod_revision":"1"}],"count":"1"})",
      R"({"header":{"revision":"7"},"kvs":[{"key":"YQ==","mod_revision":"1","value":5}],"count":"1"})",
      R"({"header":{"revision":"7"},"kvs":[{"mod_revision":"1"}],"count":"1"})",  // no key
      R"({"header":{"revision":"7"},"kvs":[{"key":"YQ=="}],"count":"1"})",        // no mod_revision
      R"({"header":{"revision":"7"},"kvs":[{"key":"YQ==","mod_revision":"1"}]})",  // count 0 < 1
      R"({"header":{"revision":"7"},"kvs":[7],"count":"1"})",
  };
  for (const char* text : bad) {
    INFO(text);
    const json j = json::parse(text);
    try {
      detail::parse_range(j, "etcd 127.0.0.1:1 /v3/kv/range");
      FAIL("no throw");
    } catch (const ProtocolError& e) {
      CHECK(std::string(e.what()).find("127.0.0.1:1 /v3/kv/range") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(detail::parse_object("not json", "ctx"), ProtocolError);
  CHECK_THROWS_AS(detail::parse_object("[1,2]", "ctx"), ProtocolError);
  CHECK_THROWS_AS(detail::parse_object("{\"a\":1} {\"b\":2}", "ctx"), ProtocolError);
}

TEST_CASE("etcd error bodies: code and message are read and other bodies are not errors",
          "[unit]") {
  int code = 0;
  std::string msg;
  REQUIRE(detail::parse_error_body(
      R"({"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5})",
      code, msg));
  CHECK(code == 5);
  CHECK(msg == "etcdserver: requested lease not found");
  CHECK_FALSE(detail::parse_error_body("Not Found\n", code, msg));
  CHECK_FALSE(detail::parse_error_body(R"({"code":"5"})", code, msg));
}

TEST_CASE("etcd stream: whole objects are taken, a partial one kept, junk rejected", "[unit]") {
  std::string buf = "{\"result\":{\"a\":\"}{\\\"\"}}\n{\"result\":[1,{\"b\":2}]}\n{\"res";
  auto objs = detail::take_objects(buf, "ctx");
  REQUIRE(objs.size() == 2);
  CHECK(json::parse(objs[0])["result"]["a"] == "}{\"");
  CHECK(json::parse(objs[1])["result"][1]["b"] == 2);
  CHECK(buf == "{\"res");
  buf += "ult\":{}}";
  objs = detail::take_objects(buf, "ctx");
  REQUIRE(objs.size() == 1);
  CHECK(buf.empty());
  std::string junk = "  <html>";
  CHECK_THROWS_AS(detail::take_objects(junk, "ctx"), ProtocolError);
}

TEST_CASE("etcd prefix_end: next key after the prefix, all keys when there is none", "[unit]") {
  CHECK(detail::prefix_end("abc") == "abd");
  CHECK(detail::prefix_end("a\xff") == "b");
  CHECK(detail::prefix_end(std::string("\xff\xff")) == std::string(1, '\0'));
  CHECK(detail::prefix_end("") == std::string(1, '\0'));
}

}  // namespace
}  // namespace ctorchrun::etcd

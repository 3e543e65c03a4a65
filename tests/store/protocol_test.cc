// Unit tests of the request parser: every op in both dialects, requests split
// at every byte, several requests in one buffer, every limit.

#include "store/protocol.h"

#include <catch2/catch.hpp>
#include <limits>

using namespace ctorchrun::store::protocol;

namespace {

std::string op_byte(Dialect d, Op op) {
  std::string s;
  put_u8(&s, *encode_opcode(d, op));
  return s;
}

std::string bytes(std::string_view b) {
  std::string s;
  put_bytes(&s, b);
  return s;
}

std::string u64(uint64_t v) {
  std::string s;
  put_u64(&s, v);
  return s;
}

std::string u32(uint32_t v) {
  std::string s;
  put_u32(&s, v);
  return s;
}

struct Case {
  Op op;
  std::string body;  // after the opcode
};

// One well-formed request of every op a dialect has.
std::vector<Case> all_requests(Dialect d) {
  std::vector<Case> cases = {
      {Op::kSet, bytes("/k1") + bytes("v1")},
      {Op::kCompareSet, bytes("/k") + bytes("old") + bytes("new")},
      {Op::kGet, bytes("/k")},
      {Op::kAdd, bytes("init/") + u64(static_cast<uint64_t>(-5))},
      {Op::kCheck, u64(2) + bytes("/a") + bytes("/b")},
      {Op::kWait, u64(1) + bytes("/a")},
      {Op::kGetNumKeys, ""},
      {Op::kDeleteKey, bytes("/k")},
  };
  if (d == Dialect::kV113) {
    cases.push_back({Op::kWatchKey, bytes("/w")});
  } else {
    cases.push_back({Op::kValidate, u32(kValidationMagic)});
    cases.push_back({Op::kAppend, bytes("/k") + bytes("tail")});
    cases.push_back({Op::kMultiGet, u64(3) + bytes("/a") + bytes("") + bytes("/c")});
    cases.push_back({Op::kMultiSet, u64(2) + bytes("/a") + bytes("1") + bytes("/b") + bytes("")});
    cases.push_back({Op::kCancelWait, ""});
    cases.push_back({Op::kPing, u32(12345)});
    cases.push_back({Op::kQueuePush, bytes("/q") + bytes("item")});
    cases.push_back({Op::kQueuePop, bytes("/q")});
    cases.push_back({Op::kQueueLen, bytes("/q")});
    cases.push_back({Op::kList, ""});
  }
  return cases;
}

}  // namespace

TEST_CASE("protocol: opcode tables match torch's numbering in both dialects", "[unit]") {
  CHECK(*encode_opcode(Dialect::kV113, Op::kSet) == 0);
  CHECK(*encode_opcode(Dialect::kV113, Op::kWait) == 5);
  CHECK(*encode_opcode(Dialect::kV113, Op::kWatchKey) == 7);
  CHECK(*encode_opcode(Dialect::kV113, Op::kDeleteKey) == 8);
  CHECK_FALSE(encode_opcode(Dialect::kV113, Op::kPing));
  CHECK(*encode_opcode(Dialect::kV2, Op::kValidate) == 0);
  CHECK(*encode_opcode(Dialect::kV2, Op::kSet) == 1);
  CHECK(*encode_opcode(Dialect::kV2, Op::kGetNumKeys) == 7);
  CHECK(*encode_opcode(Dialect::kV2, Op::kDeleteKey) == 8);
  CHECK(*encode_opcode(Dialect::kV2, Op::kCancelWait) == 12);
  CHECK(*encode_opcode(Dialect::kV2, Op::kPing) == 13);
  CHECK(*encode_opcode(Dialect::kV2, Op::kList) == 17);
  CHECK_FALSE(encode_opcode(Dialect::kV2, Op::kWatchKey));
  CHECK_FALSE(decode_opcode(Dialect::kV113, 9));
  CHECK_FALSE(decode_opcode(Dialect::kV2, 18));
}

TEST_CASE("protocol: every op parses whole, and split at every byte boundary", "[unit]") {
  Limits limits;
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    for (const Case& c : all_requests(d)) {
      INFO("dialect " << to_string(d) << " op " << to_string(c.op));
      std::string wire = op_byte(d, c.op) + c.body;
      Request req;
      Dialect dd = d;
      ParseResult r = parse_request(&dd, wire.data(), wire.size(), limits, &req);
      REQUIRE(r.status == ParseStatus::kComplete);
      CHECK(r.size == wire.size());
      CHECK(req.op == c.op);
      for (size_t k = 0; k < wire.size(); ++k) {
        Dialect dk = d;
        ParseResult part = parse_request(&dk, wire.data(), k, limits, &req);
        INFO("prefix of " << k << " bytes");
        REQUIRE(part.status == ParseStatus::kNeedMore);
        CHECK(part.size > k);
        CHECK(part.size <= wire.size());
      }
    }
  }
}

TEST_CASE("protocol: fields are decoded with their values", "[unit]") {
  Limits limits;
  Request req;
  Dialect d = Dialect::kV2;
  std::string wire = op_byte(d, Op::kCompareSet) + bytes("/k") + bytes("") + bytes("new");
  REQUIRE(parse_request(&d, wire.data(), wire.size(), limits, &req).status ==
          ParseStatus::kComplete);
  CHECK(req.key == "/k");
  CHECK(req.value.empty());
  CHECK(req.value2 == "new");

  wire = op_byte(d, Op::kAdd) + bytes("c") + u64(static_cast<uint64_t>(int64_t{-7}));
  REQUIRE(parse_request(&d, wire.data(), wire.size(), limits, &req).status ==
          ParseStatus::kComplete);
  CHECK(req.delta == -7);

  wire = op_byte(d, Op::kMultiSet) + u64(2) + bytes("/a") + bytes("1") + bytes("/b") + bytes("2");
  REQUIRE(parse_request(&d, wire.data(), wire.size(), limits, &req).status ==
          ParseStatus::kComplete);
  REQUIRE(req.keys.size() == 2);
  CHECK(req.keys[1] == "/b");
  CHECK(req.values[1] == "2");

  wire = op_byte(d, Op::kPing) + u32(0xDEADBEEF);
  REQUIRE(parse_request(&d, wire.data(), wire.size(), limits, &req).status ==
          ParseStatus::kComplete);
  CHECK(req.u32 == 0xDEADBEEF);

  // Binary key and value bytes survive.
  std::string bin("\0\xff/x\n", 5);
  wire = op_byte(d, Op::kSet) + bytes(bin) + bytes(bin);
  REQUIRE(parse_request(&d, wire.data(), wire.size(), limits, &req).status ==
          ParseStatus::kComplete);
  CHECK(req.key == bin);
  CHECK(req.value == bin);
}

TEST_CASE("protocol: several requests in one buffer parse one after another", "[unit]") {
  Limits limits;
  Dialect d = Dialect::kV113;
  std::string wire = op_byte(d, Op::kSet) + bytes("/a") + bytes("1") + op_byte(d, Op::kGetNumKeys) +
                     op_byte(d, Op::kGet) + bytes("/a");
  Request req;
  size_t off = 0;
  std::vector<Op> ops;
  while (off < wire.size()) {
    ParseResult r = parse_request(&d, wire.data() + off, wire.size() - off, limits, &req);
    REQUIRE(r.status == ParseStatus::kComplete);
    ops.push_back(req.op);
    off += r.size;
  }
  CHECK(ops == std::vector<Op>{Op::kSet, Op::kGetNumKeys, Op::kGet});
}

TEST_CASE("protocol: the dialect is decided from a connection's first bytes", "[unit]") {
  Limits limits;
  Request req;
  SECTION("a first byte other than 0 is v113 at once (1-byte GETNUMKEYS)") {
    Dialect d = Dialect::kUnknown;
    std::string wire("\x06", 1);
    auto r = parse_request(&d, wire.data(), wire.size(), limits, &req);
    CHECK(d == Dialect::kV113);
    CHECK(r.status == ParseStatus::kComplete);
    CHECK(req.op == Op::kGetNumKeys);
  }
  SECTION("0 followed by the magic is v2 VALIDATE, even when split") {
    std::string wire = std::string(1, '\0') + u32(kValidationMagic);
    Dialect d = Dialect::kUnknown;
    auto r = parse_request(&d, wire.data(), 1, limits, &req);
    CHECK(d == Dialect::kUnknown);
    CHECK(r.status == ParseStatus::kNeedMore);
    CHECK(r.size == 5);
    r = parse_request(&d, wire.data(), wire.size(), limits, &req);
    CHECK(d == Dialect::kV2);
    CHECK(req.op == Op::kValidate);
  }
  SECTION("0 followed by anything else is a v113 SET") {
    std::string wire = std::string(1, '\0') + bytes("/k") + bytes("v");
    Dialect d = Dialect::kUnknown;
    auto r = parse_request(&d, wire.data(), wire.size(), limits, &req);
    CHECK(d == Dialect::kV113);
    REQUIRE(r.status == ParseStatus::kComplete);
    CHECK(req.op == Op::kSet);
    CHECK(req.key == "/k");
  }
  SECTION("nothing at all stays undecided") {
    Dialect d = Dialect::kUnknown;
    auto r = parse_request(&d, nullptr, 0, limits, &req);
    CHECK(d == Dialect::kUnknown);
    CHECK(r.status == ParseStatus::kNeedMore);
  }
}

TEST_CASE("protocol: lengths over the limits are errors as soon as the prefix arrives", "[unit]") {
  Limits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 32;
  limits.max_keys_per_op = 4;
  Request req;
  auto parse = [&](Dialect d, const std::string& wire) {
    return parse_request(&d, wire.data(), wire.size(), limits, &req);
  };
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    INFO("dialect " << to_string(d));
    // Exactly at the limit is fine.
    CHECK(parse(d, op_byte(d, Op::kSet) + bytes(std::string(16, 'k')) + bytes(std::string(32, 'v')))
              .status == ParseStatus::kComplete);
    // One over: error with only the length prefix in the buffer.
    CHECK(parse(d, op_byte(d, Op::kGet) + u64(17)).status == ParseStatus::kError);
    CHECK(parse(d, op_byte(d, Op::kSet) + bytes("k") + u64(33)).status == ParseStatus::kError);
    CHECK(parse(d, op_byte(d, Op::kWait) + u64(5)).status == ParseStatus::kError);
    CHECK(parse(d, op_byte(d, Op::kCheck) + u64(4) + bytes("a") + u64(17)).status ==
          ParseStatus::kError);
  }
  CHECK(parse(Dialect::kV2, op_byte(Dialect::kV2, Op::kMultiSet) + u64(5)).status ==
        ParseStatus::kError);
  // A negative MULTI_SET count is a huge count, not a loop of -1 items.
  CHECK(parse(Dialect::kV2,
              op_byte(Dialect::kV2, Op::kMultiSet) + u64(static_cast<uint64_t>(int64_t{-1})))
            .status == ParseStatus::kError);
}

TEST_CASE("protocol: 2^62 and 2^31 length prefixes are refused for every opcode with a length",
          "[unit]") {
  Limits limits;  // defaults
  Request req;
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    for (uint64_t huge : {uint64_t{1} << 62, uint64_t{1} << 31, ~uint64_t{0}}) {
      for (int code = 0; code < 256; ++code) {
        auto op = decode_opcode(d, static_cast<uint8_t>(code));
        if (!op) continue;
        if (*op == Op::kGetNumKeys || *op == Op::kCancelWait || *op == Op::kList ||
            *op == Op::kValidate || *op == Op::kPing || *op == Op::kBindKeys) {
          continue;  // no length field
        }
        INFO("dialect " << to_string(d) << " op " << to_string(*op) << " length " << huge);
        std::string wire = std::string(1, static_cast<char>(code)) + u64(huge);
        Dialect dd = d;
        auto r = parse_request(&dd, wire.data(), wire.size(), limits, &req);
        CHECK(r.status == ParseStatus::kError);
        // And in a value position, after a valid key.
        if (*op == Op::kSet || *op == Op::kCompareSet || *op == Op::kAppend ||
            *op == Op::kQueuePush) {
          wire = std::string(1, static_cast<char>(code)) + bytes("/k") + u64(huge);
          dd = d;
          CHECK(parse_request(&dd, wire.data(), wire.size(), limits, &req).status ==
                ParseStatus::kError);
        }
      }
    }
  }
}

TEST_CASE("protocol: unknown opcodes are errors", "[unit]") {
  Limits limits;
  Request req;
  for (uint8_t code : {9, 12, 13, 17, 200}) {
    Dialect d = Dialect::kV113;
    std::string wire(1, static_cast<char>(code));
    CHECK(parse_request(&d, wire.data(), wire.size(), limits, &req).status == ParseStatus::kError);
  }
  Dialect d = Dialect::kV2;
  std::string wire(1, static_cast<char>(18));
  CHECK(parse_request(&d, wire.data(), wire.size(), limits, &req).status == ParseStatus::kError);
}

TEST_CASE("protocol: the fast path and the full parser agree at every limit and key count",
          "[unit]") {
  // parse_common_request takes whole requests within the limits and leaves
  // the rest to parse_request; at each boundary both must give one answer.
  Limits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 32;
  limits.max_keys_per_op = 12;
  for (Dialect d : {Dialect::kV113, Dialect::kV2}) {
    INFO("dialect " << to_string(d));
    limits.max_request_bytes = 64;
    auto parse = [&](const std::string& wire, Request* req) {
      Dialect dd = d;
      return parse_request(&dd, wire.data(), wire.size(), limits, req);
    };
    Request req;
    // Key and value exactly at their limits: 1 + 8 + 16 + 8 + 32 = 65 bytes,
    // one over the request limit, so the request limit refuses it.
    CHECK(parse(op_byte(d, Op::kSet) + bytes(std::string(16, 'k')) + bytes(std::string(32, 'v')),
                &req)
              .status == ParseStatus::kError);
    // One byte less is within every limit.
    const std::string set =
        op_byte(d, Op::kSet) + bytes(std::string(16, 'k')) + bytes(std::string(31, 'v'));
    auto ok = parse(set, &req);
    CHECK(ok.status == ParseStatus::kComplete);
    CHECK(ok.size == 64);
    CHECK(req.key == std::string(16, 'k'));
    CHECK(req.value == std::string(31, 'v'));
    // The fast path alone refuses what the full parser reports.
    size_t used = 0;
    const std::string over = op_byte(d, Op::kGet) + bytes(std::string(17, 'k'));
    CHECK_FALSE(parse_common_request(d, over.data(), over.size(), limits, &req, &used));
    CHECK(parse(over, &req).status == ParseStatus::kError);
    // CHECK of 1 to 12 keys: the fast path takes a few, the Reader the rest;
    // both fill `keys` alike, and every strict prefix needs more.
    limits.max_request_bytes = 0;
    for (uint64_t n = 1; n <= 12; ++n) {
      INFO(n << " keys");
      std::string wire = op_byte(d, Op::kCheck) + u64(n);
      for (uint64_t i = 0; i < n; ++i) wire += bytes(std::to_string(i));
      Request r;
      auto whole = parse(wire, &r);
      REQUIRE(whole.status == ParseStatus::kComplete);
      CHECK(whole.size == wire.size());
      REQUIRE(r.keys.size() == n);
      for (uint64_t i = 0; i < n; ++i) CHECK(r.keys[i] == std::to_string(i));
      Request partial;
      for (size_t cut = 1; cut < wire.size(); ++cut) {
        CHECK(parse(wire.substr(0, cut), &partial).status == ParseStatus::kNeedMore);
      }
      CHECK(parse(wire, &partial).status == ParseStatus::kComplete);
      CHECK(partial.keys == r.keys);
    }
    // Thirteen keys: over max_keys_per_op on either path.
    CHECK(parse(op_byte(d, Op::kWait) + u64(13), &req).status == ParseStatus::kError);
  }
}

TEST_CASE("protocol: ADD parses stored values like C's stoll", "[unit]") {
  // Plain digits (the fast path) up to 18 of them, and past it.
  CHECK(parse_int64_like_stoll("0") == 0);
  CHECK(parse_int64_like_stoll("007") == 7);
  CHECK(parse_int64_like_stoll("999999999999999999") == 999999999999999999);
  CHECK(parse_int64_like_stoll("1000000000000000000") == 1000000000000000000);
  CHECK(parse_int64_like_stoll("12abc") == 12);
  CHECK(parse_int64_like_stoll(" 7") == 7);
  CHECK(parse_int64_like_stoll("\t\n-3") == -3);
  CHECK(parse_int64_like_stoll("+4") == 4);
  CHECK(parse_int64_like_stoll("0x10") == 0);
  CHECK(parse_int64_like_stoll("9223372036854775807") == std::numeric_limits<int64_t>::max());
  CHECK(parse_int64_like_stoll("-9223372036854775808") == std::numeric_limits<int64_t>::min());
  CHECK_FALSE(parse_int64_like_stoll("9223372036854775808"));
  CHECK_FALSE(parse_int64_like_stoll("99999999999999999999"));
  CHECK_FALSE(parse_int64_like_stoll("abc"));
  CHECK_FALSE(parse_int64_like_stoll(""));
  CHECK_FALSE(parse_int64_like_stoll("-"));
  CHECK_FALSE(parse_int64_like_stoll(" + 1"));
}

TEST_CASE("protocol: integers are little-endian on the wire", "[unit]") {
  std::string s;
  put_u64(&s, 0x0102030405060708ULL);
  CHECK(s == std::string("\x08\x07\x06\x05\x04\x03\x02\x01", 8));
  CHECK(read_u64(s.data()) == 0x0102030405060708ULL);
  s.clear();
  put_u32(&s, kValidationMagic);
  CHECK(s == std::string("\xce\xf7\x85\x3c", 4));
  // The spec's example: add("init/", 1) in v113.
  std::string wire = op_byte(Dialect::kV113, Op::kAdd) + bytes("init/") + u64(1);
  CHECK(wire == std::string("\x03\x05\0\0\0\0\0\0\0init/\x01\0\0\0\0\0\0\0", 22));
}

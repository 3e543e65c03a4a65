#include "store/protocol.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace ctorchrun::store::protocol {

const char* to_string(Dialect d) {
  switch (d) {
    case Dialect::kUnknown:
      return "unknown";
    case Dialect::kV113:
      return "v113";
    case Dialect::kV2:
      return "v2";
  }
  return "?";
}

const char* to_string(Op op) {
  switch (op) {
    case Op::kValidate:
      return "VALIDATE";
    case Op::kSet:
      return "SET";
    case Op::kCompareSet:
      return "COMPARE_SET";
    case Op::kGet:
      return "GET";
    case Op::kAdd:
      return "ADD";
    case Op::kCheck:
      return "CHECK";
    case Op::kWait:
      return "WAIT";
    case Op::kGetNumKeys:
      return "GETNUMKEYS";
    case Op::kWatchKey:
      return "WATCH_KEY";
    case Op::kDeleteKey:
      return "DELETE_KEY";
    case Op::kAppend:
      return "APPEND";
    case Op::kMultiGet:
      return "MULTI_GET";
    case Op::kMultiSet:
      return "MULTI_SET";
    case Op::kCancelWait:
      return "CANCEL_WAIT";
    case Op::kPing:
      return "PING";
    case Op::kQueuePush:
      return "QUEUE_PUSH";
    case Op::kQueuePop:
      return "QUEUE_POP";
    case Op::kQueueLen:
      return "QUEUE_LEN";
    case Op::kList:
      return "LIST";
    case Op::kBindKeys:
      return "BIND_KEYS";
  }
  return "?";
}

namespace {

// Opcode tables, indexed by the opcode byte.
constexpr Op kV113Ops[] = {Op::kSet,  Op::kCompareSet, Op::kGet,      Op::kAdd,      Op::kCheck,
                           Op::kWait, Op::kGetNumKeys, Op::kWatchKey, Op::kDeleteKey};
constexpr Op kV2Ops[] = {
    Op::kValidate,   Op::kSet,        Op::kCompareSet, Op::kGet,      Op::kAdd,      Op::kCheck,
    Op::kWait,       Op::kGetNumKeys, Op::kDeleteKey,  Op::kAppend,   Op::kMultiGet, Op::kMultiSet,
    Op::kCancelWait, Op::kPing,       Op::kQueuePush,  Op::kQueuePop, Op::kQueueLen, Op::kList};

template <size_t N>
std::optional<uint8_t> index_of(const Op (&table)[N], Op op) {
  for (size_t i = 0; i < N; ++i) {
    if (table[i] == op) return static_cast<uint8_t>(i);
  }
  return std::nullopt;
}

// Reads fields from a buffer without ever passing its end. Each reader returns
// false when the field is not (fully) in the buffer yet and records in need_
// how many bytes the buffer must hold for it.
class Reader {
 public:
  Reader(const char* data, size_t size, const Limits& limits)
      : data_(data), size_(size), limits_(limits), request_limit_(request_limit(limits)) {}

  bool u8(uint8_t* v) {
    if (!have(1)) return false;
    *v = static_cast<uint8_t>(data_[pos_]);
    pos_ += 1;
    return true;
  }
  bool u32(uint32_t* v) {
    if (!have(4)) return false;
    *v = read_u32(data_ + pos_);
    pos_ += 4;
    return true;
  }
  bool u64(uint64_t* v) {
    if (!have(8)) return false;
    *v = read_u64(data_ + pos_);
    pos_ += 8;
    return true;
  }
  // A length-prefixed string of at most `limit` bytes. Over the limit sets
  // error_ and returns false.
  bool blob(std::string_view* v, size_t limit, const char* what, bool is_key) {
    uint64_t n = 0;
    size_t start = pos_;
    if (!u64(&n)) return false;
    if (n > limit) {
      error_ = what;
      limit_ = limit;
      length_ = n;
      if (is_key) last_key_ = std::string_view(data_ + pos_, std::min<size_t>(size_ - pos_, 128));
      return false;
    }
    if (pos_ > request_limit_ || n > request_limit_ - pos_) {
      error_ = "request larger than the request size limit";
      limit_ = request_limit_;
      length_ = pos_ + n;
      if (is_key) last_key_ = std::string_view(data_ + pos_, std::min<size_t>(size_ - pos_, 128));
      return false;
    }
    if (!have(static_cast<size_t>(n))) {
      pos_ = start;  // re-read the length next time
      return false;
    }
    *v = std::string_view(data_ + pos_, static_cast<size_t>(n));
    if (is_key) last_key_ = *v;
    pos_ += static_cast<size_t>(n);
    return true;
  }
  bool key(std::string_view* v) {
    return blob(v, limits_.max_key_bytes, "key longer than the key size limit", true);
  }
  bool value(std::string_view* v) {
    return blob(v, limits_.max_value_bytes, "value longer than the value size limit", false);
  }
  bool count(uint64_t* n) {
    if (!u64(n)) return false;
    if (*n > limits_.max_keys_per_op) {
      error_ = "more keys in one request than the keys-per-request limit";
      limit_ = limits_.max_keys_per_op;
      length_ = *n;
      return false;
    }
    return true;
  }
  void seek(size_t pos) { pos_ = pos; }

  size_t pos() const { return pos_; }
  size_t need() const { return need_; }
  const char* error() const { return error_; }
  size_t limit() const { return limit_; }
  uint64_t length() const { return length_; }
  std::string_view last_key() const { return last_key_; }

 private:
  bool have(size_t n) {
    if (size_ - pos_ >= n) return true;
    need_ = pos_ + n;
    return false;
  }

  const char* data_;
  size_t size_;
  const Limits& limits_;
  size_t request_limit_;
  size_t pos_ = 0;
  size_t need_ = 0;
  const char* error_ = nullptr;
  size_t limit_ = 0;
  uint64_t length_ = 0;
  std::string_view last_key_;
};

// Decides the dialect of a connection from its first bytes; false if more
// bytes are needed (`*need` then says how many).
bool detect_dialect(const char* data, size_t size, Dialect* dialect, size_t* need) {
  if (size < 1) {
    *need = 1;
    return false;
  }
  // A v113 client may send a one-byte request (GETNUMKEYS) and wait: decide at once.
  if (data[0] != 0) {
    *dialect = Dialect::kV113;
    return true;
  }
  // Both a v2 VALIDATE and a v113 SET carry at least four more bytes.
  if (size < 5) {
    *need = 5;
    return false;
  }
  *dialect = read_u32(data + 1) == kValidationMagic ? Dialect::kV2 : Dialect::kV113;
  return true;
}

// request_limit()'s least value when max_request_bytes is 0.
constexpr size_t kRequestLimitFloor = (64u << 20) + (1u << 20);

}  // namespace

size_t request_limit(const Limits& limits) {
  if (limits.max_request_bytes > 0) return limits.max_request_bytes;
  constexpr size_t kFloor = kRequestLimitFloor;
  size_t twice = limits.max_value_bytes > SIZE_MAX / 2 ? SIZE_MAX : 2 * limits.max_value_bytes;
  return std::max(twice, kFloor);
}

bool parse_common_request(Dialect dialect, const char* data, size_t size, const Limits& limits,
                          Request* out, size_t* used) {
  if (size < 9) return false;
  const auto code = static_cast<uint8_t>(data[0]);
  Op op;
  if (dialect == Dialect::kV113) {
    if (code >= std::size(kV113Ops)) return false;
    op = kV113Ops[code];
  } else {
    if (code >= std::size(kV2Ops)) return false;
    op = kV2Ops[code];
  }
  const size_t cap = limits.max_request_bytes > 0 ? limits.max_request_bytes : kRequestLimitFloor;
  if (op == Op::kCheck || op == Op::kWait || op == Op::kMultiGet || op == Op::kMultiSet) {
    // A few keys only: a long request that arrives in pieces must keep the
    // Reader's resumption (each piece parsed once), not be rescanned here.
    constexpr uint64_t kMaxSimpleKeys = 8;
    const uint64_t n = read_u64(data + 1);
    if (n > kMaxSimpleKeys || n > limits.max_keys_per_op) return false;
    const bool with_values = op == Op::kMultiSet;
    out->keys.clear();
    out->values.clear();
    size_t pos = 9;
    for (uint64_t i = 0; i < n; ++i) {
      for (int field = 0; field < (with_values ? 2 : 1); ++field) {
        if (size - pos < 8) return false;
        const uint64_t len = read_u64(data + pos);
        pos += 8;
        if (len > (field == 0 ? limits.max_key_bytes : limits.max_value_bytes) ||
            len > size - pos) {
          return false;
        }
        (field == 0 ? out->keys : out->values).emplace_back(data + pos, static_cast<size_t>(len));
        pos += static_cast<size_t>(len);
      }
    }
    if (pos > cap) return false;
    out->op = op;
    *used = pos;
    return true;
  }
  const uint64_t key_size = read_u64(data + 1);
  if (key_size > limits.max_key_bytes || key_size > size - 9) return false;
  size_t pos = 9 + static_cast<size_t>(key_size);
  switch (op) {
    case Op::kGet:
    case Op::kWatchKey:
    case Op::kDeleteKey:
    case Op::kQueuePop:
    case Op::kQueueLen:
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush: {
      if (size - pos < 8) return false;
      const uint64_t value_size = read_u64(data + pos);
      pos += 8;
      if (value_size > limits.max_value_bytes || value_size > size - pos) return false;
      out->value = std::string_view(data + pos, static_cast<size_t>(value_size));
      pos += static_cast<size_t>(value_size);
      break;
    }
    case Op::kAdd:
      if (size - pos < 8) return false;
      out->delta = static_cast<int64_t>(read_u64(data + pos));
      pos += 8;
      break;
    default:
      return false;
  }
  if (pos > cap) return false;
  out->op = op;
  out->key = std::string_view(data + 9, static_cast<size_t>(key_size));
  out->keys.clear();
  out->values.clear();
  *used = pos;
  return true;
}

std::optional<Op> decode_opcode(Dialect dialect, uint8_t code) {
  if (dialect == Dialect::kV113) {
    if (code < std::size(kV113Ops)) return kV113Ops[code];
    return std::nullopt;
  }
  if (dialect == Dialect::kV2) {
    if (code < std::size(kV2Ops)) return kV2Ops[code];
    if (code == kBindKeysOpcode) return Op::kBindKeys;
    return std::nullopt;
  }
  return std::nullopt;
}

std::optional<uint8_t> encode_opcode(Dialect dialect, Op op) {
  if (dialect == Dialect::kV113) return index_of(kV113Ops, op);
  if (dialect == Dialect::kV2 && op == Op::kBindKeys) return kBindKeysOpcode;
  if (dialect == Dialect::kV2) return index_of(kV2Ops, op);
  return std::nullopt;
}

ParseResult parse_request(Dialect* dialect, const char* data, size_t size, const Limits& limits,
                          Request* out) {
  ParseResult result;
  if (*dialect == Dialect::kUnknown) {
    size_t need = 0;
    if (!detect_dialect(data, size, dialect, &need)) {
      result.size = need;
      return result;
    }
  }

  if (out->resume_pos == 0 &&
      parse_common_request(*dialect, data, size, limits, out, &result.size)) {
    result.status = ParseStatus::kComplete;
    return result;
  }

  Reader r(data, size, limits);
  out->keys.clear();
  out->values.clear();
  const bool resuming = out->resume_pos > 0;

  uint8_t code = 0;
  bool ok = resuming || r.u8(&code);
  if (ok) {
    if (!resuming) {
      std::optional<Op> op = decode_opcode(*dialect, code);
      if (!op) {
        result.status = ParseStatus::kError;
        result.error = "unknown opcode";
        return result;
      }
      out->op = *op;
    }
    switch (out->op) {
      case Op::kValidate:
      case Op::kPing:
      case Op::kBindKeys:
        ok = r.u32(&out->u32);
        break;
      case Op::kSet:
      case Op::kAppend:
      case Op::kQueuePush:
        ok = r.key(&out->key) && r.value(&out->value);
        break;
      case Op::kCompareSet:
        ok = r.key(&out->key) && r.value(&out->value) && r.value(&out->value2);
        break;
      case Op::kGet:
      case Op::kWatchKey:
      case Op::kDeleteKey:
      case Op::kQueuePop:
      case Op::kQueueLen:
        ok = r.key(&out->key);
        break;
      case Op::kAdd: {
        uint64_t delta = 0;
        ok = r.key(&out->key) && r.u64(&delta);
        out->delta = static_cast<int64_t>(delta);
        break;
      }
      case Op::kCheck:
      case Op::kWait:
      case Op::kMultiGet:
      case Op::kMultiSet: {
        // MULTI_SET's count is sent as i64; a negative one reads as huge.
        const bool with_values = out->op == Op::kMultiSet;
        uint64_t n = 0;
        if (resuming) {
          r.seek(out->resume_pos);
          n = out->resume_count;
        } else {
          out->key_spans.clear();
          out->value_spans.clear();
          ok = r.count(&n);
        }
        while (ok && out->key_spans.size() < n) {
          size_t entry = r.pos();
          std::string_view k, v;
          ok = r.key(&k) && (!with_values || r.value(&v));
          if (ok) {
            out->key_spans.emplace_back(static_cast<size_t>(k.data() - data), k.size());
            if (with_values) {
              out->value_spans.emplace_back(static_cast<size_t>(v.data() - data), v.size());
            }
          } else if (!r.error()) {
            out->resume_pos = entry;
            out->resume_count = n;
          }
        }
        if (ok) {
          out->resume_pos = 0;
          out->keys.reserve(out->key_spans.size());
          for (auto [off, len] : out->key_spans) out->keys.emplace_back(data + off, len);
          for (auto [off, len] : out->value_spans) out->values.emplace_back(data + off, len);
        }
        break;
      }
      case Op::kGetNumKeys:
      case Op::kCancelWait:
      case Op::kList:
        break;
    }
  }

  if (r.error()) {
    reset_progress(out);
    result.status = ParseStatus::kError;
    result.error = r.error();
    result.limit = r.limit();
    result.length = r.length();
    result.key = r.last_key();
  } else if (ok) {
    result.status = ParseStatus::kComplete;
    result.size = r.pos();
  } else {
    result.status = ParseStatus::kNeedMore;
    result.size = r.need();
  }
  return result;
}

std::optional<int64_t> parse_int64_like_stoll(std::string_view s) {
  // The common case, a counter the store wrote itself: 1 to 18 digits, which
  // cannot overflow.
  if (!s.empty() && s.size() <= 18) {
    int64_t v = 0;
    size_t k = 0;
    for (; k < s.size() && static_cast<unsigned char>(s[k] - '0') < 10; ++k)
      v = v * 10 + (s[k] - '0');
    if (k == s.size()) return v;
  }
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\v' ||
                          s[i] == '\f' || s[i] == '\r')) {
    ++i;
  }
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) {
    negative = s[i] == '-';
    ++i;
  }
  size_t first_digit = i;
  // Accumulate as a negative number so INT64_MIN fits.
  int64_t value = 0;
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    int digit = s[i] - '0';
    if (value < (kMin + digit) / 10) return std::nullopt;
    value = value * 10 - digit;
  }
  if (i == first_digit) return std::nullopt;
  if (negative) return value;
  if (value == kMin) return std::nullopt;
  return -value;
}

}  // namespace ctorchrun::store::protocol

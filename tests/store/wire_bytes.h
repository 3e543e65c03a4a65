#pragma once

// Builders for raw request bytes in tests.

#include <string>
#include <vector>

#include "store/protocol.h"

namespace ctorchrun::testing::wire {

using store::protocol::Dialect;
using store::protocol::Op;

inline std::string op(Dialect d, Op o) {
  std::string s;
  store::protocol::put_u8(&s, *store::protocol::encode_opcode(d, o));
  return s;
}
inline std::string str(const std::string& b) {
  std::string s;
  store::protocol::put_bytes(&s, b);
  return s;
}
inline std::string u64(uint64_t v) {
  std::string s;
  store::protocol::put_u64(&s, v);
  return s;
}
inline std::string u32(uint32_t v) {
  std::string s;
  store::protocol::put_u32(&s, v);
  return s;
}
inline std::string validate() {
  return op(Dialect::kV2, Op::kValidate) + u32(store::protocol::kValidationMagic);
}
inline std::string keys(const std::vector<std::string>& ks) {
  std::string s = u64(ks.size());
  for (const auto& k : ks) s += str(k);
  return s;
}

}  // namespace ctorchrun::testing::wire

#pragma once

// Plain values the etcd client returns. Revisions are etcd's: the store-wide
// counter that every change increments; 0 never names a change, so 0 stands
// for "absent" where a revision is expected.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::etcd {

struct KeyValue {
  std::string key;
  std::string value;
  std::int64_t create_revision = 0;  // revision that created the key
  std::int64_t mod_revision = 0;     // revision of the last change
  std::int64_t version = 0;          // changes since creation (1 after the creating put)
  std::int64_t lease = 0;            // lease the key is attached to, 0 if none
};

struct RangeResult {
  std::vector<KeyValue> kvs;  // sorted by key, as etcd returns them
  std::int64_t revision = 0;  // the store's revision when the range was read
};

struct CompareSetResult {
  bool succeeded = false;
  // Store revision after the transaction; on success, the key's new mod_revision.
  std::int64_t revision = 0;
  // On failure, the key as it is now (nullopt inside means absent). On success, empty.
  bool has_current = false;
  std::optional<KeyValue> current;
};

struct Lease {
  std::int64_t id = 0;
  std::int64_t ttl_s = 0;  // granted TTL in seconds (etcd may raise a short one)
};

struct MemberStatus {
  std::uint64_t member_id = 0;  // the answering member
  std::uint64_t leader_id = 0;  // 0 while there is no leader
  std::int64_t revision = 0;
  std::string version;
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  // For a delete: key and mod_revision (the deleting revision) only.
  KeyValue kv;
};

}  // namespace ctorchrun::etcd

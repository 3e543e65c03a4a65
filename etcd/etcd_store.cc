#include "etcd/etcd_store.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "etcd/base64.h"
#include "etcd/client_internal.h"
#include "etcd/errors.h"
#include "etcd/response_internal.h"
#include "store/protocol.h"

namespace ctorchrun::etcd {

using nlohmann::json;

namespace {

// Request and compare builders of the gateway's JSON (etcdserverpb's
// RequestOp and Compare; bytes as base64, int64 as decimal strings).

std::string b64(const std::string& s) { return base64_encode(s); }

json op_put(const std::string& key, const std::string& value, std::int64_t lease) {
  json put = {{"key", b64(key)}, {"value", b64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  return {{"request_put", std::move(put)}};
}

// Overwrites an existing key and keeps its lease (or its lack of one). etcd
// refuses it for a missing key, so it only ever runs behind a compare that
// the key exists.
json op_overwrite(const std::string& key, const std::string& value) {
  return {{"request_put", {{"key", b64(key)}, {"value", b64(value)}, {"ignore_lease", true}}}};
}

json op_range(const std::string& key, bool count_only) {
  json r = {{"key", b64(key)}};
  if (count_only) r["count_only"] = true;
  return {{"request_range", std::move(r)}};
}

json op_delete(const std::string& key) { return {{"request_delete_range", {{"key", b64(key)}}}}; }

json op_txn(json compare, json success, json failure) {
  return {{"request_txn",
           {{"compare", std::move(compare)},
            {"success", std::move(success)},
            {"failure", std::move(failure)}}}};
}

json txn_body(json compare, json success, json failure) {
  return {{"compare", std::move(compare)},
          {"success", std::move(success)},
          {"failure", std::move(failure)}};
}

json cmp_absent(const std::string& key) {
  return {{"key", b64(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
}

json cmp_present(const std::string& key) {
  return {{"key", b64(key)}, {"target", "CREATE"}, {"result", "GREATER"}, {"create_revision", "0"}};
}

json cmp_value(const std::string& key, const std::string& value) {
  return {{"key", b64(key)}, {"target", "VALUE"}, {"result", "EQUAL"}, {"value", b64(value)}};
}

json cmp_mod(const std::string& key, std::int64_t mod_revision) {
  return {{"key", b64(key)},
          {"target", "MOD"},
          {"result", "EQUAL"},
          {"mod_revision", std::to_string(mod_revision)}};
}

// The operations that create `key`: the key itself, and its markers set to
// speak of this incarnation (etcd_store.h).
json create_ops(const std::string& key, const std::string& value, std::int64_t lease) {
  json ops = json::array();
  ops.push_back(op_put(key, value, lease));
  if (lease != 0) {
    ops.push_back(op_put(EtcdStore::held_marker(key), std::to_string(lease), 0));
  } else {
    ops.push_back(op_delete(EtcdStore::held_marker(key)));
  }
  ops.push_back(op_delete(EtcdStore::left_marker(key)));
  return ops;
}

// The i-th response of a txn answer (or of a nested response_txn), unwrapped
// from its ResponseOp as `field`.
const json& response_at(const json& txn, std::size_t i, const char* field, const std::string& ctx) {
  const json* responses = detail::array_field(txn, "responses", ctx);
  if (!responses || responses->size() <= i || !(*responses)[i].is_object())
    throw ProtocolError(ctx + ": transaction answer lacks response " + std::to_string(i));
  const json* r = detail::object_field((*responses)[i], field, ctx);
  if (!r) throw ProtocolError(ctx + ": response " + std::to_string(i) + " is not a " + field);
  return *r;
}

// The key a range response of one key returned, or nullopt.
std::optional<KeyValue> range_one(const json& range, const std::string& key,
                                  const std::string& ctx) {
  const json* kvs = detail::array_field(range, "kvs", ctx);
  if (!kvs || kvs->empty()) return std::nullopt;
  if (kvs->size() != 1) throw ProtocolError(ctx + ": range of one key returned several");
  KeyValue kv = detail::parse_key_value((*kvs)[0], ctx);
  if (kv.key != key) throw ProtocolError(ctx + ": range returned another key");
  return kv;
}

// A key or value fit for a message: non-printable bytes as \xNN, long ones cut.
std::string printable(const std::string& bytes, std::size_t max_len = 80) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < bytes.size() && i < max_len; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  if (bytes.size() > max_len) out += "...";
  return out;
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string out = "[";
  for (std::size_t i = 0; i < keys.size(); ++i) {
    out += (i ? ", '" : "'") + printable(keys[i]) + "'";
  }
  return out + "]";
}

std::string common_prefix(const std::vector<std::string>& keys) {
  std::string p = keys.front();
  for (const auto& k : keys) {
    std::size_t n = 0;
    while (n < p.size() && n < k.size() && p[n] == k[n]) ++n;
    p.resize(n);
  }
  return p;
}

// The next event of `watch` before `deadline`, or nullopt once it passed.
// Watch::next() keeps re-creating a lost stream until the deadline it is
// given and only then throws IoError, so a wait of 300 s on a dead etcd
// would hang for 300 s. Waiting in slices of the read timeout instead turns
// a stream that no member takes back for a whole read timeout into IoError,
// within about twice the read timeout of the loss, as for any other call.
std::optional<WatchEvent> next_event(Watch& watch, std::chrono::steady_clock::time_point deadline,
                                     std::chrono::milliseconds read_timeout) {
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> failing_since;
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    try {
      auto e = watch.next(std::min(deadline, now + read_timeout));
      if (e) return e;
      failing_since.reset();  // the slice ended with the stream up
    } catch (const IoError&) {
      const auto t = Clock::now();
      if (!failing_since) failing_since = t;
      if (t - *failing_since >= read_timeout) throw;
    }
  }
}

}  // namespace

struct EtcdStore::Snapshot {
  std::int64_t revision = 0;                       // of the first transaction (the earliest read)
  std::vector<std::optional<std::string>> values;  // "" for present keys when count_only
};

EtcdStore::EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix)
    : client_(std::move(client)), prefix_(std::move(prefix)) {
  if (!client_) throw ConfigError("etcd store needs a client");
  core_ = detail::core_of(*client_);
}

EtcdStore::~EtcdStore() = default;

std::string EtcdStore::where() const {
  std::string eps;
  for (const auto& e : client_->endpoints()) eps += (eps.empty() ? "" : ",") + e;
  return "etcd store '" + printable(prefix_) + "' at " + eps;
}

std::int64_t EtcdStore::creation_lease() const {
  std::lock_guard<std::mutex> lock(lease_mutex_);
  if (!keeper_) return 0;
  if (keeper_->lost())
    throw IoError(where() + ": lease " + std::to_string(keeper_->lease_id()) +
                  " is lost, so keys can no longer be bound to it (" + keeper_->lost_reason() +
                  "); bind them to a new lease");
  return keeper_->lease_id();
}

void EtcdStore::bind_keys_to_lease(std::chrono::milliseconds ttl) {
  using std::chrono::milliseconds;
  const auto secs = std::max<std::int64_t>(1, (ttl.count() + 999) / 1000);
  const Lease lease = client_->lease_grant(std::chrono::seconds(secs));
  // A third of the TTL leaves two refreshes' worth of slack before expiry.
  const milliseconds granted = std::chrono::seconds(lease.ttl_s);
  const milliseconds interval = std::max(milliseconds(1), std::min(ttl, granted) / 3);
  auto keeper = std::make_unique<LeaseKeeper>(*client_, lease, interval);
  std::lock_guard<std::mutex> lock(lease_mutex_);
  keeper_.swap(keeper);
  // The old keeper (if any) stops as `keeper` goes; its lease is left alone.
}

std::int64_t EtcdStore::lease_id() const {
  std::lock_guard<std::mutex> lock(lease_mutex_);
  return keeper_ ? keeper_->lease_id() : 0;
}

bool EtcdStore::lease_lost() const {
  std::lock_guard<std::mutex> lock(lease_mutex_);
  return keeper_ && keeper_->lost();
}

std::string EtcdStore::lease_lost_reason() const {
  std::lock_guard<std::mutex> lock(lease_mutex_);
  return keeper_ ? keeper_->lost_reason() : std::string();
}

EtcdStore::Snapshot EtcdStore::read(const std::vector<std::string>& full_keys,
                                    bool count_only) const {
  Snapshot snap;
  snap.values.reserve(full_keys.size());
  for (std::size_t begin = 0; begin < full_keys.size(); begin += kMaxTxnOps) {
    const std::size_t end = std::min(full_keys.size(), begin + kMaxTxnOps);
    json ops = json::array();
    for (std::size_t i = begin; i < end; ++i) ops.push_back(op_range(full_keys[i], count_only));
    const std::string ctx = "etcd read of " + std::to_string(end - begin) + " keys";
    const json resp =
        core_->call("/v3/kv/txn", txn_body(json::array(), std::move(ops), json::array()), true);
    if (begin == 0) snap.revision = detail::header_revision(resp, ctx);
    for (std::size_t i = begin; i < end; ++i) {
      const json& range = response_at(resp, i - begin, "response_range", ctx);
      if (count_only) {
        if (detail::int_field(range, "count", ctx) > 0) {
          snap.values.emplace_back(std::string());
        } else {
          snap.values.emplace_back(std::nullopt);
        }
      } else {
        auto kv = range_one(range, full_keys[i], ctx);
        snap.values.push_back(kv ? std::optional<std::string>(std::move(kv->value)) : std::nullopt);
      }
    }
  }
  return snap;
}

void EtcdStore::set(const std::string& key, const std::string& value) {
  const std::string k = prefix_ + key;
  const std::int64_t lease = creation_lease();
  if (value.size() <= kInlineValueBytes) {
    // Create (bound when the store binds) or overwrite keeping the binding,
    // in one transaction. Idempotent: a replay overwrites with the same value.
    core_->call("/v3/kv/txn",
                txn_body(json::array({cmp_absent(k)}), create_ops(k, value, lease),
                         json::array({op_overwrite(k, value)})),
                true);
    return;
  }
  // A large value once per request (etcd's gRPC side takes 2 MiB at most):
  // create if absent, else overwrite if present, until one holds.
  const std::string ctx = "etcd set of '" + printable(k) + "'";
  for (int attempt = 1; attempt <= kMaxAttempts; ++attempt) {
    json resp = core_->call(
        "/v3/kv/txn",
        txn_body(json::array({cmp_absent(k)}), create_ops(k, value, lease), json::array()), true);
    if (detail::bool_field(resp, "succeeded", ctx)) return;
    resp = core_->call("/v3/kv/txn",
                       txn_body(json::array({cmp_present(k)}),
                                json::array({op_overwrite(k, value)}), json::array()),
                       true);
    if (detail::bool_field(resp, "succeeded", ctx)) return;
  }
  throw TimeoutError("set of key '" + printable(key) + "' (" + where() + "): deleted and created " +
                     "again " + std::to_string(kMaxAttempts) + " times during the set");
}

std::string EtcdStore::get(const std::string& key) {
  const std::string k = prefix_ + key;
  const auto deadline = Clock::now() + timeout_;
  // Each round reads, then watches from the revision after the read: a put
  // racing the watch's creation is replayed, not lost. A round ends early
  // only when etcd compacted the history the watch needed (read again).
  for (;;) {
    const Snapshot snap = read({k}, false);
    if (snap.values[0]) return *snap.values[0];
    try {
      auto watch = client_->watch(k, snap.revision + 1, false);
      for (;;) {
        auto e = next_event(*watch, deadline, client_->read_timeout());
        if (!e)
          throw TimeoutError("get of key '" + printable(key) + "' on " + where() +
                             " timed out after " + format_duration(timeout_));
        if (e->type == WatchEvent::Type::kPut) return std::move(e->kv.value);
      }
    } catch (const WatchCompactedError&) {
      // Read again; past the deadline the next round times out as usual.
    }
  }
}

namespace {

// After a lost compare-and-set race: a random pause that grows with the
// attempts (up to 64 ms), so that many writers of one key (a rendezvous
// counter) spread out instead of colliding again at once.
void pause_after_lost_race(int attempt) {
  thread_local std::minstd_rand rng(std::random_device{}());
  const int cap_ms = 1 << std::min(attempt, 6);
  std::uniform_int_distribution<int> dist(0, cap_ms * 1000);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
}

}  // namespace

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  const std::string k = prefix_ + key;
  const std::string ctx = "etcd add on '" + printable(k) + "'";
  std::optional<KeyValue> current = client_->get(k);
  // Adding 0 to a missing key writes nothing (torch's store creates it with
  // "0"): a read that leaves no key behind, and nothing to recover after a
  // lost answer.
  if (!current && delta == 0) return 0;
  for (int attempt = 1; attempt <= kMaxAttempts; ++attempt) {
    int64_t old = 0;
    if (current) {
      const auto parsed = store::protocol::parse_int64_like_stoll(current->value);
      if (!parsed)
        throw Error("add on key '" + printable(key) + "': stored value '" +
                    printable(current->value) + "' is not an integer (" + where() + ")");
      old = *parsed;
      // Adding 0 to a number is a read: no transaction for every other
      // reader's to collide with (add(key, 0) is how counters are polled).
      if (delta == 0) return old;
    }
    int64_t updated = 0;
    if (__builtin_add_overflow(old, delta, &updated))
      throw Error("add('" + printable(key) + "', " + std::to_string(delta) + ") overflows int64");
    const std::string text = std::to_string(updated);
    const json body =
        current ? txn_body(json::array({cmp_mod(k, current->mod_revision)}),
                           json::array({op_overwrite(k, text)}), json::array({op_range(k, false)}))
                : txn_body(json::array({cmp_absent(k)}), create_ops(k, text, creation_lease()),
                           json::array({op_range(k, false)}));
    // Not idempotent: replaying an applied transaction would count twice.
    const json resp = core_->call("/v3/kv/txn", body, false);
    if (detail::bool_field(resp, "succeeded", ctx)) return updated;
    current = range_one(response_at(resp, 0, "response_range", ctx), k, ctx);
    pause_after_lost_race(attempt);
  }
  throw TimeoutError("add on key '" + printable(key) + "' (" + where() + "): lost " +
                     std::to_string(kMaxAttempts) +
                     " compare-and-set races in a row; too many concurrent writers");
}

std::string EtcdStore::tally_token() {
  std::lock_guard<std::mutex> lock(token_mutex_);
  if (token_base_.empty()) {
    std::random_device rd;
    std::mt19937_64 rng((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
    char buf[40];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(rng()),
                  static_cast<unsigned long long>(rng()));
    token_base_ = buf;
  }
  return token_base_ + "." + std::to_string(++token_count_);
}

int64_t EtcdStore::tally_add(const std::string& key, const std::string& entry) {
  const std::string dir = prefix_ + key + kTallySuffix;
  const std::string ctx = "etcd tally on '" + printable(dir) + "'";
  // One transaction with no compare, so it never fails against another
  // writer: a new key of this enrolment, then the count of the tally's keys.
  // etcd applies transactions one at a time, so the count is this
  // enrolment's place. Unbound (no lease): a tally never shrinks.
  const json range = {
      {"request_range",
       {{"key", b64(dir)}, {"range_end", b64(detail::prefix_end(dir))}, {"count_only", true}}}};
  const std::string mine = dir + tally_token();
  const json body =
      txn_body(json::array(), json::array({op_put(mine, entry, 0), range}), json::array());
  std::int64_t place = 0;
  try {
    // Not replayed as it is: a replay after a lost answer would be given a
    // later place.
    const json resp = core_->call("/v3/kv/txn", body, false);
    place = detail::int_field(response_at(resp, 1, "response_range", ctx), "count", ctx);
  } catch (const IoError&) {
    // The answer was lost (a member died mid-request, a leader change): the
    // enrolment may or may not have been applied. Its key is this
    // enrolment's own, so the outcome is recovered, not guessed: enrol it
    // if it is absent (a transaction any member may replay), then its place
    // is the number of the tally's keys created up to its creation.
    const json ensure = txn_body(json::array({cmp_absent(mine)}),
                                 json::array({op_put(mine, entry, 0)}), json::array());
    core_->call("/v3/kv/txn", ensure, true);
    const auto kv = client_->get(mine);
    if (!kv) throw ProtocolError(ctx + ": the enrolment " + printable(mine) + " vanished");
    // The keys themselves, not count_only: etcd's count is the range's
    // total before the revision filter is applied (only the returned keys
    // are filtered), so a count would include later enrolments.
    const json resp = core_->call("/v3/kv/range",
                                  {{"key", b64(dir)},
                                   {"range_end", b64(detail::prefix_end(dir))},
                                   {"keys_only", true},
                                   {"max_create_revision", std::to_string(kv->create_revision)}},
                                  true);
    const json* kvs = detail::array_field(resp, "kvs", ctx);
    place = kvs == nullptr ? 0 : static_cast<std::int64_t>(kvs->size());
  }
  if (place < 1)
    throw ProtocolError(ctx + ": the count after an enrolment is " + std::to_string(place));
  return place;
}

int64_t EtcdStore::tally_count(const std::string& key) {
  const std::string dir = prefix_ + key + kTallySuffix;
  const std::string ctx = "etcd tally count of '" + printable(dir) + "'";
  const json resp = core_->call(
      "/v3/kv/range",
      {{"key", b64(dir)}, {"range_end", b64(detail::prefix_end(dir))}, {"count_only", true}}, true);
  detail::header_revision(resp, ctx);
  return detail::int_field(resp, "count", ctx);
}

std::vector<std::string> EtcdStore::tally_entries(const std::string& key) {
  const RangeResult r = client_->range_prefix(prefix_ + key + kTallySuffix);
  std::vector<std::string> out;
  for (const auto& kv : r.kvs) {
    if (!kv.value.empty()) out.push_back(kv.value);
  }
  return out;
}

std::string EtcdStore::compare_set(const std::string& key, const std::string& expected,
                                   const std::string& desired) {
  const std::string k = prefix_ + key;
  const std::string ctx = "etcd compare_set on '" + printable(k) + "'";
  // Idempotent under torch's rules: a replay of an applied transaction finds
  // `desired` stored and returns it, which is what success returns.
  if (!expected.empty()) {
    const json resp = core_->call(
        "/v3/kv/txn",
        txn_body(json::array({cmp_value(k, expected)}), json::array({op_overwrite(k, desired)}),
                 json::array({op_range(k, false)})),
        true);
    if (detail::bool_field(resp, "succeeded", ctx)) return desired;
    auto current = range_one(response_at(resp, 0, "response_range", ctx), k, ctx);
    return current ? std::move(current->value) : expected;
  }
  // expected == "": store when absent, or when present and empty. etcd ANDs
  // the compares of one transaction, so the second test is a nested one in
  // the failure branch (a VALUE compare on a missing key is false in etcd).
  // A large `desired` goes once per request: the two tests in turn.
  if (desired.size() > kInlineValueBytes) {
    for (int attempt = 1; attempt <= kMaxAttempts; ++attempt) {
      json resp = core_->call("/v3/kv/txn",
                              txn_body(json::array({cmp_absent(k)}),
                                       create_ops(k, desired, creation_lease()), json::array()),
                              true);
      if (detail::bool_field(resp, "succeeded", ctx)) return desired;
      resp = core_->call(
          "/v3/kv/txn",
          txn_body(json::array({cmp_value(k, "")}), json::array({op_overwrite(k, desired)}),
                   json::array({op_range(k, false)})),
          true);
      if (detail::bool_field(resp, "succeeded", ctx)) return desired;
      auto current = range_one(response_at(resp, 0, "response_range", ctx), k, ctx);
      if (current) return std::move(current->value);
    }
    throw TimeoutError("compare_set on key '" + printable(key) + "' (" + where() +
                       "): deleted and created again " + std::to_string(kMaxAttempts) +
                       " times during the call");
  }
  json inner = op_txn(json::array({cmp_value(k, "")}), json::array({op_overwrite(k, desired)}),
                      json::array({op_range(k, false)}));
  const json resp =
      core_->call("/v3/kv/txn",
                  txn_body(json::array({cmp_absent(k)}), create_ops(k, desired, creation_lease()),
                           json::array({std::move(inner)})),
                  true);
  if (detail::bool_field(resp, "succeeded", ctx)) return desired;
  const json& nested = response_at(resp, 0, "response_txn", ctx);
  if (detail::bool_field(nested, "succeeded", ctx)) return desired;
  auto current = range_one(response_at(nested, 0, "response_range", ctx), k, ctx);
  // Absent here is impossible (the outer compare found the key in the same
  // transaction); answer as torch would for an absent key all the same.
  return current ? std::move(current->value) : desired;
}

std::unique_ptr<Watch> EtcdStore::take_parked(const std::string& full_key) const {
  std::lock_guard<std::mutex> lock(parked_mutex_);
  if (!parked_ || parked_key_ != full_key) return nullptr;
  return std::move(parked_);
}

void EtcdStore::park(const std::string& full_key, std::unique_ptr<Watch> watch) const {
  std::lock_guard<std::mutex> lock(parked_mutex_);
  parked_key_ = full_key;
  parked_ = std::move(watch);
}

void EtcdStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  if (keys.empty()) return;
  const auto deadline = Clock::now() + timeout;
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  if (full.size() == 1) {
    // The previous wait on this key timed out: its watch goes on from
    // where it was (no read, no new stream), as one longer wait would.
    if (std::unique_ptr<Watch> watch = take_parked(full[0])) {
      std::optional<WatchEvent> e;
      try {
        for (int i = 0; i < 1'000'000; ++i) {
          e = next_event(*watch, deadline, client_->read_timeout());
          if (!e || (e->type == WatchEvent::Type::kPut && e->kv.key == full[0])) break;
        }
      } catch (const Error&) {
        // Compacted, or the stream is not back: read and watch afresh.
        watch.reset();
      }
      if (watch) {
        if (e && e->type == WatchEvent::Type::kPut) return;
        park(full[0], std::move(watch));
        throw TimeoutError("wait for keys " + key_list({keys[0]}) + " on " + where() +
                           " timed out after " + format_duration(timeout));
      }
    }
  }
  const Snapshot snap = read(full, true);
  std::vector<std::string> missing;
  for (std::size_t i = 0; i < full.size(); ++i) {
    if (!snap.values[i]) missing.push_back(full[i]);
  }
  if (missing.empty()) return;
  wait_missing(std::move(missing), snap.revision, deadline, timeout);
}

void EtcdStore::wait_missing(std::vector<std::string> missing, std::int64_t revision,
                             Clock::time_point deadline, std::chrono::milliseconds timeout) const {
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  std::set<std::string> left(missing.begin(), missing.end());
  for (;;) {
    // One key: a watch of that key. Several: one watch of their longest
    // common prefix (at least this store's prefix), not one stream per key.
    const std::vector<std::string> now(left.begin(), left.end());
    try {
      std::unique_ptr<Watch> watch = now.size() == 1
                                         ? client_->watch(now[0], revision + 1, false)
                                         : client_->watch(common_prefix(now), revision + 1, true);
      while (!left.empty()) {
        auto e = next_event(*watch, deadline, client_->read_timeout());
        if (!e) {
          std::vector<std::string> names;
          for (const auto& k : left) names.push_back(k.substr(prefix_.size()));
          // A lone key's watch waits for the next wait on it (wait()).
          if (missing.size() == 1) park(missing[0], std::move(watch));
          throw TimeoutError("wait for keys " + key_list(names) + " on " + where() +
                             " timed out after " + format_duration(timeout));
        }
        if (e->type == WatchEvent::Type::kPut) left.erase(e->kv.key);
      }
      return;
    } catch (const WatchCompactedError&) {
      // The history since `revision` is gone: read the keys still missing
      // again and watch from there (past the deadline, that times out).
      const std::vector<std::string> still(left.begin(), left.end());
      const Snapshot snap = read(still, true);
      for (std::size_t i = 0; i < still.size(); ++i) {
        if (snap.values[i]) left.erase(still[i]);
      }
      if (left.empty()) return;
      revision = snap.revision;
    }
  }
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  if (keys.empty()) return true;
  std::vector<std::string> full;
  full.reserve(keys.size());
  const std::string gone = store::protocol::kGoneSuffix;
  for (const auto& k : keys) {
    // A TCP store's gone marker: here, a bound key whose lease expired.
    if (k.size() > gone.size() && k.compare(k.size() - gone.size(), gone.size(), gone) == 0) {
      if (key_status(k.substr(0, k.size() - gone.size())) != KeyStatus::kLost) return false;
      continue;
    }
    full.push_back(prefix_ + k);
  }
  if (full.empty()) return true;
  const Snapshot snap = read(full, true);
  return std::all_of(snap.values.begin(), snap.values.end(),
                     [](const std::optional<std::string>& v) { return v.has_value(); });
}

int64_t EtcdStore::num_keys() {
  const std::string start = prefix_.empty() ? std::string(1, '\0') : prefix_;
  const json resp = core_->call(
      "/v3/kv/range",
      {{"key", b64(start)}, {"range_end", b64(detail::prefix_end(prefix_))}, {"count_only", true}},
      true);
  const std::string ctx = "etcd count of '" + printable(prefix_) + "'";
  detail::header_revision(resp, ctx);
  return detail::int_field(resp, "count", ctx);
}

bool EtcdStore::delete_key(const std::string& key) {
  const std::string k = prefix_ + key;
  const std::string ctx = "etcd delete of '" + printable(k) + "'";
  // A bound key deleted on purpose leaves its left marker, in the same
  // transaction, so no snapshot ever shows it absent with neither marker.
  const json resp = core_->call("/v3/kv/txn",
                                txn_body(json::array({cmp_present(held_marker(k)), cmp_present(k)}),
                                         json::array({op_put(left_marker(k), "1", 0),
                                                      op_delete(held_marker(k)), op_delete(k)}),
                                         json::array({op_delete(k)})),
                                true);
  if (detail::bool_field(resp, "succeeded", ctx)) return true;
  return detail::int_field(response_at(resp, 0, "response_delete_range", ctx), "deleted", ctx) > 0;
}

void EtcdStore::append(const std::string& key, const std::string& value) {
  const std::string k = prefix_ + key;
  const std::string ctx = "etcd append on '" + printable(k) + "'";
  std::optional<KeyValue> current = client_->get(k);
  for (int attempt = 1; attempt <= kMaxAttempts; ++attempt) {
    const json body =
        current ? txn_body(json::array({cmp_mod(k, current->mod_revision)}),
                           json::array({op_overwrite(k, current->value + value)}),
                           json::array({op_range(k, false)}))
                : txn_body(json::array({cmp_absent(k)}), create_ops(k, value, creation_lease()),
                           json::array({op_range(k, false)}));
    // Not idempotent: a replay would append twice.
    const json resp = core_->call("/v3/kv/txn", body, false);
    if (detail::bool_field(resp, "succeeded", ctx)) return;
    current = range_one(response_at(resp, 0, "response_range", ctx), k, ctx);
    pause_after_lost_race(attempt);
  }
  throw TimeoutError("append on key '" + printable(key) + "' (" + where() + "): lost " +
                     std::to_string(kMaxAttempts) +
                     " compare-and-set races in a row; too many concurrent writers");
}

std::vector<std::string> EtcdStore::multi_get(const std::vector<std::string>& keys) {
  const auto deadline = Clock::now() + timeout_;
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  // Each round either returns or waits for a put of a missing key; a key
  // deleted again before the re-read costs another round, until the deadline.
  for (;;) {
    Snapshot snap = read(full, false);
    std::vector<std::string> missing;
    for (std::size_t i = 0; i < full.size(); ++i) {
      if (!snap.values[i]) missing.push_back(full[i]);
    }
    if (missing.empty()) {
      std::vector<std::string> out;
      out.reserve(full.size());
      for (auto& v : snap.values) out.push_back(std::move(*v));
      return out;
    }
    wait_missing(std::move(missing), snap.revision, deadline, timeout_);
  }
}

void EtcdStore::multi_set(const std::vector<std::string>& keys,
                          const std::vector<std::string>& values) {
  if (keys.size() != values.size())
    throw ConfigError("multi_set with " + std::to_string(keys.size()) + " keys and " +
                      std::to_string(values.size()) + " values");
  if (keys.empty()) return;
  // etcd refuses a transaction that touches one key twice (markers count),
  // and one over its request size; those go key by key.
  std::set<std::string> touched;
  std::size_t bytes = 0;
  for (const auto& v : values) bytes += v.size();
  bool distinct = keys.size() <= kMaxTxnOps && bytes <= kInlineValueBytes;
  for (std::size_t i = 0; distinct && i < keys.size(); ++i) {
    const std::string k = prefix_ + keys[i];
    for (const auto& t : {k, held_marker(k), left_marker(k)}) {
      if (!touched.insert(t).second) distinct = false;
    }
  }
  if (!distinct) {
    for (std::size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
    return;
  }
  // One transaction of one nested create-or-overwrite per key: atomic.
  const std::int64_t lease = creation_lease();
  json ops = json::array();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::string k = prefix_ + keys[i];
    ops.push_back(op_txn(json::array({cmp_absent(k)}), create_ops(k, values[i], lease),
                         json::array({op_overwrite(k, values[i])})));
  }
  core_->call("/v3/kv/txn", txn_body(json::array(), std::move(ops), json::array()), true);
}

const char* EtcdStore::to_string(KeyStatus s) {
  switch (s) {
    case KeyStatus::kAbsent:
      return "absent";
    case KeyStatus::kPresent:
      return "present";
    case KeyStatus::kHeld:
      return "held";
    case KeyStatus::kLost:
      return "lost";
    case KeyStatus::kLeft:
      return "left";
  }
  return "?";
}

namespace {

EtcdStore::KeyStatus status_of(bool present, bool held, bool left) {
  using S = EtcdStore::KeyStatus;
  if (present) return held ? S::kHeld : S::kPresent;
  if (held) return S::kLost;
  return left ? S::kLeft : S::kAbsent;
}

}  // namespace

EtcdStore::KeyStatus EtcdStore::key_status(const std::string& key) {
  const std::string k = prefix_ + key;
  const Snapshot snap = read({k, held_marker(k), left_marker(k)}, true);
  return status_of(snap.values[0].has_value(), snap.values[1].has_value(),
                   snap.values[2].has_value());
}

EtcdStore::KeyStatus EtcdStore::wait_vacated(const std::string& key,
                                             std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const std::string k = prefix_ + key;
  const Snapshot snap = read({k, held_marker(k), left_marker(k)}, true);
  if (!snap.values[0])
    return status_of(false, snap.values[1].has_value(), snap.values[2].has_value());
  // The key and its markers share the key as prefix: one watch sees them
  // all. The markers' state at the deleting revision is read at that very
  // revision, so a later re-creation cannot blur why the key went.
  auto watch = client_->watch(k, snap.revision + 1, true);
  for (;;) {
    auto e = next_event(*watch, deadline, client_->read_timeout());
    if (!e)
      throw TimeoutError("wait for key '" + printable(key) + "' to go on " + where() +
                         " timed out after " + format_duration(timeout));
    if (e->type != WatchEvent::Type::kDelete || e->kv.key != k) continue;
    const std::int64_t at = e->kv.mod_revision;
    auto exists_at = [&](const std::string& marker) {
      const std::string ctx =
          "etcd read of '" + printable(marker) + "' at revision " + std::to_string(at);
      const json resp = core_->call(
          "/v3/kv/range",
          {{"key", b64(marker)}, {"revision", std::to_string(at)}, {"count_only", true}}, true);
      return detail::int_field(resp, "count", ctx) > 0;
    };
    return status_of(false, exists_at(held_marker(k)), exists_at(left_marker(k)));
  }
}

}  // namespace ctorchrun::etcd

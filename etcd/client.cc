#include "etcd/client.h"

#include <algorithm>
#include <charconv>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "common/json_text.h"
#include "etcd/base64.h"
#include "etcd/client_internal.h"
#include "etcd/response_internal.h"
#include "etcd/watch_internal.h"

namespace ctorchrun::etcd {

using detail::Clock;
using detail::Exchange;
using nlohmann::json;

namespace detail {

std::chrono::milliseconds ClientCore::attempt_budget() const {
  return std::max(std::chrono::milliseconds(1), read_timeout / static_cast<long>(endpoints.size()));
}

std::string ClientCore::context(std::size_t member, const std::string& path) const {
  return "etcd " + texts[member] + " " + path;
}

Exchange ClientCore::exchange(std::size_t member, const std::string& path, const std::string& body,
                              bool streamed, Clock::time_point deadline) const {
  exchanges.fetch_add(1, std::memory_order_relaxed);
  Exchange out;
  const std::string ctx = context(member, path);
  HttpConnection conn(tls.get());
  if (auto e = conn.connect(endpoints[member], deadline)) {
    if (e.kind == StepError::Kind::kTls) {
      out.kind = Exchange::Kind::kTls;
      out.what = ctx + ": " + e.what;
    } else {
      out.what = e.what;
    }
    return out;
  }
  if (auto e = conn.post(path, body, deadline)) {
    out.sent = true;
    out.kind = e.kind == StepError::Kind::kTls ? Exchange::Kind::kTls : Exchange::Kind::kRetry;
    out.what = out.kind == Exchange::Kind::kTls ? ctx + ": " + e.what : e.what;
    return out;
  }
  out.sent = true;
  // A stream's first message is its answer: read until one is complete.
  std::vector<std::string> messages;
  for (;;) {
    if (auto e = conn.read_more(deadline)) {
      out.kind = e.kind == StepError::Kind::kProtocol ? Exchange::Kind::kProtocol
                 : e.kind == StepError::Kind::kTls    ? Exchange::Kind::kTls
                                                      : Exchange::Kind::kRetry;
      out.what = out.kind == Exchange::Kind::kRetry ? e.what : ctx + ": " + e.what;
      return out;
    }
    if (conn.done()) break;
    if (streamed && conn.header_done() && conn.status() == 200) {
      try {
        messages = take_objects(conn.body(), ctx);
      } catch (const ProtocolError& e) {
        out.kind = Exchange::Kind::kProtocol;
        out.what = e.what();
        return out;
      }
      if (!messages.empty()) break;
    }
  }
  const unsigned status = conn.status();
  try {
    if (status == 200) {
      if (streamed && messages.empty()) messages = take_objects(conn.body(), ctx);
      if (streamed && messages.empty()) throw ProtocolError(ctx + ": stream ended with no message");
      json j = parse_object(streamed ? messages.front() : conn.body(), ctx);
      if (!streamed) {
        out.kind = Exchange::Kind::kOk;
        out.answer = std::move(j);
        return out;
      }
      if (const json* err = object_field(j, "error", ctx)) {
        const auto grpc = int_field(*err, "grpc_code", ctx);
        const auto http = int_field(*err, "http_code", ctx);
        const auto msg = string_field(*err, "message", ctx);
        if (grpc == 14 || grpc == 4 || http >= 500) {
          out.what = "unavailable: " + msg;
          out.applied = msg.find("no leader") == std::string::npos;
          return out;
        }
        out.kind = Exchange::Kind::kRefused;
        out.code = static_cast<int>(grpc);
        out.what = ctx + ": etcd refused: " + msg + " (code " + std::to_string(grpc) + ")";
        return out;
      }
      const json* result = object_field(j, "result", ctx);
      if (!result) throw ProtocolError(ctx + ": stream message has neither result nor error");
      out.kind = Exchange::Kind::kOk;
      out.answer = *result;
      return out;
    }
    int code = 0;
    std::string msg;
    if (parse_error_body(conn.body(), code, msg)) {
      // 14 unavailable (no leader, leader changed, request timed out) and
      // 4 deadline exceeded are the member's trouble; another may serve.
      if (status >= 500 || code == 14 || code == 4) {
        out.what = "HTTP " + std::to_string(status) + ": " + msg;
        out.applied = msg.find("no leader") == std::string::npos;
        return out;
      }
      out.kind = Exchange::Kind::kRefused;
      out.code = code;
      out.what = ctx + ": etcd refused: " + msg + " (code " + std::to_string(code) + ")";
      return out;
    }
    if (status >= 500) {
      out.what = "HTTP " + std::to_string(status);
      return out;
    }
    throw ProtocolError(ctx + ": unexpected HTTP " + std::to_string(status) + ": '" +
                        conn.body().substr(0, 120) + "'");
  } catch (const ProtocolError& e) {
    out.kind = Exchange::Kind::kProtocol;
    out.what = e.what();
    return out;
  }
}

json ClientCore::call(const std::string& path, const json& body, bool idempotent, bool streamed,
                      std::chrono::milliseconds member_budget) const {
  const auto deadline = Clock::now() + read_timeout;
  const auto budget = member_budget > std::chrono::milliseconds(0)
                          ? std::min(member_budget, attempt_budget())
                          : attempt_budget();
  const std::string text = json_text::dump_record(body);
  const std::size_t n = endpoints.size();
  std::vector<std::string> errors(n, "not tried");
  const std::size_t first = preferred.load();
  for (std::size_t attempt = 0;; ++attempt) {
    if (attempt > 0 && attempt % n == 0) {
      // A whole round failed (an election, or every member down): pause
      // briefly instead of spinning on refused connections.
      const auto pause =
          std::min<Clock::duration>(std::chrono::milliseconds(50), deadline - Clock::now());
      if (pause > Clock::duration::zero()) std::this_thread::sleep_for(pause);
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    const std::size_t member = (first + attempt) % n;
    Exchange ex = exchange(member, path, text, streamed, std::min(deadline, now + budget));
    switch (ex.kind) {
      case Exchange::Kind::kOk:
        preferred.store(member);
        return std::move(ex.answer);
      case Exchange::Kind::kProtocol:
        throw ProtocolError(ex.what);
      case Exchange::Kind::kRefused:
        throw EtcdError(ex.code, ex.what);
      case Exchange::Kind::kTls:
        throw TlsError(ex.what);
      case Exchange::Kind::kRetry:
        // An attempt cut short by this call's own deadline says less than
        // what the member answered before (a refused handshake, say).
        if (errors[member] == "not tried" || Clock::now() < deadline) errors[member] = ex.what;
        if (!idempotent && ex.sent && ex.applied)
          throw IoError(context(member, path) + ": " + ex.what +
                        "; the request was sent, so it may have been applied; not retried");
        break;
    }
  }
  std::string msg =
      "etcd " + path + ": no member answered within " + format_duration(read_timeout) + ":";
  for (std::size_t i = 0; i < n; ++i) msg += (i ? ", " : " ") + texts[i] + " (" + errors[i] + ")";
  throw IoError(msg);
}

}  // namespace detail

namespace {

std::string b64(const std::string& s) { return base64_encode(s); }

json put_request(const std::string& key, const std::string& value, std::int64_t lease) {
  json put = {{"key", b64(key)}, {"value", b64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  return put;
}

std::string txn_context(const std::string& key) { return "etcd txn on '" + key + "'"; }

CompareSetResult parse_txn(const json& resp, const std::string& key) {
  const std::string ctx = txn_context(key);
  CompareSetResult out;
  out.succeeded = detail::bool_field(resp, "succeeded", ctx);
  out.revision = detail::header_revision(resp, ctx);
  if (out.succeeded) return out;
  const json* responses = detail::array_field(resp, "responses", ctx);
  if (!responses || responses->size() != 1 || !(*responses)[0].is_object())
    throw ProtocolError(ctx + ": failed txn without its one range response");
  const json* range = detail::object_field((*responses)[0], "response_range", ctx);
  if (!range) throw ProtocolError(ctx + ": failed txn answered without response_range");
  // The inner header carries the revision only; parse_range wants a header.
  const json* kvs = detail::array_field(*range, "kvs", ctx);
  out.has_current = true;
  if (kvs && !kvs->empty()) {
    if (kvs->size() != 1) throw ProtocolError(ctx + ": range of one key returned several");
    out.current = detail::parse_key_value((*kvs)[0], ctx);
    if (out.current->key != key) throw ProtocolError(ctx + ": range returned another key");
  }
  return out;
}

json txn_request(const json& compare, const std::string& key, const std::string& desired,
                 std::int64_t lease) {
  return {{"compare", json::array({compare})},
          {"success", json::array({{{"request_put", put_request(key, desired, lease)}}})},
          {"failure", json::array({{{"request_range", {{"key", b64(key)}}}}})}};
}

json compare_revision(const std::string& key, std::int64_t mod_revision) {
  if (mod_revision == 0)
    return {{"key", b64(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
  return {{"key", b64(key)},
          {"target", "MOD"},
          {"result", "EQUAL"},
          {"mod_revision", std::to_string(mod_revision)}};
}

std::int64_t parse_counter(const KeyValue& kv) {
  std::int64_t v = 0;
  const auto& s = kv.value;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    throw ProtocolError("etcd add on '" + kv.key + "': the key holds '" + s.substr(0, 40) +
                        "', not a decimal integer");
  return v;
}

}  // namespace

EtcdClient::EtcdClient(const std::vector<std::string>& endpoints,
                       std::chrono::milliseconds read_timeout)
    : EtcdClient(endpoints, read_timeout, EtcdTls{}) {}

EtcdClient::EtcdClient(const std::vector<std::string>& endpoints,
                       std::chrono::milliseconds read_timeout, const EtcdTls& tls)
    : core_(std::make_shared<detail::ClientCore>()) {
  if (endpoints.empty()) throw ConfigError("etcd client needs at least one endpoint");
  if (read_timeout <= std::chrono::milliseconds(0))
    throw ConfigError("etcd client read timeout must be positive");
  for (const auto& e : endpoints) core_->endpoints.push_back(detail::parse_endpoint(e));
  core_->texts = endpoints;
  core_->read_timeout = read_timeout;
  if (tls.enabled) {
    core_->tls = detail::make_tls_context(tls.ca_file, tls.cert_file, tls.key_file);
  } else if (!tls.ca_file.empty() || !tls.cert_file.empty() || !tls.key_file.empty()) {
    throw ConfigError("etcd client: TLS files given but TLS is off");
  }
}

bool EtcdClient::tls() const { return core_->tls != nullptr; }

EtcdClient::~EtcdClient() = default;

const std::vector<std::string>& EtcdClient::endpoints() const { return core_->texts; }
std::chrono::milliseconds EtcdClient::read_timeout() const { return core_->read_timeout; }

std::uint64_t EtcdClient::exchanges() const { return core_->exchanges.load(); }

std::shared_ptr<detail::ClientCore> detail::core_of(const EtcdClient& client) {
  return client.core_;
}

std::optional<KeyValue> EtcdClient::get(const std::string& key) const {
  const std::string path = "/v3/kv/range";
  const json resp = core_->call(path, {{"key", b64(key)}}, true);
  RangeResult r = detail::parse_range(resp, "etcd get '" + key + "'");
  if (r.kvs.empty()) return std::nullopt;
  if (r.kvs.size() != 1 || r.kvs[0].key != key)
    throw ProtocolError("etcd get '" + key + "': answer holds other keys");
  return std::move(r.kvs[0]);
}

RangeResult EtcdClient::range_prefix(const std::string& prefix) const {
  const std::string start = prefix.empty() ? std::string(1, '\0') : prefix;
  const json resp = core_->call(
      "/v3/kv/range", {{"key", b64(start)}, {"range_end", b64(detail::prefix_end(prefix))}}, true);
  RangeResult r = detail::parse_range(resp, "etcd range '" + prefix + "'");
  for (const auto& kv : r.kvs) {
    if (kv.key.compare(0, prefix.size(), prefix) != 0)
      throw ProtocolError("etcd range '" + prefix + "': answer holds key '" + kv.key + "'");
  }
  return r;
}

std::int64_t EtcdClient::put(const std::string& key, const std::string& value,
                             std::int64_t lease) const {
  const json resp = core_->call("/v3/kv/put", put_request(key, value, lease), true);
  return detail::header_revision(resp, "etcd put '" + key + "'");
}

CompareSetResult EtcdClient::compare_set(const std::string& key,
                                         const std::optional<std::string>& expected,
                                         const std::string& desired, std::int64_t lease) const {
  const json compare = expected ? json{{"key", b64(key)},
                                       {"target", "VALUE"},
                                       {"result", "EQUAL"},
                                       {"value", b64(*expected)}}
                                : compare_revision(key, 0);
  return parse_txn(core_->call("/v3/kv/txn", txn_request(compare, key, desired, lease), true), key);
}

CompareSetResult EtcdClient::compare_set_revision(const std::string& key, std::int64_t mod_revision,
                                                  const std::string& desired,
                                                  std::int64_t lease) const {
  return parse_txn(
      core_->call("/v3/kv/txn",
                  txn_request(compare_revision(key, mod_revision), key, desired, lease), true),
      key);
}

std::int64_t EtcdClient::add(const std::string& key, std::int64_t delta, int max_attempts) const {
  std::optional<KeyValue> current = get(key);
  for (int attempt = 1; attempt <= max_attempts; ++attempt) {
    const std::int64_t old = current ? parse_counter(*current) : 0;
    std::int64_t updated = 0;
    if (__builtin_add_overflow(old, delta, &updated))
      throw ProtocolError("etcd add on '" + key + "': " + std::to_string(old) + " + " +
                          std::to_string(delta) + " overflows");
    // Not idempotent: replaying a txn that was applied would count twice.
    const json resp =
        core_->call("/v3/kv/txn",
                    txn_request(compare_revision(key, current ? current->mod_revision : 0), key,
                                std::to_string(updated), current ? current->lease : 0),
                    false);
    CompareSetResult r = parse_txn(resp, key);
    if (r.succeeded) return updated;
    current = std::move(r.current);
  }
  throw TimeoutError("etcd add on '" + key + "': lost " + std::to_string(max_attempts) +
                     " compare-and-set races in a row; too many concurrent writers");
}

std::int64_t EtcdClient::delete_prefix(const std::string& prefix) const {
  const std::string start = prefix.empty() ? std::string(1, '\0') : prefix;
  const json resp =
      core_->call("/v3/kv/deleterange",
                  {{"key", b64(start)}, {"range_end", b64(detail::prefix_end(prefix))}}, true);
  const std::string ctx = "etcd delete prefix '" + prefix + "'";
  detail::header_revision(resp, ctx);
  return detail::int_field(resp, "deleted", ctx);
}

bool EtcdClient::delete_key(const std::string& key) const {
  const json resp = core_->call("/v3/kv/deleterange", {{"key", b64(key)}}, true);
  const std::string ctx = "etcd delete '" + key + "'";
  detail::header_revision(resp, ctx);
  return detail::int_field(resp, "deleted", ctx) > 0;
}

Lease EtcdClient::lease_grant(std::chrono::seconds ttl) const {
  const json resp = core_->call("/v3/lease/grant", {{"TTL", std::to_string(ttl.count())}}, true);
  const std::string ctx = "etcd lease grant";
  detail::header_revision(resp, ctx);
  const std::string error = detail::string_field(resp, "error", ctx);
  if (!error.empty()) throw EtcdError(0, ctx + ": etcd refused: " + error);
  Lease lease{detail::int_field(resp, "ID", ctx), detail::int_field(resp, "TTL", ctx)};
  if (lease.id <= 0 || lease.ttl_s <= 0)
    throw ProtocolError(ctx + ": no lease ID or TTL in answer");
  return lease;
}

std::int64_t EtcdClient::lease_keepalive(std::int64_t lease_id,
                                         std::chrono::milliseconds member_budget) const {
  const json resp = core_->call("/v3/lease/keepalive", {{"ID", std::to_string(lease_id)}}, true,
                                true, member_budget);
  const std::string ctx = "etcd lease keepalive " + std::to_string(lease_id);
  const auto ttl = detail::int_field(resp, "TTL", ctx);
  const auto id = detail::int_field(resp, "ID", ctx);
  if (id != lease_id) throw ProtocolError(ctx + ": answer names lease " + std::to_string(id));
  return std::max<std::int64_t>(ttl, 0);
}

bool EtcdClient::lease_revoke(std::int64_t lease_id) const {
  try {
    const json resp = core_->call("/v3/lease/revoke", {{"ID", std::to_string(lease_id)}}, true);
    detail::header_revision(resp, "etcd lease revoke");
    return true;
  } catch (const EtcdError& e) {
    if (e.code() == 5) return false;  // NotFound: expired, or revoked already
    throw;
  }
}

void EtcdClient::compact(std::int64_t revision) const {
  const json resp = core_->call("/v3/kv/compaction",
                                {{"revision", std::to_string(revision)}, {"physical", true}}, true);
  detail::header_revision(resp, "etcd compaction");
}

MemberStatus EtcdClient::member_status(const std::string& endpoint) const {
  const auto it = std::find(core_->texts.begin(), core_->texts.end(), endpoint);
  if (it == core_->texts.end())
    throw ConfigError("etcd member_status: '" + endpoint + "' is not one of the endpoints");
  const std::size_t member = static_cast<std::size_t>(it - core_->texts.begin());
  const std::string path = "/v3/maintenance/status";
  Exchange ex = core_->exchange(member, path, "{}", false, Clock::now() + core_->read_timeout);
  switch (ex.kind) {
    case Exchange::Kind::kOk:
      break;
    case Exchange::Kind::kProtocol:
      throw ProtocolError(ex.what);
    case Exchange::Kind::kRefused:
      throw EtcdError(ex.code, ex.what);
    case Exchange::Kind::kTls:
      throw TlsError(ex.what);
    case Exchange::Kind::kRetry:
      throw IoError(core_->context(member, path) + ": " + ex.what);
  }
  const std::string ctx = core_->context(member, path);
  const json* header = detail::object_field(ex.answer, "header", ctx);
  if (!header) throw ProtocolError(ctx + ": no header");
  MemberStatus s;
  s.member_id = detail::uint_field(*header, "member_id", ctx);
  s.revision = detail::int_field(*header, "revision", ctx);
  s.leader_id = detail::uint_field(ex.answer, "leader", ctx);
  s.version = detail::string_field(ex.answer, "version", ctx);
  return s;
}

std::unique_ptr<Watch> EtcdClient::watch(const std::string& key, std::int64_t start_revision,
                                         bool prefix) const {
  auto impl = std::make_unique<detail::WatchImpl>(core_, key, prefix, start_revision);
  impl->start();
  return std::unique_ptr<Watch>(new Watch(std::move(impl)));
}

}  // namespace ctorchrun::etcd

#pragma once

// EtcdClient: a synchronous client of an etcd v3 cluster, speaking the v3 API
// through etcd's HTTP/JSON gateway (served on every member's client URL) with
// Boost.Beast over Boost.Asio; no gRPC.
//
// Members and failover. The client is given every member's client endpoint
// ("host:port", IPv6 as "[addr]:port"). A call goes to the member that last
// answered; when a member cannot be reached, does not answer within its share
// of the deadline (read_timeout / number of endpoints), or answers 5xx (etcd
// says "unavailable", e.g. during an election), the call moves on to the next
// member, round after round, until `read_timeout` has passed since the call
// began. Any member that answers serves: etcd forwards writes to the leader
// and serves linearizable reads (the default) on every member.
//
// Deadlines. Every request returns or throws within read_timeout (plus the
// time to notice it passed). Each call is one request, except add(): one read
// and then up to max_attempts transactions, each with its own read_timeout.
// One connection per request ("Connection: close"): simple and stateless;
// pooling would save a loopback handshake per call, which rendezvous traffic
// does not need. Over TLS each request also runs a full TLS handshake (no
// session resumption).
//
// Errors (see etcd/errors.h):
//  - IoError: no member answered within read_timeout. The message names every
//    endpoint tried and its last failure. Also thrown by a non-idempotent call
//    (add's transaction) whose request was sent but whose answer was lost:
//    its outcome is unknown, so it is not replayed on another member.
//  - ProtocolError: a member answered with something other than the
//    gateway's JSON (not HTTP, not JSON, a field of the wrong type, bad
//    base64); the message names the endpoint and the path. Not retried.
//  - EtcdError: a member refused the request (gRPC status other than
//    unavailable), e.g. a put on a lease that does not exist.
//  - TlsError: TLS with a member failed for good (see TLS below). Not retried.
// After any throw the client is as before: every request has its own
// connection, so nothing is left half-read.
//
// Idempotence. Reads, put, the deletes, the lease calls and compare_set are
// retried on another member after an ambiguous failure (request sent, answer
// lost). A compare_set that in fact succeeded before its answer was lost then
// reports failure with `current` holding the value it wrote; callers that
// must know compare `current->value` with their desired value. add() is not
// retried after an ambiguous failure (IoError instead), so it never counts twice.
//
// TLS (EtcdTls): with `enabled`, every connection to every member, watches
// included, runs TLS 1.2 or later over its TCP connection. The member's
// certificate must chain to `ca_file` (empty: OpenSSL's default trust store,
// the system's CA certificates) and name the endpoint's host (a DNS name, also
// sent as SNI) or IP address (an IP SAN); `cert_file` and `key_file` (PEM, both
// or neither) are the client certificate for members that demand one
// (etcd --client-cert-auth). The files are read once, by the constructor
// (ConfigError naming the file and OpenSSL's reason when one is unreadable or
// not what it should be); one TLS context serves every connection of the
// client. A verification failure, a member refusing the client certificate,
// or a member that does not speak TLS is a TlsError (a ConfigError), thrown at
// once rather than retried on other members: in practice the CA, the
// certificates or the scheme are wrong for the whole cluster.
//
// Thread safety: every method may be called from many threads at once.
//
// etcd facts relied on (checked with etcd 3.4): the gateway answers POST
// /v3/kv/{range,put,txn,deleterange,compaction}, /v3/lease/{grant,keepalive,
// revoke}, /v3/maintenance/status and the streaming /v3/watch; keys and
// values are base64; 64-bit integers are JSON strings; zero-valued fields are
// omitted (a failed txn has no "succeeded"; a put event has no "type"); a
// keepalive for an unknown lease answers with no TTL; errors come back as
// HTTP 4xx/5xx with {"error","message","code"} where code is the gRPC code;
// a member cut off from the quorum answers only after about 6 s (a put with
// HTTP 500 "context deadline exceeded", a read with 503 "request timed out"),
// which is why each member gets only a share of the deadline.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "etcd/errors.h"
#include "etcd/types.h"
#include "etcd/watch.h"

namespace ctorchrun::etcd {

class EtcdClient;
namespace detail {
struct ClientCore;
// The client's shared state, for the rest of etcd/ (client_internal.h).
std::shared_ptr<ClientCore> core_of(const EtcdClient& client);
}  // namespace detail

// TLS settings of a client (see above); default: plain http.
struct EtcdTls {
  bool enabled = false;
  std::string ca_file;    // PEM CA certificate(s); empty: the default trust store
  std::string cert_file;  // PEM client certificate (chain), with key_file
  std::string key_file;   // PEM private key of cert_file
};

class EtcdClient {
 public:
  static constexpr std::chrono::milliseconds kDefaultReadTimeout{5000};
  static constexpr int kDefaultAddAttempts = 64;

  // Throws ConfigError when `endpoints` is empty or one is not host:port.
  // Connects to nothing until the first call.
  explicit EtcdClient(const std::vector<std::string>& endpoints,
                      std::chrono::milliseconds read_timeout = kDefaultReadTimeout);
  // Same, with TLS as `tls` says; also throws ConfigError when a TLS file
  // cannot be read or used.
  EtcdClient(const std::vector<std::string>& endpoints, std::chrono::milliseconds read_timeout,
             const EtcdTls& tls);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  const std::vector<std::string>& endpoints() const;
  std::chrono::milliseconds read_timeout() const;
  // Whether the client speaks TLS with the members.
  bool tls() const;
  // Requests begun so far, one per attempt on one member (watch streams not
  // counted): what the calls through this client cost on the wire.
  std::uint64_t exchanges() const;

  // The key and its metadata, or nullopt when absent.
  std::optional<KeyValue> get(const std::string& key) const;
  // Every key starting with `prefix` ("" = all keys), sorted, with the store
  // revision at which they were read (a watch from revision+1 misses nothing).
  RangeResult range_prefix(const std::string& prefix) const;
  // Sets `key`; attached to `lease` when non-zero (EtcdError code 5 when that
  // lease does not exist). Returns the new revision.
  std::int64_t put(const std::string& key, const std::string& value, std::int64_t lease = 0) const;

  // One transaction: if `key` holds `expected` (nullopt: if it is absent),
  // set it to `desired`; otherwise return its current state in the same
  // round trip (etcd's failure branch carries a range request).
  CompareSetResult compare_set(const std::string& key, const std::optional<std::string>& expected,
                               const std::string& desired, std::int64_t lease = 0) const;
  // Same, comparing the key's mod_revision (0: the key must be absent,
  // checked as create_revision == 0).
  CompareSetResult compare_set_revision(const std::string& key, std::int64_t mod_revision,
                                        const std::string& desired, std::int64_t lease = 0) const;

  // Adds `delta` to the decimal integer stored at `key` (absent reads as 0)
  // with a compare-and-set loop on mod_revision; returns the new value.
  // Concurrent adds each see a distinct result. Throws TimeoutError after
  // `max_attempts` lost races, ProtocolError when the key holds no integer.
  std::int64_t add(const std::string& key, std::int64_t delta,
                   int max_attempts = kDefaultAddAttempts) const;

  // Deletes every key starting with `prefix` ("" = all); returns how many.
  std::int64_t delete_prefix(const std::string& prefix) const;
  // Deletes one key; returns whether it existed.
  bool delete_key(const std::string& key) const;

  // Grants a lease of `ttl` seconds (etcd raises TTLs below its minimum,
  // about 1.5 x election timeout, rounded up to whole seconds).
  Lease lease_grant(std::chrono::seconds ttl) const;
  // Refreshes a lease once; returns its TTL in seconds, or 0 when the lease
  // has expired or was revoked (etcd answers without a TTL). `member_budget`
  // (when positive) is the most one member gets before the next is tried,
  // if below the usual share of the read timeout: a keeper refreshing every
  // TTL/3 must not spend a whole TTL on one hung member.
  std::int64_t lease_keepalive(std::int64_t lease_id, std::chrono::milliseconds member_budget =
                                                          std::chrono::milliseconds(0)) const;
  // Revokes a lease, deleting its keys; false when it did not exist.
  bool lease_revoke(std::int64_t lease_id) const;

  // Discards history before `revision` (watches from older revisions then
  // fail with WatchCompactedError).
  void compact(std::int64_t revision) const;
  // Status of one member (one of endpoints()), asked of that member alone.
  MemberStatus member_status(const std::string& endpoint) const;

  // Watches `key` (or every key starting with it when `prefix`) from
  // `start_revision` (0: from the next change). The watch is created on some
  // member before this returns (IoError when none answers in read_timeout).
  // See etcd/watch.h.
  std::unique_ptr<Watch> watch(const std::string& key, std::int64_t start_revision,
                               bool prefix = false) const;

 private:
  friend std::shared_ptr<detail::ClientCore> detail::core_of(const EtcdClient& client);
  std::shared_ptr<detail::ClientCore> core_;
};

}  // namespace ctorchrun::etcd

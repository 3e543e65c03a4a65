#pragma once

// Errors of the etcd client beyond the shared ones of common/error.h.
//
// The client throws (see etcd/client.h for which call throws what):
//  - IoError: no member answered within the call's deadline (the message names
//    every endpoint tried and what went wrong with each), or a non-idempotent
//    request was sent and its answer lost, so its outcome is unknown;
//  - ProtocolError: a member answered with bytes that are not the etcd v3 JSON
//    gateway's (the message names the endpoint and the path);
//  - EtcdError: a member answered with a well-formed refusal (a gRPC status
//    other than "unavailable", such as an invalid argument or a missing lease);
//  - WatchCompactedError: a watch asked for history etcd has compacted away;
//  - TlsError (a ConfigError): TLS with a member failed in a way that no
//    retry mends: its certificate did not verify (untrusted, expired, not
//    naming the endpoint), it refused the client's certificate or wanted one,
//    or it does not speak TLS. Not retried on other members: in practice the
//    CA, the certificates or the scheme are wrong for the whole cluster.
//  - ConfigError: bad endpoints, or TLS files that cannot be read or used
//    (thrown by the constructor, naming the file and OpenSSL's reason).

#include <cstdint>
#include <string>

#include "common/error.h"

namespace ctorchrun::etcd {

class EtcdError : public Error {
 public:
  // `code` is the gRPC status code etcd gave (3 invalid argument, 5 not found...).
  EtcdError(int code, const std::string& message) : Error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

class WatchCompactedError : public Error {
 public:
  WatchCompactedError(std::int64_t compact_revision, const std::string& message)
      : Error(message), compact_revision_(compact_revision) {}
  // The oldest revision etcd still holds; a new watch may start there.
  std::int64_t compact_revision() const { return compact_revision_; }

 private:
  std::int64_t compact_revision_;
};

class TlsError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

}  // namespace ctorchrun::etcd

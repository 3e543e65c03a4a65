#pragma once

// Internal to etcd/: what EtcdClient and its watches share: the members, the
// deadline, and one request/answer exchange with one member.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "etcd/http_internal.h"

namespace ctorchrun::etcd::detail {

// The result of one exchange with one member.
struct Exchange {
  enum class Kind {
    kOk,        // `answer` holds the JSON object (a stream's first "result")
    kRetry,     // the member did not answer usefully; another may
    kProtocol,  // the member answered nonsense
    kRefused,   // the member answered with an etcd error (`code`)
    kTls,       // TLS failed in a way no retry mends (StepError::Kind::kTls)
  };
  Kind kind = Kind::kRetry;
  nlohmann::json answer;
  std::string what;     // for everything but kOk
  int code = 0;         // gRPC code for kRefused
  bool sent = false;    // the request reached the wire (kRetry: outcome unknown)
  bool applied = true;  // for kRetry after `sent`: false when surely not applied
};

struct ClientCore {
  std::vector<Endpoint> endpoints;
  std::vector<std::string> texts;
  std::chrono::milliseconds read_timeout{0};
  // TLS with every member when set; shared by every connection and watch.
  std::shared_ptr<boost::asio::ssl::context> tls;
  mutable std::atomic<std::size_t> preferred{0};
  // Exchanges begun (EtcdClient::exchanges()).
  mutable std::atomic<std::uint64_t> exchanges{0};

  // Time one member gets before the next is tried.
  std::chrono::milliseconds attempt_budget() const;
  // "etcd 127.0.0.1:2379 /v3/kv/range", the prefix of every message.
  std::string context(std::size_t member, const std::string& path) const;

  // One POST to one member. `streamed`: the answer is a stream of
  // {"result":...} / {"error":...} objects, of which the first counts.
  Exchange exchange(std::size_t member, const std::string& path, const std::string& body,
                    bool streamed, Clock::time_point deadline) const;

  // POSTs to members in turn (see client.h) and returns the first answer.
  // `member_budget` (when positive) caps the time one member gets, below
  // attempt_budget(): for calls that must move on from a hung member sooner.
  nlohmann::json call(const std::string& path, const nlohmann::json& body, bool idempotent,
                      bool streamed = false,
                      std::chrono::milliseconds member_budget = std::chrono::milliseconds(0)) const;
};

}  // namespace ctorchrun::etcd::detail

#pragma once

// Internal to etcd/: the state behind a Watch (see etcd/watch.h).
//
// States: no stream (conn_ empty) -> establish() connects to a member and
// sends the create request from next_rev_ -> streaming (messages parsed as
// they arrive; "created" sets created_, events queue up, "canceled" with a
// compact revision sets compacted_) -> on EOF, reset or an "unavailable"
// error message, back to no stream on the next member.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "etcd/client_internal.h"
#include "etcd/types.h"

namespace ctorchrun::etcd::detail {

class WatchImpl {
 public:
  WatchImpl(std::shared_ptr<const ClientCore> core, std::string key, bool prefix,
            std::int64_t start_revision);

  // Creates the watch on some member within read_timeout, waiting for etcd's
  // "created". Throws IoError, ProtocolError, EtcdError.
  void start();
  std::optional<WatchEvent> next(Clock::time_point deadline);

  std::int64_t next_revision() const { return next_rev_; }
  std::string endpoint() const { return conn_ ? core_->texts[member_] : std::string(); }
  bool compacted() const { return compacted_; }

 private:
  // One step: (re)establish the stream, handle buffered messages, or read.
  // Returns false when the deadline passed while waiting for bytes.
  bool pump(Clock::time_point deadline);
  void establish(Clock::time_point deadline);
  void handle(const std::string& message);
  void lose(const std::string& why);
  [[noreturn]] void throw_compacted() const;
  std::string ctx() const;

  std::shared_ptr<const ClientCore> core_;
  std::string key_;
  std::string range_end_;  // empty for a single key
  std::unique_ptr<HttpConnection> conn_;
  std::size_t member_ = 0;
  bool created_ = false;
  bool compacted_ = false;
  std::int64_t compact_revision_ = 0;
  std::int64_t next_rev_ = 0;  // 0 until known: "from the next change"
  std::deque<WatchEvent> queue_;
  std::string last_loss_;
};

}  // namespace ctorchrun::etcd::detail

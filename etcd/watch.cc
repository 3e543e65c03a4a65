#include "etcd/watch.h"

#include <algorithm>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"
#include "etcd/base64.h"
#include "etcd/errors.h"
#include "etcd/response_internal.h"
#include "etcd/watch_internal.h"

namespace ctorchrun::etcd {

namespace detail {

WatchImpl::WatchImpl(std::shared_ptr<const ClientCore> core, std::string key, bool prefix,
                     std::int64_t start_revision)
    : core_(std::move(core)),
      key_(std::move(key)),
      member_(core_->preferred.load()),
      next_rev_(std::max<std::int64_t>(start_revision, 0)) {
  if (prefix) {
    range_end_ = prefix_end(key_);
    if (key_.empty()) key_ = std::string(1, '\0');
  }
}

std::string WatchImpl::ctx() const {
  return core_->context(member_, "/v3/watch") + " on '" + key_ + "'";
}

void WatchImpl::start() {
  const auto deadline = Clock::now() + core_->read_timeout;
  while (!created_ && !compacted_) {
    if (!pump(deadline))
      throw IoError(ctx() + ": watch not created within " + format_duration(core_->read_timeout));
  }
}

std::optional<WatchEvent> WatchImpl::next(Clock::time_point deadline) {
  for (;;) {
    if (!queue_.empty()) {
      WatchEvent e = std::move(queue_.front());
      queue_.pop_front();
      return e;
    }
    if (compacted_) throw_compacted();
    if (!pump(deadline)) return std::nullopt;
  }
}

void WatchImpl::throw_compacted() const {
  throw WatchCompactedError(compact_revision_, "etcd watch on '" + key_ + "' from revision " +
                                                   std::to_string(next_rev_) +
                                                   ": history compacted up to revision " +
                                                   std::to_string(compact_revision_));
}

bool WatchImpl::pump(Clock::time_point deadline) {
  if (!conn_) {
    establish(deadline);
    return true;
  }
  auto messages = take_objects(conn_->body(), ctx());
  if (!messages.empty()) {
    for (const auto& m : messages) {
      handle(m);
      if (!conn_) break;  // lost or canceled; the rest is moot
    }
    return true;
  }
  if (conn_->done()) {
    lose("the stream ended");
    return true;
  }
  const StepError e = conn_->read_more(deadline);
  if (!e) return true;
  switch (e.kind) {
    case StepError::Kind::kTimeout:
      return false;
    case StepError::Kind::kProtocol:
      throw ProtocolError(ctx() + ": " + e.what);
    case StepError::Kind::kTls:
      throw TlsError(ctx() + ": " + e.what);
    default:
      lose(e.what);
      return true;
  }
}

void WatchImpl::lose(const std::string& why) {
  get_logger("etcd")->warn("watch key={} lost its stream on {} ({}); resuming from revision {}",
                           key_, core_->texts[member_], why, next_rev_);
  last_loss_ = core_->texts[member_] + " (" + why + ")";
  conn_.reset();
  member_ = (member_ + 1) % core_->endpoints.size();
}

// Tries the members in turn, from member_, until one accepts the watch or
// the deadline passes (IoError naming each member's failure).
void WatchImpl::establish(Clock::time_point deadline) {
  json create = {{"key", base64_encode(key_)}};
  if (!range_end_.empty()) create["range_end"] = base64_encode(range_end_);
  if (next_rev_ > 0) create["start_revision"] = std::to_string(next_rev_);
  const std::string body = json_text::dump_record(json{{"create_request", create}});
  const std::string path = "/v3/watch";
  const std::size_t n = core_->endpoints.size();
  std::vector<std::string> errors(n, "not tried");
  if (!last_loss_.empty()) errors[(member_ + n - 1) % n] = last_loss_;
  for (std::size_t attempt = 0;; ++attempt) {
    if (attempt > 0 && attempt % n == 0) {
      const auto pause =
          std::min<Clock::duration>(std::chrono::milliseconds(50), deadline - Clock::now());
      if (pause > Clock::duration::zero()) std::this_thread::sleep_for(pause);
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    const auto attempt_deadline = std::min(deadline, now + core_->attempt_budget());
    const std::string where = core_->context(member_, path);
    auto conn = std::make_unique<HttpConnection>(core_->tls.get());
    StepError e = conn->connect(core_->endpoints[member_], attempt_deadline);
    if (!e) e = conn->post(path, body, attempt_deadline);
    while (!e && !conn->header_done()) e = conn->read_more(attempt_deadline);
    if (!e && conn->status() != 200) {
      e = conn->read_all(attempt_deadline);
      if (!e) {
        int code = 0;
        std::string msg;
        const unsigned status = conn->status();
        if (!parse_error_body(conn->body(), code, msg)) {
          if (status < 500)
            throw ProtocolError(where + ": unexpected HTTP " + std::to_string(status));
          msg = "HTTP " + std::to_string(status);
        } else if (status < 500 && code != 14 && code != 4) {
          throw EtcdError(code, where + ": etcd refused the watch: " + msg);
        }
        e = {StepError::Kind::kClosed, msg};
      }
    }
    if (!e) {
      conn_ = std::move(conn);
      core_->preferred.store(member_);
      return;
    }
    if (e.kind == StepError::Kind::kProtocol) throw ProtocolError(where + ": " + e.what);
    if (e.kind == StepError::Kind::kTls) throw TlsError(where + ": " + e.what);
    errors[member_] = e.what;
    member_ = (member_ + 1) % n;
  }
  std::string msg = "etcd watch on '" + key_ + "' from revision " + std::to_string(next_rev_) +
                    ": no member took the watch before the deadline:";
  for (std::size_t i = 0; i < n; ++i)
    msg += (i ? ", " : " ") + core_->texts[i] + " (" + errors[i] + ")";
  throw IoError(msg);
}

void WatchImpl::handle(const std::string& message) {
  const std::string where = ctx();
  const json j = parse_object(message, where);
  if (const json* err = object_field(j, "error", where)) {
    const auto grpc = int_field(*err, "grpc_code", where);
    const auto http = int_field(*err, "http_code", where);
    const std::string msg = string_field(*err, "message", where);
    // Unavailable, deadline exceeded, a server error, or cancelled by a
    // member that shuts down ("grpc: the client connection is closing"):
    // that member is gone, the watch goes on at another.
    if (grpc == 14 || grpc == 4 || grpc == 1 || http >= 500) {
      lose("unavailable: " + msg);
      return;
    }
    throw EtcdError(static_cast<int>(grpc), where + ": etcd ended the watch: " + msg);
  }
  const json* result = object_field(j, "result", where);
  if (!result) throw ProtocolError(where + ": message has neither result nor error");
  const json* header = object_field(*result, "header", where);
  if (!header) throw ProtocolError(where + ": message has no header");
  const std::int64_t revision = int_field(*header, "revision", where);
  if (bool_field(*result, "created", where)) {
    created_ = true;
    if (next_rev_ == 0) next_rev_ = revision + 1;
  }
  if (bool_field(*result, "canceled", where)) {
    const auto compact = int_field(*result, "compact_revision", where);
    conn_.reset();
    if (compact > 0) {
      compacted_ = true;
      compact_revision_ = compact;
      return;
    }
    throw EtcdError(
        0, where + ": etcd canceled the watch: " + string_field(*result, "cancel_reason", where));
  }
  const json* events = array_field(*result, "events", where);
  if (!events) return;
  // Events below next_rev_ were delivered before a failover; a resumed
  // stream starts at next_rev_, so this only guards against a member that
  // replays more than asked.
  const std::int64_t floor = next_rev_;
  std::int64_t highest = 0;
  for (const auto& ev : *events) {
    if (!ev.is_object()) throw ProtocolError(where + ": an event is not an object");
    WatchEvent out;
    const std::string type = string_field(ev, "type", where);
    if (type.empty() || type == "PUT") {
      out.type = WatchEvent::Type::kPut;
    } else if (type == "DELETE") {
      out.type = WatchEvent::Type::kDelete;
    } else {
      throw ProtocolError(where + ": unknown event type '" + type + "'");
    }
    const json* kv = object_field(ev, "kv", where);
    if (!kv) throw ProtocolError(where + ": event without kv");
    out.kv = parse_key_value(*kv, where);
    if (out.kv.mod_revision < floor) continue;
    highest = std::max(highest, out.kv.mod_revision);
    queue_.push_back(std::move(out));
  }
  if (highest > 0) next_rev_ = std::max(next_rev_, highest + 1);
}

}  // namespace detail

Watch::Watch(std::unique_ptr<detail::WatchImpl> impl) : impl_(std::move(impl)) {}
Watch::~Watch() = default;

std::optional<WatchEvent> Watch::next(std::chrono::steady_clock::time_point deadline) {
  return impl_->next(deadline);
}
std::int64_t Watch::next_revision() const { return impl_->next_revision(); }
std::string Watch::endpoint() const { return impl_->endpoint(); }
bool Watch::compacted() const { return impl_->compacted(); }

}  // namespace ctorchrun::etcd

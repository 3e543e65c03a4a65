#include "store/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "store/store_errors.h"

namespace ctorchrun::store {

using protocol::Dialect;
using protocol::Op;
using Clock = std::chrono::steady_clock;

namespace {

// A reply length beyond this is a broken or hostile server, not a value.
constexpr uint64_t kMaxReplyBytes = uint64_t{1} << 32;
constexpr uint32_t kProbeNonce = 0xFFFFFFFF;
// set() has no reply, so a set() the server refused over a size limit shows
// only as a closed connection on the next call: say so.
constexpr const char* kClosedHint =
    " (the server closed the connection; if an earlier set, append or multi_set passed its "
    "size limits, the server's log names the key and the limit)";

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

std::string wire_key(const std::string& key) { return "/" + key; }

}  // namespace

// One TCP connection with deadline-bounded I/O. Errors: IoError (closed,
// reset), TimeoutError (deadline).
class TcpStore::Conn {
 public:
  Conn(const std::string& host, uint16_t port, Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0) throw IoError("cannot resolve store host '" + host + "': " + gai_strerror(rc));
    std::string last_error = "no address";
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      int fd =
          ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) {
        last_error = std::strerror(errno);
        continue;
      }
      int err = 0;
      if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          int n = ::poll(&p, 1, remaining_ms(deadline));
          if (n <= 0) {
            err = ETIMEDOUT;
          } else {
            socklen_t len = sizeof err;
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          }
        }
      }
      if (err == 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fd_ = fd;
        break;
      }
      last_error = std::strerror(err);
      ::close(fd);
    }
    freeaddrinfo(res);
    if (fd_ < 0) throw IoError(last_error);
  }
  ~Conn() {
    if (fd_ >= 0) ::close(fd_);
  }

  void send_all(const char* data, size_t size, Clock::time_point deadline) {
    while (size > 0) {
      ssize_t n = ::send(fd_, data, size, MSG_NOSIGNAL);
      if (n > 0) {
        data += n;
        size -= static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_for(POLLOUT, deadline);
        continue;
      }
      int err = errno;
      throw IoError(std::string("send failed: ") + std::strerror(err) +
                    (err == EPIPE || err == ECONNRESET ? kClosedHint : ""));
    }
  }

  void read_exact(char* data, size_t size, Clock::time_point deadline) {
    while (size > 0) {
      ssize_t n = ::recv(fd_, data, size, 0);
      if (n > 0) {
        data += n;
        size -= static_cast<size_t>(n);
        continue;
      }
      if (n == 0) throw IoError(std::string("connection closed by the server") + kClosedHint);
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_for(POLLIN, deadline);
        continue;
      }
      int err = errno;
      throw IoError(std::string("receive failed: ") + std::strerror(err) +
                    (err == ECONNRESET ? kClosedHint : ""));
    }
  }

  int fd() const { return fd_; }

  uint8_t read_u8(Clock::time_point deadline) {
    char c;
    read_exact(&c, 1, deadline);
    return static_cast<uint8_t>(c);
  }
  int64_t read_i64(Clock::time_point deadline) {
    char b[8];
    read_exact(b, 8, deadline);
    return protocol::read_i64(b);
  }
  uint32_t read_u32(Clock::time_point deadline) {
    char b[4];
    read_exact(b, 4, deadline);
    return protocol::read_u32(b);
  }
  std::string read_bytes(Clock::time_point deadline) {
    char b[8];
    read_exact(b, 8, deadline);
    uint64_t n = protocol::read_u64(b);
    if (n > kMaxReplyBytes) {
      throw ProtocolError("the server announced a reply of " + std::to_string(n) + " bytes");
    }
    std::string out(static_cast<size_t>(n), '\0');
    read_exact(out.data(), out.size(), deadline);
    return out;
  }

 private:
  void wait_for(short events, Clock::time_point deadline) {
    pollfd p{fd_, events, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n == 0) throw TimeoutError("no reply before the deadline");
    if (n < 0 && errno != EINTR) throw IoError(std::string("poll failed: ") + std::strerror(errno));
  }

  int fd_ = -1;
};

TcpStore::TcpStore(TcpStoreOptions options) : options_(std::move(options)) {
  timeout_ = options_.timeout;
  std::lock_guard<std::mutex> lock(mutex_);
  connect_and_settle(Clock::now() + options_.connect_timeout);
}

TcpStore::~TcpStore() = default;

std::string TcpStore::where() const {
  return "store " + options_.host + ":" + std::to_string(options_.port);
}

void TcpStore::drop_connection() {
  std::lock_guard<std::mutex> lock(fd_mutex_);
  live_fd_ = -1;
  conn_.reset();
}

void TcpStore::interrupt() noexcept {
  std::lock_guard<std::mutex> lock(fd_mutex_);
  interrupted_ = true;
  if (live_fd_ >= 0) ::shutdown(live_fd_, SHUT_RDWR);
}

void TcpStore::ensure_connected(Clock::time_point deadline) {
  if (!conn_) connect_and_settle(deadline);
}

void TcpStore::connect_and_settle(Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error;
  const auto start = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(fd_mutex_);
      if (interrupted_) throw IoError("the connection to " + where() + " was interrupted");
    }
    try {
      auto conn = std::make_unique<Conn>(options_.host, options_.port, deadline);
      Dialect want = dialect_;
      if (want == Dialect::kUnknown) {
        if (options_.dialect == ClientDialect::kV113) want = Dialect::kV113;
        if (options_.dialect == ClientDialect::kV2) want = Dialect::kV2;
      }
      if (want == Dialect::kV2 || want == Dialect::kUnknown) {
        // VALIDATE, then PING; a v2 server echoes the nonce.
        uint32_t nonce = want == Dialect::kV2 ? static_cast<uint32_t>(::getpid()) : kProbeNonce;
        std::string hello;
        protocol::put_u8(&hello, 0x00);
        protocol::put_u32(&hello, protocol::kValidationMagic);
        protocol::put_u8(&hello, *protocol::encode_opcode(Dialect::kV2, Op::kPing));
        protocol::put_u32(&hello, nonce);
        conn->send_all(hello.data(), hello.size(), deadline);
        try {
          uint32_t echo = conn->read_u32(deadline);
          if (echo != nonce) throw ProtocolError("PING answered with a different nonce");
          dialect_ = Dialect::kV2;
        } catch (const IoError&) {
          if (want == Dialect::kV2) throw;
          // A torch 1.13 server resets the connection on these bytes.
          dialect_ = Dialect::kV113;
          conn = std::make_unique<Conn>(options_.host, options_.port, deadline);
        }
      } else {
        dialect_ = Dialect::kV113;
      }
      {
        std::lock_guard<std::mutex> lock(fd_mutex_);
        if (!interrupted_) {
          live_fd_ = conn->fd();
          conn_ = std::move(conn);
        }
      }
      if (!conn_) continue;  // interrupted meanwhile: the check above throws, no backoff
      if (bind_keys_) send_bind_keys(deadline);
      return;
    } catch (const NotSupportedError&) {
      throw;
    } catch (const IoError& e) {
      last_error = e.what();
    } catch (const TimeoutError& e) {
      last_error = e.what();
    }
    if (Clock::now() + backoff >= deadline) {
      auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
      throw TimeoutError("could not connect to " + where() + " within " +
                         std::to_string(waited.count()) + "ms: " + last_error +
                         "; check that the store server runs and the address is reachable");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

void TcpStore::begin(std::string* out, Op op) const {
  auto code = protocol::encode_opcode(dialect_, op);
  if (!code) {
    throw ProtocolError(std::string(protocol::to_string(op)) + " is not supported by " + where() +
                        " (a torch 1.13 server)");
  }
  protocol::put_u8(out, *code);
}

void TcpStore::send_request(const std::string& request, Clock::time_point deadline,
                            const char* what, const std::string& key) {
  try {
    ensure_connected(deadline);
    conn_->send_all(request.data(), request.size(), deadline);
  } catch (const Error& e) {
    drop_connection();
    throw IoError(std::string(what) + " of key '" + detail::printable(key) + "' on " + where() +
                  " failed: " + e.what());
  }
}

// Runs `body` (which reads the reply), turning failures into errors that name
// the operation, and dropping the connection since its framing is now unknown.
template <typename ConnPtr, typename F>
static auto guarded(const std::string& where, const char* what, const std::string& key,
                    ConnPtr& conn, F body) -> decltype(body()) {
  try {
    return body();
  } catch (const TimeoutError& e) {
    conn.reset();
    throw TimeoutError(std::string(what) + " of key '" + detail::printable(key) + "' on " + where +
                       " timed out: " + e.what());
  } catch (const ProtocolError& e) {
    conn.reset();
    throw ProtocolError(std::string(what) + " of key '" + detail::printable(key) + "' on " + where +
                        ": " + e.what());
  } catch (const IoError& e) {
    conn.reset();
    throw IoError(std::string(what) + " of key '" + detail::printable(key) + "' on " + where +
                  " failed: " + e.what());
  }
}

void TcpStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kSet);
  protocol::put_bytes(&req, wire_key(key));
  protocol::put_bytes(&req, value);
  send_request(req, deadline, "set", key);
}

std::string TcpStore::get_locked(const std::string& wk) {
  wait_locked({wk}, timeout_);
  auto deadline = Clock::now() + timeout_;
  std::string req;
  begin(&req, Op::kGet);
  protocol::put_bytes(&req, wk);
  send_request(req, deadline, "get", wk);
  return guarded(where(), "get", wk, conn_, [&] { return conn_->read_bytes(deadline); });
}

std::string TcpStore::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_connected(Clock::now() + timeout_);
  return get_locked(wire_key(key));
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kAdd);
  protocol::put_bytes(&req, wire_key(key));
  protocol::put_i64(&req, delta);
  send_request(req, deadline, "add", key);
  return guarded(where(), "add", key, conn_, [&] {
    try {
      return conn_->read_i64(deadline);
    } catch (const IoError&) {
      // torch's servers close the connection when the value is not a number.
      throw IoError(
          "connection closed by the server (is the stored value an integer? torch's servers "
          "close the connection on add() to a non-numeric value)");
    }
  });
}

std::string TcpStore::compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kCompareSet);
  protocol::put_bytes(&req, wire_key(key));
  protocol::put_bytes(&req, expected);
  protocol::put_bytes(&req, desired);
  send_request(req, deadline, "compare_set", key);
  return guarded(where(), "compare_set", key, conn_, [&] { return conn_->read_bytes(deadline); });
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> wire;
  wire.reserve(keys.size());
  for (const auto& k : keys) wire.push_back(wire_key(k));
  std::lock_guard<std::mutex> lock(mutex_);
  ensure_connected(Clock::now() + timeout);
  wait_locked(wire, timeout);
}

void TcpStore::wait_locked(const std::vector<std::string>& wire_keys,
                           std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  std::string req;
  begin(&req, Op::kWait);
  protocol::put_u64(&req, wire_keys.size());
  for (const auto& k : wire_keys) protocol::put_bytes(&req, k);
  const std::string first = wire_keys.empty() ? std::string() : wire_keys.front();
  send_request(req, deadline, "wait", first);
  uint8_t reply = 0;
  try {
    reply = conn_->read_u8(deadline);
  } catch (const TimeoutError&) {
    if (dialect_ == Dialect::kV2) {
      // Cancel on the wire; a STOP_WAITING may already be on its way.
      guarded(where(), "wait", first, conn_, [&] {
        auto cancel_deadline =
            Clock::now() + std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(10));
        std::string cancel;
        begin(&cancel, Op::kCancelWait);
        conn_->send_all(cancel.data(), cancel.size(), cancel_deadline);
        uint8_t r = conn_->read_u8(cancel_deadline);
        if (r == static_cast<uint8_t>(protocol::WaitResponse::kStopWaiting)) {
          r = conn_->read_u8(cancel_deadline);
        }
        if (r != static_cast<uint8_t>(protocol::WaitResponse::kWaitCanceled)) {
          throw ProtocolError("unexpected reply " + std::to_string(r) + " to CANCEL_WAIT");
        }
        return 0;
      });
    } else {
      // No cancel in v113: a late STOP_WAITING would desynchronise this
      // connection, so drop it.
      drop_connection();
    }
    throw TimeoutError(detail::wait_timeout_message(where(), wire_keys, timeout));
  } catch (const Error& e) {
    drop_connection();
    throw IoError("wait for key '" + detail::printable(first) + "' on " + where() +
                  " failed: " + e.what());
  }
  if (reply != static_cast<uint8_t>(protocol::WaitResponse::kStopWaiting)) {
    drop_connection();
    throw ProtocolError("wait on " + where() + ": unexpected reply " + std::to_string(reply));
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kCheck);
  protocol::put_u64(&req, keys.size());
  for (const auto& k : keys) protocol::put_bytes(&req, wire_key(k));
  const std::string first = keys.empty() ? std::string() : keys.front();
  send_request(req, deadline, "check", first);
  uint8_t r = guarded(where(), "check", first, conn_, [&] { return conn_->read_u8(deadline); });
  return r == static_cast<uint8_t>(protocol::CheckResponse::kReady);
}

int64_t TcpStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kGetNumKeys);
  send_request(req, deadline, "num_keys", "");
  return guarded(where(), "num_keys", "", conn_, [&] { return conn_->read_i64(deadline); });
}

bool TcpStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kDeleteKey);
  protocol::put_bytes(&req, wire_key(key));
  send_request(req, deadline, "delete_key", key);
  return guarded(where(), "delete_key", key, conn_, [&] { return conn_->read_i64(deadline); }) > 0;
}

void TcpStore::append(const std::string& key, const std::string& value) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  if (dialect_ == Dialect::kV2) {
    std::string req;
    begin(&req, Op::kAppend);
    protocol::put_bytes(&req, wire_key(key));
    protocol::put_bytes(&req, value);
    send_request(req, deadline, "append", key);
    return;
  }
  lock.unlock();
  // 1.13 has no APPEND. A compare_set loop is not enough: a compare_set that
  // finds its own desired bytes cannot tell whether it stored them or another
  // appender with the same bytes did, and one of the two appends is lost.
  // So appenders take a lock: the one whose add() returns 1 holds it, and
  // delete_key() releases it (the next add() starts again from 1).
  const std::string lock_key = key + kAppendLockSuffix;
  auto backoff = std::chrono::microseconds(100);
  while (add(lock_key, 1) != 1) {
    if (Clock::now() > deadline) {
      throw TimeoutError("append to key '" + detail::printable(key) + "' on " + where() +
                         " could not take the lock key '" + detail::printable(lock_key) +
                         "' within " + std::to_string(timeout_.count()) +
                         "ms (a client that died while appending leaves it held; delete it)");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(20'000));
  }
  try {
    std::string current = check({key}) ? get(key) : std::string();
    set(key, current + value);
  } catch (...) {
    try {
      delete_key(lock_key);
    } catch (const Error&) {
      // The first error is the one to report.
    }
    throw;
  }
  delete_key(lock_key);
}

std::vector<std::string> TcpStore::multi_get(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::vector<std::string> wire;
  wire.reserve(keys.size());
  for (const auto& k : keys) wire.push_back(wire_key(k));
  std::vector<std::string> values;
  if (dialect_ != Dialect::kV2) {
    for (const auto& wk : wire) values.push_back(get_locked(wk));
    return values;
  }
  wait_locked(wire, timeout_);
  std::string req;
  begin(&req, Op::kMultiGet);
  protocol::put_u64(&req, wire.size());
  for (const auto& k : wire) protocol::put_bytes(&req, k);
  const std::string first = keys.empty() ? std::string() : keys.front();
  deadline = Clock::now() + timeout_;
  send_request(req, deadline, "multi_get", first);
  guarded(where(), "multi_get", first, conn_, [&] {
    for (size_t i = 0; i < wire.size(); ++i) values.push_back(conn_->read_bytes(deadline));
    return 0;
  });
  return values;
}

void TcpStore::multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) {
  detail::check_multi_set_sizes(keys, values);
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  const std::string first = keys.empty() ? std::string() : keys.front();
  std::string req;
  if (dialect_ == Dialect::kV2) {
    begin(&req, Op::kMultiSet);
    protocol::put_i64(&req, static_cast<int64_t>(keys.size()));
    for (size_t i = 0; i < keys.size(); ++i) {
      protocol::put_bytes(&req, wire_key(keys[i]));
      protocol::put_bytes(&req, values[i]);
    }
  } else {
    // 1.13 has no MULTI_SET: pipeline plain SETs in one write.
    for (size_t i = 0; i < keys.size(); ++i) {
      begin(&req, Op::kSet);
      protocol::put_bytes(&req, wire_key(keys[i]));
      protocol::put_bytes(&req, values[i]);
    }
  }
  send_request(req, deadline, "multi_set", first);
}

void TcpStore::send_bind_keys(Clock::time_point deadline) {
  if (dialect_ != Dialect::kV2) {
    throw NotSupportedError("keys bound to a connection are not supported by " + where() +
                            " (a torch 1.13 server)");
  }
  std::string req;
  begin(&req, Op::kBindKeys);
  protocol::put_u32(&req, protocol::kBindKeysMagic);
  try {
    conn_->send_all(req.data(), req.size(), deadline);
    uint32_t echo = conn_->read_u32(deadline);
    if (echo != protocol::kBindKeysMagic) {
      throw ProtocolError("BIND_KEYS answered with " + std::to_string(echo));
    }
  } catch (const IoError& e) {
    drop_connection();
    throw NotSupportedError("keys bound to a connection are not supported by " + where() +
                            " (the server closed the connection on the request, as torch's "
                            "servers do: " +
                            e.what() + ")");
  } catch (const Error&) {
    drop_connection();
    throw;
  }
}

void TcpStore::bind_keys_to_connection() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  send_bind_keys(deadline);
  bind_keys_ = true;
}

std::vector<std::string> TcpStore::list_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  auto deadline = Clock::now() + timeout_;
  ensure_connected(deadline);
  std::string req;
  begin(&req, Op::kList);
  send_request(req, deadline, "list_keys", "");
  std::vector<std::string> keys;
  guarded(where(), "list_keys", "", conn_, [&] {
    int64_t n = conn_->read_i64(deadline);
    if (n < 0) throw ProtocolError("negative key count");
    for (int64_t i = 0; i < n; ++i) {
      std::string k = conn_->read_bytes(deadline);
      if (!k.empty() && k[0] == '/') keys.push_back(k.substr(1));
    }
    return 0;
  });
  return keys;
}

}  // namespace ctorchrun::store

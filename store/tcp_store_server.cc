#include "store/tcp_store_server.h"

// clang-format off
// Before Boost.Asio: compiled as C++20, its coroutine header uses std::exchange
// without including <utility>.
#include <utility>
// clang-format on

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::store {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
// Sockets bound to the io_context's own executor type rather than the
// type-erased any_io_executor: every asynchronous operation would otherwise pay
// for the erasure on the per-request path.
using Executor = asio::io_context::executor_type;
using Socket = tcp::socket::rebind_executor<Executor>::other;
using Acceptor = tcp::acceptor::rebind_executor<Executor>::other;
using protocol::Dialect;
using protocol::Op;

namespace {

constexpr size_t kInitialBuffer = 4096;
constexpr size_t kShrinkAbove = 1 << 20;
// A connection whose unsent replies exceed this stops reading and executing
// until its client drains them: a client that pipelines GETs of large values
// and never reads cannot make the server buffer without bound.
constexpr size_t kMaxPendingOutput = 8 << 20;
// WATCH_KEY events are not requested one by one, so pausing the connection
// would not stop them: a watcher whose unread events pass this is closed.
constexpr size_t kMaxPendingEvents = 8 << 20;
// A refused request's key is logged cut to this many bytes.
constexpr size_t kLoggedKeyBytes = 100;
// Per-client refusal log lines after the first: at most one per this period.
constexpr auto kRefusalLogPeriod = std::chrono::seconds(1);
// Forget refusal history past this many clients (a scan of many addresses
// must not grow the server); the next refusal of a forgotten client is logged
// again as a first.
constexpr size_t kMaxRefusalClients = 4096;

// The hash of the key tables: 8 bytes per step rather than std::hash's
// byte-oriented MurmurHash (the hash was the largest single cost of a GET), and
// seeded per server, so a client cannot choose keys that all collide.
// Transparent, so a request's key is looked up as the string_view it arrived
// as, never copied first.
struct KeyHash {
  using is_transparent = void;
  uint64_t seed = 0;
  static uint64_t mix(uint64_t a, uint64_t b) {
    __extension__ using U128 = unsigned __int128;
    U128 r = static_cast<U128>(a) * b;
    return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
  }
  // Not noexcept on purpose: the tables then keep each node's hash, so walking
  // a bucket compares hashes instead of hashing every next node's key again.
  size_t operator()(std::string_view s) const {
    constexpr uint64_t k0 = 0x9e3779b97f4a7c15ull, k1 = 0xbf58476d1ce4e5b9ull;
    const char* p = s.data();
    size_t n = s.size();
    uint64_t h = seed ^ (n * k0);
    uint64_t w = 0;
    if (n >= 8) {
      for (; n > 8; p += 8, n -= 8) {
        std::memcpy(&w, p, 8);
        h = mix(h ^ w, k1);
      }
      std::memcpy(&w, s.data() + s.size() - 8, 8);  // the last 8, overlapping
    } else if (n >= 4) {
      uint32_t a = 0, b = 0;
      std::memcpy(&a, p, 4);
      std::memcpy(&b, p + n - 4, 4);
      w = (static_cast<uint64_t>(a) << 32) | b;
    } else if (n > 0) {
      w = (static_cast<uint64_t>(static_cast<unsigned char>(p[0])) << 16) |
          (static_cast<uint64_t>(static_cast<unsigned char>(p[n / 2])) << 8) |
          static_cast<unsigned char>(p[n - 1]);
    }
    return static_cast<size_t>(mix(h ^ w, k0));
  }
};
template <typename V>
using KeyMap = std::unordered_map<std::string, V, KeyHash, std::equal_to<>>;

uint64_t random_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::string cut_key(std::string_view key) {
  std::string out;
  for (char ch : key.substr(0, kLoggedKeyBytes)) {
    auto u = static_cast<unsigned char>(ch);
    if (u >= 0x20 && u < 0x7f && ch != '\\') {
      out.push_back(ch);
    } else {
      char b[5];
      std::snprintf(b, sizeof b, "\\x%02x", u);
      out += b;
    }
  }
  if (key.size() > kLoggedKeyBytes) out += "...";
  return out;
}

}  // namespace

class Connection;

// ---------------------------------------------------------------------------
// Impl: the key space and the connections. Everything below runs on the
// server thread only, so nothing here takes a lock.
class TcpStoreServer::Impl {
 public:
  explicit Impl(const ServerOptions& options) : options_(options), log_(get_logger("store")) {
    // Settled once here rather than per request by the parser.
    options_.limits.max_request_bytes = protocol::request_limit(options_.limits);
  }

  void bind_and_listen();
  void run_thread();
  void stop();

  // Runs `f` on the server thread and returns its result.
  template <typename F>
  auto run_sync(F f) -> decltype(f()) {
    CTORCHRUN_CHECK(std::this_thread::get_id() != thread_.get_id(),
                    "blocking call into the store server from its own thread");
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto fut = task.get_future();
    if (!hand_in([&task] { task(); })) throw IoError("the store server has stopped");
    return fut.get();
  }

  // A refused request (a limit, a protocol violation, a slow reader): counts
  // it, and logs the first per client address at once, then at most one line
  // per client per kRefusalLogPeriod with the count since the last line.
  struct Refusal {
    const char* why = nullptr;
    std::string_view key;  // may be empty
    size_t limit = 0;      // 0: no limit involved
    uint64_t length = 0;
    bool option_raises_limit = true;  // a --max-* option raises `limit`
  };
  // --- used by Connection -------------------------------------------------
  // Executes one parsed request for `c`; false means: drop the connection.
  bool execute(Connection& c, const protocol::Request& req, Refusal* why);
  void cancel_wait(Connection& c);
  void forget(Connection& c);  // unregisters watches; removes from connections_
  void note_drop(Connection& c, const Refusal& r);
  const protocol::Limits& limits() const { return options_.limits; }
  void unbind(const std::string& key);  // forgets the connection `key` is bound to
  spdlog::logger& log() { return *log_; }

  ServerOptions options_;
  std::shared_ptr<spdlog::logger> log_;
  // One thread runs it and every Asio call happens on that thread, so it
  // takes no lock at all (UNSAFE): neither the reactor's per-descriptor locks
  // nor the scheduler's, which cost more per request than parsing it. Other
  // threads (run_sync, stop) never touch io_: they hand work in through the
  // mailbox below.
  asio::io_context io_{BOOST_ASIO_CONCURRENCY_HINT_UNSAFE};
  // Work from other threads: queued under the mutex, then an eventfd write
  // wakes the server thread, whose read of the eventfd runs the queue.
  std::mutex mailbox_mutex_;
  std::vector<std::function<void()>> mailbox_;
  bool mailbox_closed_ = false;  // under the mutex: no more writes to the eventfd
  int mailbox_fd_ = -1;
  asio::posix::basic_stream_descriptor<Executor> mailbox_reader_{io_};
  uint64_t mailbox_count_ = 0;
  void open_mailbox();  // before the server thread starts
  void read_mailbox();
  // False once the server stopped taking work.
  bool hand_in(std::function<void()> task);
  // One per address served (all on one port), each with the timer that
  // paces its retries after an accept error.
  struct Listener {
    explicit Listener(asio::io_context& io) : acceptor(io), retry_timer(io) {}
    Acceptor acceptor;
    asio::steady_timer retry_timer;
  };
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::vector<std::string> bound_hosts_;  // options_.host first
  uint16_t bound_port_ = 0;

  const KeyHash hash_{random_seed()};
  KeyMap<std::string> kv_{0, hash_};
  KeyMap<std::deque<std::string>> queues_{0, hash_};
  // key -> connections waiting on it (a connection appears once per missing
  // key of its WAIT). Connections unregister themselves before they die.
  KeyMap<std::vector<Connection*>> waiters_{0, hash_};
  KeyMap<std::vector<Connection*>> watchers_{0, hash_};
  std::unordered_map<Connection*, std::shared_ptr<Connection>> connections_;
  // Keys bound to the connection that created them (BIND_KEYS, see protocol.h).
  std::unordered_map<std::string, Connection*> key_owner_;
  struct RefusalLog {
    uint64_t count = 0;     // refusals ever (while remembered)
    uint64_t unlogged = 0;  // since the last line
    std::chrono::steady_clock::time_point last_line;
  };
  std::unordered_map<std::string, RefusalLog> refusal_logs_;  // by client address
  Connection* current_ = nullptr;  // the connection whose request executes now
  std::string scratch_key_;        // reused to look up string_view keys
  TcpStoreServer::Stats stats_;
  uint64_t next_id_ = 0;
  uint64_t accept_errors_ = 0;

 private:
  // Resolves `host`, then opens, binds and listens on host:port; the error,
  // if any, with `why` set to what failed.
  boost::system::error_code listen_on(Listener& l, const std::string& host, uint16_t port,
                                      std::string* why);
  void do_accept(Listener& l);
  // Stores `value` (neither may alias scratch_key_ or a stored value).
  void store_value(std::string_view key, std::string_view value);
  // Deletes `key` if it exists (watchers see a deletion); true if it did.
  bool erase_key(std::string_view key);
  // Deletes the keys bound to `c` and sets their gone markers.
  void release_bound_keys(Connection& c);
  void wake(std::string_view key);
  void wake_one(std::string_view key);
  void notify_watchers(std::string_view key, protocol::WatchResponse kind,
                       std::string_view old_value, std::string_view new_value);
  const std::string& key_of(std::string_view k) {
    scratch_key_.assign(k.data(), k.size());
    return scratch_key_;
  }
  bool present(std::string_view key) const {
    if (kv_.find(key) != kv_.end()) return true;
    if (queues_.empty()) return false;
    auto q = queues_.find(key);
    return q != queues_.end() && !q->second.empty();
  }
};

// ---------------------------------------------------------------------------
// Connection: one client socket, its input buffer, its pending replies and
// its WAIT registration.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(TcpStoreServer::Impl& server, Socket socket, uint64_t id)
      : server_(server), socket_(std::move(socket)), id_(id), in_(kInitialBuffer) {
    boost::system::error_code ec;
    auto ep = socket_.remote_endpoint(ec);
    // An IPv4 client of a dual-stack listener is logged as IPv4.
    auto a = ep.address();
    if (!ec && a.is_v6() && a.to_v6().is_v4_mapped()) {
      a = asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
    }
    peer_ = ec ? std::string("?") : a.to_string() + ":" + std::to_string(ep.port());
  }

  void start() { do_read(shared_from_this()); }

  // Queues a reply; it goes out at the end of the current batch of requests,
  // in one write.
  void send(std::string_view bytes) {
    if (closed_) return;
    out_.append(bytes.data(), bytes.size());
    if (!in_batch_) flush();
  }
  // The output buffer, for a request's reply while process() runs a batch
  // (it flushes at the end).
  std::string& output() { return out_; }
  void send_u8(uint8_t v) {
    char c = static_cast<char>(v);
    send(std::string_view(&c, 1));
  }

  // Called when `key`, one this connection's WAIT is registered on, arrives.
  // O(1): a WAIT on n keys completes in O(n) however the keys arrive.
  void key_arrived(const std::string& key) {
    if (wait_keys_.erase(key) == 0) return;
    if (awaited_ > 0 && --awaited_ == 0) {
      send_u8(static_cast<uint8_t>(protocol::WaitResponse::kStopWaiting));
    }
  }

  size_t pending_output() const { return out_.size() + inflight_.size(); }

  void close() {
    if (closed_) return;
    closed_ = true;
    server_.cancel_wait(*this);
    reset_progress(&req_);
    boost::system::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    server_.forget(*this);  // may release the last reference held by the server
  }

  uint64_t id() const { return id_; }
  const std::string& peer() const { return peer_; }
  Dialect dialect() const { return dialect_; }
  bool waiting() const { return awaited_ > 0; }
  bool closed() const { return closed_; }

  // The missing keys of the pending WAIT, each once however often the WAIT
  // named it.
  std::unordered_set<std::string> wait_keys_;
  size_t awaited_ = 0;
  std::vector<std::string> watch_keys_;
  bool binds_keys_ = false;  // BIND_KEYS received
  std::unordered_set<std::string> bound_keys_;

 private:
  // `self` is this connection, kept alive by the pending read; a read handler
  // hands its own reference on, so the per-request path copies no shared_ptr.
  void do_read(std::shared_ptr<Connection> self) {
    if (closed_ || reading_ || paused_) return;
    if (in_.size() - in_len_ < 1024) in_.resize(in_.size() * 2);
    reading_ = true;
    socket_.async_read_some(asio::buffer(in_.data() + in_len_, in_.size() - in_len_),
                            [this, self](const boost::system::error_code& ec, size_t n) {
                              reading_ = false;
                              if (closed_) return;
                              if (ec) {
                                close();
                                return;
                              }
                              in_len_ += n;
                              process();
                              do_read(std::move(self));
                            });
  }

  // Executes every complete request in the buffer, then writes the replies.
  void process() {
    size_t off = 0;
    in_batch_ = true;
    while (!closed_ && in_len_ - off >= need_) {
      if (pending_output() > kMaxPendingOutput) {
        paused_ = true;
        break;
      }
      protocol::ParseResult r;
      if (dialect_ != Dialect::kUnknown && req_.resume_pos == 0 &&
          protocol::parse_common_request(dialect_, in_.data() + off, in_len_ - off,
                                         server_.limits(), &req_, &r.size)) {
        r.status = protocol::ParseStatus::kComplete;
      } else {
        r = protocol::parse_request(&dialect_, in_.data() + off, in_len_ - off, server_.limits(),
                                    &req_);
      }
      if (r.status == protocol::ParseStatus::kNeedMore) {
        need_ = r.size;
        break;
      }
      if (r.status == protocol::ParseStatus::kError) {
        server_.note_drop(*this, {r.error, r.key, r.limit, r.length});
        close();
        return;
      }
      need_ = 1;  // no request is shorter: an empty rest is not parsed
      TcpStoreServer::Impl::Refusal why{nullptr, req_.key, 0, 0};
      if (!server_.execute(*this, req_, &why)) {
        server_.note_drop(*this, why);
        close();
        return;
      }
      off += r.size;
    }
    in_batch_ = false;
    if (off > 0) {
      // need_ counts from the request's first byte, which moves to 0 here.
      if (off < in_len_) std::memmove(in_.data(), in_.data() + off, in_len_ - off);
      in_len_ -= off;
    }
    if (in_len_ == 0 && in_.size() > kShrinkAbove) {
      in_.resize(kInitialBuffer);
      in_.shrink_to_fit();
    }
    flush();
  }

  void flush() {
    if (closed_ || writing_ || out_.empty()) return;
    // Try the write right away: a reply usually fits the socket buffer, and
    // this saves a trip through the reactor.
    // The socket is non-blocking; MSG_NOSIGNAL: a closed peer is an error
    // here, not a SIGPIPE. The system call itself, not libc's send(): that
    // one is a thread-cancellation point, whose bookkeeping cost as much as
    // the rest of this function (the server thread is never cancelled).
    const auto sent = static_cast<ssize_t>(::syscall(
        SYS_sendto, socket_.native_handle(), out_.data(), out_.size(), MSG_NOSIGNAL, nullptr, 0));
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      close();
      return;
    }
    const size_t n = sent < 0 ? 0 : static_cast<size_t>(sent);
    if (n == out_.size()) {
      out_.clear();
    } else {
      out_.erase(0, n);
    }
    if (out_.empty()) {
      if (paused_) resume();
      return;
    }
    writing_ = true;
    inflight_.swap(out_);
    out_.clear();
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(inflight_),
                      [this, self](const boost::system::error_code& wec, size_t) {
                        writing_ = false;
                        inflight_.clear();
                        if (closed_) return;
                        if (wec) {
                          close();
                          return;
                        }
                        if (!out_.empty()) {
                          flush();
                        } else if (paused_) {
                          resume();
                        }
                      });
  }

  void resume() {
    paused_ = false;
    process();
    do_read(shared_from_this());
  }

  TcpStoreServer::Impl& server_;
  Socket socket_;
  uint64_t id_;
  std::string peer_;
  std::vector<char> in_;
  size_t in_len_ = 0;
  size_t need_ = 1;  // parse again only once in_len_ reaches this
  std::string out_;
  std::string inflight_;
  bool reading_ = false;
  bool writing_ = false;
  bool paused_ = false;
  bool in_batch_ = false;
  bool closed_ = false;
  Dialect dialect_ = Dialect::kUnknown;
  protocol::Request req_;
};

// ---------------------------------------------------------------------------

namespace {

// "host:port", "[v6]:port" for an IPv6 literal.
std::string host_port(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

// Attempts at a port picked by the kernel (port 0) whose number another
// process holds on one of the further addresses.
constexpr int kPickPortAttempts = 16;

}  // namespace

boost::system::error_code TcpStoreServer::Impl::listen_on(Listener& l, const std::string& host,
                                                          uint16_t port, std::string* why) {
  boost::system::error_code ec;
  tcp::resolver resolver(io_);
  auto results = resolver.resolve(host, std::to_string(port),
                                  tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty()) {
    if (!ec) ec = asio::error::host_not_found;
    *why = "cannot resolve host '" + host + "': " + ec.message();
    return ec;
  }
  tcp::endpoint ep = results.begin()->endpoint();
  l.acceptor.open(ep.protocol(), ec);
  // The IPv6 wildcard serves IPv4 clients too, whatever net.ipv6.bindv6only
  // says, as torch's server does.
  if (!ec && ep.address().is_v6() && ep.address().is_unspecified()) {
    l.acceptor.set_option(asio::ip::v6_only(false), ec);
  }
  if (!ec) l.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) l.acceptor.bind(ep, ec);
  if (!ec) l.acceptor.listen(options_.listen_backlog, ec);
  if (ec) {
    *why = ec.message() + (ec == asio::error::address_in_use
                               ? " (another process listens on that port; pick another: "
                                 "--master_port for ctorchrun, --port for ctorch-store)"
                               : "");
  }
  return ec;
}

void TcpStoreServer::Impl::bind_and_listen() {
  std::vector<std::string> hosts{options_.host};
  for (const auto& h : options_.also_hosts) {
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  }
  // All or nothing: an address that cannot be bound closes the others. With
  // port 0 the first address picks the port and the others take the same; a
  // port some other process holds on a further address is given up for a
  // fresh one, a bounded number of times.
  for (int attempt = 1;; ++attempt) {
    uint16_t port = options_.port;
    for (size_t i = 0; i < hosts.size(); ++i) {
      auto l = std::make_unique<Listener>(io_);
      std::string why;
      const auto ec = listen_on(*l, hosts[i], port, &why);
      if (ec) {
        const std::string where = host_port(hosts[i], port);
        listeners_.clear();  // closes what was bound
        const bool retry = options_.port == 0 && i > 0 && ec == asio::error::address_in_use &&
                           attempt < kPickPortAttempts;
        if (retry) break;
        throw IoError("cannot bind the store server to " + where + ": " + why +
                      (options_.port == 0 && i > 0
                           ? " (port " + std::to_string(port) + " picked on " + hosts[0] + ", " +
                                 std::to_string(attempt) + " ports tried)"
                           : ""));
      }
      if (i == 0) port = l->acceptor.local_endpoint().port();
      listeners_.push_back(std::move(l));
    }
    if (listeners_.size() == hosts.size()) {
      bound_port_ = port;
      break;
    }
  }
  bound_hosts_ = hosts;
  for (auto& l : listeners_) do_accept(*l);
}

void TcpStoreServer::Impl::do_accept(Listener& l) {
  l.acceptor.async_accept([this, &l](const boost::system::error_code& ec, Socket socket) {
    if (ec == asio::error::operation_aborted || stopped_) return;
    if (ec) {
      // Out of file descriptors and the like: back off briefly, keep serving.
      if (accept_errors_++ % 1000 == 0) {
        log_->warn("accept failed on port {}: {} (open connections {}); retrying", bound_port_,
                   ec.message(), connections_.size());
      }
      l.retry_timer.expires_after(std::chrono::milliseconds(20));
      l.retry_timer.async_wait([this, &l](const boost::system::error_code& tec) {
        if (!tec) do_accept(l);
      });
      return;
    }
    if (connections_.size() >= options_.max_connections) {
      if (stats_.refused++ % 1000 == 0) {
        log_->warn("refusing a connection: {} open, --max-connections is {}", connections_.size(),
                   options_.max_connections);
      }
      boost::system::error_code ignored;
      socket.close(ignored);
    } else {
      boost::system::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      socket.non_blocking(true, ignored);
      auto c = std::make_shared<Connection>(*this, std::move(socket), next_id_++);
      connections_.emplace(c.get(), c);
      ++stats_.accepted;
      c->start();
    }
    do_accept(l);
  });
}

void TcpStoreServer::Impl::open_mailbox() {
  mailbox_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (mailbox_fd_ < 0) {
    throw IoError(std::string("store server: could not create an eventfd: ") +
                  std::strerror(errno));
  }
  mailbox_reader_.assign(mailbox_fd_);  // now owns the descriptor
  read_mailbox();
}

// A read, not an async_wait: Asio's reactor is edge-triggered, and a read
// armed after a write it missed still finds the count at once (speculative
// read), where a wait would sleep until the next write.
void TcpStoreServer::Impl::read_mailbox() {
  mailbox_reader_.async_read_some(
      asio::buffer(&mailbox_count_, sizeof mailbox_count_),
      [this](const boost::system::error_code& ec, size_t) {
        if (ec == asio::error::operation_aborted || !mailbox_reader_.is_open()) return;
        if (ec) log_->error("store server: reading its wake-up eventfd failed: {}", ec.message());
        std::vector<std::function<void()>> tasks;
        {
          std::lock_guard<std::mutex> lock(mailbox_mutex_);
          tasks.swap(mailbox_);
        }
        for (auto& t : tasks) t();
        if (mailbox_reader_.is_open()) read_mailbox();
      });
}

bool TcpStoreServer::Impl::hand_in(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mailbox_mutex_);
  if (mailbox_closed_) return false;
  mailbox_.push_back(std::move(task));
  const uint64_t one = 1;
  // Only a counter at its maximum could refuse this, and it is read at once.
  while (::write(mailbox_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
  return true;
}

void TcpStoreServer::Impl::run_thread() {
  open_mailbox();
  thread_ = std::thread([this] {
    // Handlers report errors through error codes; anything thrown here is
    // unexpected (bad_alloc), so log it and keep the server alive.
    while (!stopped_) {
      try {
        io_.run();
        break;
      } catch (const std::exception& e) {
        log_->error("store server: unexpected exception in the event loop: {}", e.what());
      }
    }
  });
}

void TcpStoreServer::Impl::stop() {
  if (stopped_.exchange(true)) return;
  if (thread_.joinable()) {
    hand_in([this] {
      boost::system::error_code ec;
      for (auto& l : listeners_) {
        l->acceptor.close(ec);
        l->retry_timer.cancel();
      }
      auto all = connections_;
      for (auto& c : all) c.second->close();
      {
        std::lock_guard<std::mutex> lock(mailbox_mutex_);
        mailbox_closed_ = true;
      }
      mailbox_reader_.close(ec);
      io_.stop();
    });
    thread_.join();
    // Work handed in while the server stopped: run here, the server thread
    // being gone, so that no run_sync caller waits for ever.
    std::vector<std::function<void()>> left;
    {
      std::lock_guard<std::mutex> lock(mailbox_mutex_);
      left.swap(mailbox_);
    }
    for (auto& t : left) t();
  }
}

void TcpStoreServer::Impl::note_drop(Connection& c, const Refusal& r) {
  ++stats_.dropped;
  if (r.limit > 0) ++stats_.limit_refusals;
  const std::string& peer = c.peer();
  std::string host = peer.substr(0, peer.rfind(':'));
  if (refusal_logs_.size() >= kMaxRefusalClients && !refusal_logs_.count(host)) {
    refusal_logs_.clear();
  }
  RefusalLog& rl = refusal_logs_[host];
  ++rl.count;
  auto now = std::chrono::steady_clock::now();
  if (rl.count > 1 && now - rl.last_line < kRefusalLogPeriod) {
    ++rl.unlogged;
    return;
  }
  std::string what = r.why ? r.why : "protocol error";
  if (!r.key.empty()) what += " (key '" + cut_key(r.key) + "')";
  if (r.limit > 0) {
    what += ": " + std::to_string(r.length) + " bytes or items, the limit is " +
            std::to_string(r.limit);
    if (r.option_raises_limit) what += " (ctorch-store's --max-* options raise it)";
  }
  if (rl.count == 1) {
    log_->warn("refused a request from {} ({}) and closed its connection: {}", peer,
               protocol::to_string(c.dialect()), what);
  } else {
    log_->warn("refused {} more requests from {} since the last report ({} in all); latest: {}",
               rl.unlogged + 1, host, rl.count, what);
  }
  rl.unlogged = 0;
  rl.last_line = now;
}

void TcpStoreServer::Impl::forget(Connection& c) {
  auto keep_alive = c.shared_from_this();
  release_bound_keys(c);
  for (const auto& key : c.watch_keys_) {
    auto it = watchers_.find(key);
    if (it == watchers_.end()) continue;
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), &c), v.end());
    if (v.empty()) watchers_.erase(it);
  }
  c.watch_keys_.clear();
  connections_.erase(&c);
}

void TcpStoreServer::Impl::cancel_wait(Connection& c) {
  for (const auto& key : c.wait_keys_) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) continue;
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), &c), v.end());
    if (v.empty()) waiters_.erase(it);
  }
  c.wait_keys_.clear();
  c.awaited_ = 0;
}

void TcpStoreServer::Impl::unbind(const std::string& key) {
  auto it = key_owner_.find(key);
  if (it == key_owner_.end()) return;
  it->second->bound_keys_.erase(key);
  key_owner_.erase(it);
}

bool TcpStoreServer::Impl::erase_key(std::string_view key) {
  auto it = kv_.find(key);
  if (it == kv_.end()) return false;
  std::string name(key);  // `key` may view the node erased below
  std::string old = std::move(it->second);
  kv_.erase(it);
  unbind(name);
  notify_watchers(name, protocol::WatchResponse::kKeyDeleted, old, {});
  return true;
}

void TcpStoreServer::Impl::release_bound_keys(Connection& c) {
  if (c.bound_keys_.empty()) return;
  std::vector<std::string> keys(c.bound_keys_.begin(), c.bound_keys_.end());
  Connection* saved = current_;
  current_ = nullptr;  // markers bind to nobody
  for (const auto& key : keys) {
    erase_key(key);
    store_value(key + protocol::kGoneSuffix, "1");
  }
  current_ = saved;
  log_->debug("connection from {} closed: deleted its {} bound keys", c.peer(), keys.size());
}

void TcpStoreServer::Impl::wake(std::string_view key_view) {
  if (waiters_.empty()) return;  // the common case: no hash of the key
  auto it = waiters_.find(key_view);
  if (it == waiters_.end()) return;
  std::string key(key_view);
  stats_.waiter_entries_examined += it->second.size();
  // Hold every waiter: a reply that fails to send closes its connection,
  // and a connection can appear more than once in the list.
  std::vector<std::shared_ptr<Connection>> list;
  list.reserve(it->second.size());
  for (Connection* c : it->second) list.push_back(c->shared_from_this());
  waiters_.erase(it);
  for (auto& c : list) c->key_arrived(key);
}

void TcpStoreServer::Impl::wake_one(std::string_view key_view) {
  auto it = waiters_.find(key_view);
  if (it == waiters_.end()) return;
  std::string key(key_view);
  ++stats_.waiter_entries_examined;
  auto c = it->second.front()->shared_from_this();
  it->second.erase(it->second.begin());
  if (it->second.empty()) waiters_.erase(it);
  c->key_arrived(key);
}

void TcpStoreServer::Impl::notify_watchers(std::string_view key, protocol::WatchResponse kind,
                                           std::string_view old_value, std::string_view new_value) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  std::string event;
  protocol::put_u8(&event, static_cast<uint8_t>(kind));
  protocol::put_bytes(&event, key);
  protocol::put_bytes(&event, old_value);
  protocol::put_bytes(&event, new_value);
  std::vector<std::shared_ptr<Connection>> list;
  for (Connection* w : it->second) list.push_back(w->shared_from_this());
  for (auto& w : list) {
    if (w->pending_output() > kMaxPendingEvents) {
      // It reads no events: pausing its requests would not stop them.
      ++stats_.slow_readers_closed;
      note_drop(*w, {"a WATCH_KEY client left its events unread", key, kMaxPendingEvents,
                     w->pending_output(), false});
      w->close();
      continue;
    }
    w->send(event);
  }
}

void TcpStoreServer::Impl::store_value(std::string_view key, std::string_view value) {
  auto it = kv_.find(key);
  if (it == kv_.end()) {
    if (current_ && current_->binds_keys_ && !current_->closed()) {
      std::string name(key);
      key_owner_[name] = current_;
      current_->bound_keys_.insert(name);
      erase_key(name + protocol::kGoneSuffix);
    }
    it = kv_.emplace(std::string(key), std::string(value)).first;
    // Only v113 clients watch.
    if (!watchers_.empty()) {
      notify_watchers(key, protocol::WatchResponse::kKeyCreated, {}, it->second);
    }
  } else if (!watchers_.empty() && watchers_.find(key) != watchers_.end()) {
    std::string old = std::move(it->second);
    it->second.assign(value.data(), value.size());
    notify_watchers(key, protocol::WatchResponse::kKeyUpdated, old, it->second);
  } else {
    // Into the value's own buffer: a SET of a same-sized value allocates nothing.
    it->second.assign(value.data(), value.size());
  }
  wake(key);
}

bool TcpStoreServer::Impl::execute(Connection& c, const protocol::Request& req, Refusal* why) {
  ++stats_.requests;
  ++stats_.requests_by_op[static_cast<size_t>(req.op)];
  struct CurrentGuard {
    Connection*& current;
    ~CurrentGuard() { current = nullptr; }
  } guard{current_};
  current_ = &c;
  if (c.waiting()) {
    if (c.dialect() == Dialect::kV113) {
      // A 1.13 client never writes while blocked in WAIT: it gave up.
      cancel_wait(c);
    } else if (req.op == Op::kWait) {
      why->why = "WAIT sent while another WAIT of the same connection is pending";
      return false;
    }
  }

  // Replies are written straight into the connection's output, in order
  // with any WATCH_KEY events a request causes; the batch flushes them.
  std::string& reply = c.output();
  switch (req.op) {
    case Op::kValidate:
      if (req.u32 != protocol::kValidationMagic) {
        why->why = "VALIDATE with a wrong magic number";
        return false;
      }
      return true;

    case Op::kPing:
      protocol::put_u32(&reply, req.u32);
      break;

    case Op::kBindKeys:
      if (req.u32 != protocol::kBindKeysMagic) {
        why->why = "BIND_KEYS with a wrong magic number";
        return false;
      }
      c.binds_keys_ = true;
      protocol::put_u32(&reply, req.u32);
      break;

    case Op::kSet: {
      store_value(req.key, req.value);
      return true;
    }

    case Op::kCompareSet: {
      auto it = kv_.find(req.key);
      if (it == kv_.end()) {
        if (req.value.empty()) {
          store_value(req.key, req.value2);
          protocol::put_bytes(&reply, req.value2);
        } else {
          protocol::put_bytes(&reply, req.value);
        }
      } else if (it->second == req.value) {
        store_value(req.key, req.value2);
        protocol::put_bytes(&reply, req.value2);
      } else {
        protocol::put_bytes(&reply, it->second);
      }
      break;
    }

    case Op::kGet: {
      auto it = kv_.find(req.key);
      protocol::put_bytes(&reply, it == kv_.end() ? std::string_view() : it->second);
      break;
    }

    case Op::kAdd: {
      auto it = kv_.find(req.key);
      int64_t current = 0;
      if (it != kv_.end()) {
        auto parsed = protocol::parse_int64_like_stoll(it->second);
        if (!parsed) {
          why->why = "ADD on a value that is not an integer";
          return false;
        }
        current = *parsed;
      }
      // Wraps past int64's ends, as torch's servers do (two's complement).
      int64_t sum =
          static_cast<int64_t>(static_cast<uint64_t>(current) + static_cast<uint64_t>(req.delta));
      protocol::put_i64(&reply, sum);
      char digits[24];
      std::string_view text(digits,
                            std::to_chars(digits, digits + sizeof digits, sum).ptr - digits);
      if (it != kv_.end() && watchers_.empty()) {
        it->second.assign(text.data(), text.size());  // no second lookup: ADD's common case
        wake(req.key);
      } else {
        store_value(req.key, text);
      }
      return true;
    }

    case Op::kCheck: {
      bool all = true;
      for (auto k : req.keys) all = all && present(k);
      protocol::put_u8(&reply, static_cast<uint8_t>(all ? protocol::CheckResponse::kReady
                                                        : protocol::CheckResponse::kNotReady));
      break;
    }

    case Op::kWait: {
      for (auto k : req.keys) {
        const std::string& key = key_of(k);
        if (!present(key) && c.wait_keys_.insert(key).second) {
          waiters_[key].push_back(&c);
          ++c.awaited_;
        }
      }
      if (c.awaited_ == 0) {
        protocol::put_u8(&reply, static_cast<uint8_t>(protocol::WaitResponse::kStopWaiting));
      }
      break;
    }

    case Op::kGetNumKeys:
      protocol::put_i64(&reply, static_cast<int64_t>(kv_.size()));
      break;

    case Op::kWatchKey: {
      const std::string& key = key_of(req.key);
      auto& v = watchers_[key];
      if (std::find(v.begin(), v.end(), &c) == v.end()) {
        v.push_back(&c);
        c.watch_keys_.push_back(key);
      }
      protocol::put_u8(&reply, static_cast<uint8_t>(protocol::WatchResponse::kCallbackRegistered));
      break;
    }

    case Op::kDeleteKey:
      protocol::put_i64(&reply, erase_key(req.key) ? 1 : 0);
      break;

    case Op::kAppend: {
      auto it = kv_.find(req.key);
      size_t old_size = it == kv_.end() ? 0 : it->second.size();
      if (old_size + req.value.size() > options_.limits.max_value_bytes) {
        why->why = "APPEND would grow a value beyond the value size limit";
        return false;
      }
      std::string value = it == kv_.end() ? std::string() : it->second;
      value.append(req.value.data(), req.value.size());
      store_value(req.key, value);
      return true;
    }

    case Op::kMultiGet: {
      // The reply is bounded like a request: 131072 names of one 64 MiB value
      // would otherwise ask for 8 TiB.
      size_t total = 0;
      const size_t cap = protocol::request_limit(options_.limits);
      for (auto k : req.keys) {
        auto it = kv_.find(k);
        total += 8 + (it == kv_.end() ? 0 : it->second.size());
        if (total > cap) {
          *why = {"MULTI_GET reply larger than the request size limit", k, cap, total};
          return false;
        }
      }
      reply.reserve(total);
      for (auto k : req.keys) {
        auto it = kv_.find(k);
        protocol::put_bytes(&reply, it == kv_.end() ? std::string_view() : it->second);
      }
      break;
    }

    case Op::kMultiSet:
      for (size_t i = 0; i < req.keys.size(); ++i) {
        store_value(req.keys[i], req.values[i]);
      }
      return true;

    case Op::kCancelWait:
      cancel_wait(c);
      protocol::put_u8(&reply, static_cast<uint8_t>(protocol::WaitResponse::kWaitCanceled));
      break;

    case Op::kQueuePush: {
      std::string key = key_of(req.key);
      queues_[key].emplace_back(req.value);
      wake_one(key);
      return true;
    }

    case Op::kQueuePop: {
      auto it = queues_.find(req.key);
      if (it == queues_.end() || it->second.empty()) {
        protocol::put_i64(&reply, 0);
      } else {
        protocol::put_i64(&reply, static_cast<int64_t>(it->second.size()));
        protocol::put_bytes(&reply, it->second.front());
        it->second.pop_front();
        if (it->second.empty()) queues_.erase(it);
      }
      break;
    }

    case Op::kQueueLen: {
      auto it = queues_.find(req.key);
      protocol::put_i64(&reply, it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size()));
      break;
    }

    case Op::kList:
      protocol::put_i64(&reply, static_cast<int64_t>(kv_.size()));
      for (const auto& kv : kv_) protocol::put_bytes(&reply, kv.first);
      break;
  }
  return true;
}

// ---------------------------------------------------------------------------

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpStoreServer::~TcpStoreServer() { stop(); }

std::unique_ptr<TcpStoreServer> TcpStoreServer::start(const ServerOptions& options) {
  const auto& l = options.limits;
  if (l.max_request_bytes > 0 && l.max_request_bytes < l.max_key_bytes + l.max_value_bytes) {
    throw ConfigError("the request size limit (" + std::to_string(l.max_request_bytes) +
                      " bytes) is below the key limit plus the value limit (" +
                      std::to_string(l.max_key_bytes) + " + " + std::to_string(l.max_value_bytes) +
                      "); raise --max-request-bytes or lower the others");
  }
  auto impl = std::make_unique<Impl>(options);
  impl->bind_and_listen();
  impl->run_thread();
  for (const auto& h : impl->bound_hosts_) {
    impl->log_->debug("store server listening on {}", host_port(h, impl->bound_port_));
  }
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl)));
}

const std::string& TcpStoreServer::host() const { return impl_->bound_hosts_.front(); }
const std::vector<std::string>& TcpStoreServer::hosts() const { return impl_->bound_hosts_; }
uint16_t TcpStoreServer::port() const { return impl_->bound_port_; }

void TcpStoreServer::stop() { impl_->stop(); }

size_t TcpStoreServer::erase_keys_except(const std::vector<std::string>& keep_prefixes) {
  if (impl_->stopped_) return 0;
  return impl_->run_sync([this, &keep_prefixes] {
    auto keep = [&](const std::string& key) {
      for (const auto& p : keep_prefixes) {
        if (key.compare(0, p.size(), p) == 0) return true;
      }
      return false;
    };
    size_t removed = 0;
    for (auto it = impl_->kv_.begin(); it != impl_->kv_.end();) {
      if (keep(it->first)) {
        ++it;
      } else {
        impl_->unbind(it->first);
        it = impl_->kv_.erase(it);
        ++removed;
      }
    }
    for (auto it = impl_->queues_.begin(); it != impl_->queues_.end();) {
      if (keep(it->first)) {
        ++it;
      } else {
        it = impl_->queues_.erase(it);
        ++removed;
      }
    }
    return removed;
  });
}

TcpStoreServer::Stats TcpStoreServer::stats() {
  if (impl_->stopped_) return impl_->stats_;
  return impl_->run_sync([this] {
    Stats s = impl_->stats_;
    s.open_connections = impl_->connections_.size();
    s.keys = impl_->kv_.size();
    return s;
  });
}

}  // namespace ctorchrun::store

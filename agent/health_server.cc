#include "agent/health_server.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cctype>
#include <deque>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent/job_status.h"
#include "agent/status_page.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"

namespace ctorchrun::agent {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using namespace std::chrono_literals;

namespace {

double epoch_seconds(std::chrono::system_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

}  // namespace

const char* phase_name(AgentPhase phase) {
  switch (phase) {
    case AgentPhase::kStarting:
      return "starting";
    case AgentPhase::kRendezvous:
      return "rendezvous";
    case AgentPhase::kRunning:
      return "running";
    case AgentPhase::kRestarting:
      return "restarting";
    case AgentPhase::kStopping:
      return "stopping";
    case AgentPhase::kFinished:
      return "finished";
  }
  return "unknown";
}

void HealthStatus::set_run_id(std::string run_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  run_id_ = std::move(run_id);
}

void HealthStatus::set_phase(AgentPhase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = phase;
}

void HealthStatus::set_attempt(int attempt) {
  std::lock_guard<std::mutex> lock(mutex_);
  attempt_ = attempt;
}

int HealthStatus::attempt() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return attempt_;
}

void HealthStatus::set_last_progress(std::chrono::system_clock::time_point t) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!last_progress_ || t > *last_progress_) last_progress_ = t;
}

void HealthStatus::set_file_timer(std::string path, std::function<FileTimerStats()> stats) {
  std::lock_guard<std::mutex> lock(mutex_);
  file_timer_path_ = std::move(path);
  file_timer_stats_ = std::move(stats);
}

bool HealthStatus::alive() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_ != AgentPhase::kFinished;
}

bool HealthStatus::ready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_ == AgentPhase::kRunning;
}

std::string HealthStatus::to_json(std::chrono::system_clock::time_point now) const {
  std::function<FileTimerStats()> stats;
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    j["state"] = phase_name(phase_);
    j["attempt"] = attempt_;
    j["run_id"] = run_id_;
    j["time"] = epoch_seconds(now);
    j["last_progress"] =
        last_progress_ ? nlohmann::json(epoch_seconds(*last_progress_)) : nlohmann::json();
    j["file_timer"] = nullptr;
    if (file_timer_stats_) {
      stats = file_timer_stats_;
      j["file_timer"] = nlohmann::json::object();
    }
  }
  if (stats) {
    // Outside our lock: the file timer takes its own.
    const FileTimerStats s = stats();
    auto& ft = j["file_timer"];
    ft["last_request"] = s.last_request ? nlohmann::json(*s.last_request) : nlohmann::json();
    ft["active_timers"] = s.active_timers;
  }
  // A page for people: a run id is the user's text and may hold invalid
  // UTF-8, shown as U+FFFD.
  return json_text::dump_for_people(j);
}

// ---------------------------------------------------------------------------

namespace {

class Connection;

struct Shared {
  HealthServerOptions options;
  std::shared_ptr<const HealthStatus> status;
  std::shared_ptr<const JobStatus> job;  // null: health endpoints only
  std::atomic<size_t> active{0};
  // Connections in the order they came, oldest first (the server's thread
  // alone touches it): past the bound the oldest makes room.
  std::deque<std::weak_ptr<Connection>> live;
};

// One client: read a request head (bounded in size and time), answer once,
// close. Owned by the handlers in flight; nothing it does can throw out of
// them (error codes only).
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, std::shared_ptr<Shared> shared)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), shared_(std::move(shared)) {
    ++shared_->active;
  }
  ~Connection() { --shared_->active; }

  // Closes the connection now (to make room for a newer one).
  void evict() { close(); }

  void start() {
    timer_.expires_after(shared_->options.read_timeout);
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close();  // too slow: only this client is dropped
    });
    read();
  }

 private:
  void read() {
    const size_t room = shared_->options.max_request_bytes - head_.size();
    socket_.async_read_some(asio::buffer(chunk_.data(), std::min(room, chunk_.size())),
                            [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                              if (ec) return self->close();
                              self->on_read(n);
                            });
  }

  void on_read(size_t n) {
    const size_t scanned = head_.size() >= 3 ? head_.size() - 3 : 0;
    head_.append(chunk_.data(), n);
    const bool complete = head_.find("\r\n\r\n", scanned) != std::string::npos ||
                          head_.find("\n\n", scanned) != std::string::npos;
    if (complete) return answer();
    if (head_.size() >= shared_->options.max_request_bytes) {
      return respond(431, "Request Header Fields Too Large",
                     R"({"error": "request head too large"})");
    }
    read();
  }

  void answer() {
    const size_t eol = head_.find('\n');
    std::string line = head_.substr(0, eol);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string::npos || line.compare(sp2 + 1, 5, "HTTP/") != 0) {
      return respond(400, "Bad Request", R"({"error": "bad request line"})");
    }
    const std::string method = line.substr(0, sp1);
    std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    target = target.substr(0, target.find('?'));
    if (method != "GET" && method != "HEAD") {
      return respond(405, "Method Not Allowed", R"({"error": "only GET"})", method == "HEAD");
    }
    const bool head = method == "HEAD";
    if (target == "/healthz" || target == "/readyz") {
      const bool ok = target == "/healthz" ? shared_->status->alive() : shared_->status->ready();
      return respond(ok ? 200 : 503, ok ? "OK" : "Service Unavailable",
                     shared_->status->to_json(std::chrono::system_clock::now()), head);
    }
    const JobStatus* job = shared_->job.get();
    if (job && target == "/metrics") {
      return respond(200, "OK", job->metrics_text(), head,
                     "text/plain; version=0.0.4; charset=utf-8");
    }
    if (job && target == "/status") return respond(200, "OK", job->status_json(), head);
    if (job && (target == "/" || target == "/index.html")) {
      return respond(200, "OK", status_page_html(), head, "text/html; charset=utf-8");
    }
    respond(404, "Not Found",
            job ? R"({"error": "not found; try /, /status, /metrics, /healthz or /readyz"})"
                : R"({"error": "not found; try /healthz or /readyz"})",
            head);
  }

  void respond(int code, const char* reason, const std::string& body, bool head_only = false,
               const char* type = "application/json") {
    out_ = "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + type +
           "\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n";
    if (!head_only) out_ += body;
    // The answer is small; a client that does not read it is still bounded
    // by the timer, restarted for the write.
    timer_.expires_after(shared_->options.read_timeout);
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close();
    });
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this()](boost::system::error_code ec, size_t) {
                        if (!ec) self->socket_.shutdown(tcp::socket::shutdown_send, ec);
                        self->close();
                      });
  }

  void close() {
    boost::system::error_code ec;
    timer_.cancel();
    socket_.close(ec);
  }

  tcp::socket socket_;
  asio::steady_timer timer_;
  std::shared_ptr<Shared> shared_;
  std::array<char, 2048> chunk_{};
  std::string head_;
  std::string out_;
};

}  // namespace

class HealthServer::Impl {
 public:
  Impl(HealthServerOptions options, std::shared_ptr<const HealthStatus> status,
       std::shared_ptr<const JobStatus> job)
      : shared_(std::make_shared<Shared>()), acceptor_(io_), retry_(io_) {
    shared_->options = std::move(options);
    shared_->status = std::move(status);
    shared_->job = std::move(job);
    const auto& o = shared_->options;
    boost::system::error_code ec;
    const auto addr = asio::ip::make_address(o.host, ec);
    if (ec) throw ConfigError("health check: '" + o.host + "' is no IP address");
    const tcp::endpoint ep(addr, static_cast<unsigned short>(o.port));
    const std::string where = o.host + ":" + std::to_string(o.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) throw IoError("health check: cannot listen on " + where + ": " + ec.message());
    port_ = acceptor_.local_endpoint().port();
    accept();
    thread_ = std::thread([this] { run(); });
  }

  ~Impl() {
    asio::post(io_, [this] {
      boost::system::error_code ec;
      acceptor_.close(ec);
      retry_.cancel();
    });
    io_.stop();
    thread_.join();
  }

  int port() const { return port_; }

 private:
  void run() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        // The thread's boundary: nothing in a handler should throw; if it
        // does, that connection is lost, the server goes on.
        get_logger("agent")->error("health check: {}", e.what());
      }
    }
  }

  void accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec) {
        // Out of descriptors, most likely: try again shortly instead of
        // spinning on the same error.
        retry_.expires_after(100ms);
        retry_.async_wait([this](boost::system::error_code e) {
          if (!e) accept();
        });
        return;
      }
      // Past the bound the oldest connection goes, not the new one: a client
      // holding many slow connections cannot lock others out; a well-behaved
      // client's request is answered the moment it arrives, so the oldest is
      // the slowest.
      auto& live = shared_->live;
      while (!live.empty() && live.front().expired()) live.pop_front();
      size_t open = 0;
      for (const auto& w : live) open += w.expired() ? 0 : 1;
      while (open >= shared_->options.max_connections && !live.empty()) {
        if (auto oldest = live.front().lock()) {
          oldest->evict();
          --open;
        }
        live.pop_front();
      }
      auto c = std::make_shared<Connection>(std::move(socket), shared_);
      live.push_back(c);
      c->start();
      accept();
    });
  }

  std::shared_ptr<Shared> shared_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer retry_;
  int port_ = 0;
  std::thread thread_;
};

HealthServer::HealthServer(HealthServerOptions options, std::shared_ptr<const HealthStatus> status,
                           std::shared_ptr<const JobStatus> job)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(status), std::move(job))) {}

HealthServer::~HealthServer() = default;

int HealthServer::port() const { return impl_->port(); }

std::optional<int> health_check_port(const std::map<std::string, std::string>& env,
                                     std::string* error) {
  auto it = env.find(kHealthCheckPortEnv);
  if (it == env.end()) return std::nullopt;
  std::string v = it->second;
  auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  v.erase(v.begin(), std::find_if_not(v.begin(), v.end(), space));
  v.erase(std::find_if_not(v.rbegin(), v.rend(), space).base(), v.end());
  const bool digits =
      !v.empty() && v.size() <= 5 &&
      std::all_of(v.begin(), v.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
  if (!digits || std::stoi(v) > 65535) {
    if (error) {
      *error = std::string(kHealthCheckPortEnv) + "='" + it->second.substr(0, 40) +
               "' is no port (0-65535)";
    }
    return std::nullopt;
  }
  return std::stoi(v);
}

}  // namespace ctorchrun::agent

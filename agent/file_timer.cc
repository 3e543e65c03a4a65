#include "agent/file_timer.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "common/error.h"
#include "common/log.h"
#include "common/procfs.h"
#include "worker/launcher.h"

namespace ctorchrun::agent {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// At most this many bytes are read from the pipe per pass, so that a flood of
// lines cannot hold the expiry checks back.
constexpr size_t kMaxBytesPerPass = 256 * 1024;

// The first bytes of `s`, printable, for a log line.
std::string excerpt(std::string_view s, size_t max = 80) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

// An integer field of `j` in [lo, hi], or nullopt.
std::optional<int64_t> integer_in(const nlohmann::json& j, int64_t lo, int64_t hi) {
  if (j.is_number_unsigned()) {
    const auto v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(hi)) return std::nullopt;
    const auto s = static_cast<int64_t>(v);
    return s < lo ? std::nullopt : std::optional<int64_t>(s);
  }
  if (j.is_number_integer()) {
    const auto v = j.get<int64_t>();
    return v < lo || v > hi ? std::nullopt : std::optional<int64_t>(v);
  }
  return std::nullopt;
}

std::string uuid4() {
  std::random_device rd;
  unsigned char b[16];
  for (auto& x : b) x = static_cast<unsigned char>(rd() & 0xff);
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);
  std::string s;
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s.push_back('-');
    std::snprintf(hex, sizeof hex, "%02x", b[i]);
    s += hex;
  }
  return s;
}

std::string scope_list(const std::vector<std::string>& scopes) {
  std::string s;
  for (const auto& x : scopes) s += (s.empty() ? "" : ", ") + excerpt(x, 200);
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------

std::optional<FileTimerRequest> parse_timer_request(std::string_view line, std::string* error) {
  auto fail = [&](const std::string& why) -> std::optional<FileTimerRequest> {
    if (error) *error = why + ": '" + excerpt(line) + "'";
    return std::nullopt;
  };
  try {
    const nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr,
                                                   /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail("not JSON");
    if (!j.is_object()) return fail("not a JSON object");
    FileTimerRequest r;
    if (auto it = j.find("version"); it != j.end()) {
      auto v = integer_in(*it, 0, std::numeric_limits<int64_t>::max());
      if (!v) return fail("'version' is not a non-negative integer");
      r.version = *v;
    }
    auto pid = j.find("pid");
    if (pid == j.end()) return fail("no 'pid'");
    auto p = integer_in(*pid, 1, std::numeric_limits<pid_t>::max());
    if (!p) return fail("'pid' is not a positive pid");
    r.pid = static_cast<pid_t>(*p);
    auto scope = j.find("scope_id");
    if (scope == j.end() || !scope->is_string()) return fail("'scope_id' is not a string");
    r.scope_id = scope->get<std::string>();
    auto exp = j.find("expiration_time");
    if (exp == j.end() || !exp->is_number()) return fail("'expiration_time' is not a number");
    r.expiration_time = exp->get<double>();
    if (!std::isfinite(r.expiration_time)) return fail("'expiration_time' is not finite");
    auto sig = j.find("signal");
    if (sig == j.end()) return fail("no 'signal'");
    auto s = integer_in(*sig, INT_MIN, INT_MAX);
    if (!s) return fail("'signal' is not an integer");
    r.signal = static_cast<int>(*s);
    return r;
  } catch (const std::exception& e) {
    // Nothing above throws on bad input; memory exhaustion still may.
    return fail(std::string("unreadable (") + e.what() + ")");
  }
}

// ---------------------------------------------------------------------------

std::vector<TimerLineReader::Line> TimerLineReader::feed(std::string_view data) {
  std::vector<Line> out;
  size_t pos = 0;
  while (pos < data.size()) {
    const size_t nl = data.find('\n', pos);
    const std::string_view chunk =
        data.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    if (!skipping_ && partial_.size() + chunk.size() > max_) {
      // Too long: nothing more of it is kept.
      skipping_ = true;
      skipped_ = partial_.size();
      partial_.clear();
      partial_.shrink_to_fit();
    }
    if (skipping_) {
      skipped_ += chunk.size();
      if (nl == std::string_view::npos) break;
      out.push_back({"", "line of " + std::to_string(skipped_) + " bytes, longer than the " +
                             std::to_string(max_) + " allowed"});
      skipping_ = false;
      skipped_ = 0;
    } else {
      partial_.append(chunk);
      if (nl == std::string_view::npos) break;
      out.push_back({std::move(partial_), ""});
      partial_.clear();
    }
    pos = nl + 1;
  }
  return out;
}

size_t TimerLineReader::drop_partial() {
  const size_t n = skipping_ ? skipped_ : partial_.size();
  partial_.clear();
  skipping_ = false;
  skipped_ = 0;
  return n;
}

// ---------------------------------------------------------------------------

bool FileTimerTable::apply(const FileTimerRequest& r) {
  auto key = std::make_pair(r.pid, r.scope_id);
  if (r.is_release()) {
    timers_.erase(key);
    return true;
  }
  auto it = timers_.find(key);
  if (it != timers_.end()) {
    it->second = r;
    return true;
  }
  if (timers_.size() >= max_) return false;
  timers_.emplace(std::move(key), r);
  return true;
}

std::vector<FileTimerTable::Expired> FileTimerTable::expired(double now) const {
  std::map<pid_t, std::vector<const FileTimerRequest*>> by_pid;
  for (const auto& [key, r] : timers_) {
    if (r.expiration_time <= now) by_pid[key.first].push_back(&r);
  }
  std::vector<Expired> out;
  for (auto& [pid, list] : by_pid) {
    std::stable_sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
      return a->expiration_time < b->expiration_time;
    });
    Expired e;
    e.pid = pid;
    for (const auto* r : list) {
      e.scopes.push_back(r->scope_id);
      if (e.signal <= 0 && r->signal > 0) e.signal = r->signal;
    }
    out.push_back(std::move(e));
  }
  return out;
}

void FileTimerTable::remove_pid(pid_t pid) {
  auto first = timers_.lower_bound({pid, std::string()});
  auto last = first;
  while (last != timers_.end() && last->first.first == pid) ++last;
  timers_.erase(first, last);
}

size_t FileTimerTable::drop_if(const std::function<bool(pid_t)>& gone) {
  size_t n = 0;
  std::map<pid_t, bool> verdicts;  // one question per pid
  for (auto it = timers_.begin(); it != timers_.end();) {
    const pid_t pid = it->first.first;
    auto v = verdicts.find(pid);
    if (v == verdicts.end()) v = verdicts.emplace(pid, gone(pid)).first;
    if (v->second) {
      it = timers_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

std::optional<double> FileTimerTable::next_expiration() const {
  std::optional<double> next;
  for (const auto& [key, r] : timers_) {
    if (!next || r.expiration_time < *next) next = r.expiration_time;
  }
  return next;
}

// ---------------------------------------------------------------------------

bool in_process_tree(pid_t pid, const std::vector<pid_t>& roots, const std::string& proc_root) {
  if (pid <= 1 || roots.empty()) return false;
  auto is_root = [&](pid_t p) { return std::find(roots.begin(), roots.end(), p) != roots.end(); };
  if (is_root(pid)) return true;
  auto st = procfs::read_stat(pid, proc_root);
  if (!st) return false;
  if (is_root(st->session)) return true;
  pid_t p = st->ppid;
  for (int depth = 0; depth < 64 && p > 1; ++depth) {
    if (is_root(p)) return true;
    auto up = procfs::read_stat(p, proc_root);
    if (!up) return false;
    p = up->ppid;
  }
  return false;
}

void WorkerProcesses::starting() {
  std::lock_guard<std::mutex> lock(mutex_);
  starting_ = true;
}

void WorkerProcesses::set_workers(std::vector<pid_t> pids) {
  std::lock_guard<std::mutex> lock(mutex_);
  workers_ = std::move(pids);
  starting_ = false;
}

int WorkerProcesses::local_rank_of(pid_t pid) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find(workers_.begin(), workers_.end(), pid);
  return it == workers_.end() ? -1 : static_cast<int>(it - workers_.begin());
}

bool WorkerProcesses::permitted(pid_t pid) const {
  std::vector<pid_t> roots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    roots = workers_;
  }
  return in_process_tree(pid, roots);
}

bool WorkerProcesses::alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

ProcessAccess::SignalResult WorkerProcesses::signal_if_permitted(pid_t pid, int sig,
                                                                 std::string* error) {
  if (pid <= 1) return SignalResult::kNotPermitted;
  // The pidfd pins the process: checked and signalled are the same one.
  const int fd = procfs::pidfd_open(pid);
  if (fd < 0 && errno == ESRCH) return SignalResult::kGone;
  const bool pinned = fd >= 0;
  if (!permitted(pid)) {
    if (pinned) ::close(fd);
    std::lock_guard<std::mutex> lock(mutex_);
    return starting_ ? SignalResult::kNotYet : SignalResult::kNotPermitted;
  }
  const int rc = pinned ? procfs::pidfd_send_signal(fd, sig) : ::kill(pid, sig);
  const int err = errno;
  if (pinned) ::close(fd);
  if (rc == 0) return SignalResult::kSent;
  if (err == ESRCH) return SignalResult::kGone;
  if (error) *error = std::strerror(err);
  return SignalResult::kFailed;
}

// ---------------------------------------------------------------------------

FileTimerServer::FileTimerServer(FileTimerOptions options, std::shared_ptr<ProcessAccess> processes)
    : options_(std::move(options)),
      processes_(std::move(processes)),
      reader_(options_.max_line_bytes),
      table_(options_.max_timers) {
  const std::string& path = options_.path;
  auto fail = [&](const std::string& what) {
    const std::string msg = std::string(kTimerFileEnv) + ": cannot " + what + " '" + path +
                            "': " + std::strerror(errno);
    for (int fd : {read_fd_, keep_fd_, wake_fds_[0], wake_fds_[1]}) {
      if (fd >= 0) ::close(fd);
    }
    return ConfigError(msg + "; set it to a path in a writable directory");
  };
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    // A pipe left by an agent that died is replaced, as torch replaces it;
    // anything else there is somebody's file, never removed.
    if (!S_ISFIFO(st.st_mode)) {
      throw ConfigError(std::string(kTimerFileEnv) + ": '" + path +
                        "' exists and is not a named pipe; remove it or choose another path");
    }
    if (::unlink(path.c_str()) != 0) throw fail("replace the named pipe");
  }
  // Only this user's processes may write requests (torch's pipe follows the
  // umask, usually 0644: writable by its owner alone as well).
  if (::mkfifo(path.c_str(), 0600) != 0) throw fail("create the named pipe");
  read_fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (read_fd_ < 0) {
    ::unlink(path.c_str());
    throw fail("open the named pipe");
  }
  // Our own writer keeps the pipe from reading end-of-file between clients,
  // so that poll() sleeps until a request comes.
  keep_fd_ = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  struct stat mine {};
  if (keep_fd_ < 0 || ::fstat(read_fd_, &mine) != 0 || ::pipe2(wake_fds_, O_CLOEXEC) != 0) {
    ::unlink(path.c_str());
    throw fail("open the named pipe");
  }
  dev_ = mine.st_dev;
  ino_ = mine.st_ino;
  buffer_.resize(64 * 1024);
  last_byte_ = Clock::now();
  next_sweep_ = Clock::now() + 1s;
  thread_ = std::thread([this] { loop(); });
}

FileTimerServer::~FileTimerServer() {
  if (thread_.joinable()) {
    const char byte = 0;
    // The thread wakes on this within one poll; if the write fails (it
    // cannot on an empty pipe), the poll's own timeout still ends the wait
    // within one interval, since the thread also checks the pipe below.
    [[maybe_unused]] auto n = ::write(wake_fds_[1], &byte, 1);
    thread_.join();
  }
  remove_pipe();
  for (int fd : {read_fd_, keep_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void FileTimerServer::remove_pipe() noexcept {
  if (removed_.exchange(true)) return;
  struct stat st {};
  // Only the pipe this server made: a path replaced since is somebody else's.
  if (::lstat(options_.path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) {
    ::unlink(options_.path.c_str());
  }
}

FileTimerStats FileTimerServer::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  FileTimerStats s = stats_;
  s.active_timers = table_.size();
  return s;
}

double FileTimerServer::now() const {
  if (options_.now) return options_.now();
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void FileTimerServer::loop() {
  auto log = get_logger("agent");
  for (;;) {
    try {
      auto timeout = options_.interval;
      if (reader_.has_partial()) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            last_byte_ + options_.partial_line_timeout - Clock::now());
        timeout = std::clamp(left, std::chrono::milliseconds(1), timeout);
      }
      pollfd fds[2] = {{read_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
      const int n = ::poll(fds, 2, static_cast<int>(timeout.count()));
      if (n < 0 && errno != EINTR) {
        log->error("file timer: poll on '{}' failed: {}", options_.path, std::strerror(errno));
        std::this_thread::sleep_for(options_.interval);
      }
      if (n > 0 && fds[1].revents != 0) return;
      if (n > 0 && (fds[0].revents & (POLLERR | POLLNVAL)) != 0) {
        // Cannot happen while we hold both ends; never spin on it.
        log->error("file timer: the pipe '{}' reports an error", options_.path);
        std::this_thread::sleep_for(options_.interval);
      } else if (n > 0 && fds[0].revents != 0) {
        read_pipe();
      }
      pass();
    } catch (const std::exception& e) {
      // The thread's boundary: a request that breaks a pass is lost, the
      // server goes on.
      log->error("file timer: {}", e.what());
      std::this_thread::sleep_for(options_.interval);
    } catch (...) {
      log->error("file timer: unknown error");
      std::this_thread::sleep_for(options_.interval);
    }
  }
}

void FileTimerServer::read_pipe() {
  size_t total = 0;
  while (total < kMaxBytesPerPass) {
    const ssize_t n = ::read(read_fd_, buffer_.data(), buffer_.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EAGAIN: drained (end-of-file cannot happen: keep_fd_)
    total += static_cast<size_t>(n);
    last_byte_ = Clock::now();
    for (const auto& line :
         reader_.feed(std::string_view(buffer_.data(), static_cast<size_t>(n)))) {
      handle_line(line);
    }
  }
}

void FileTimerServer::reject(const std::string& why) {
  auto log = get_logger("agent");
  const auto t = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected_lines;
  }
  // One warning a second at most: a flood of junk cannot flood the log.
  if (t - last_warning_ >= 1s) {
    if (quiet_rejections_ > 0) {
      log->warn("file timer: ignored a line ({}), and {} more since the last warning", why,
                quiet_rejections_);
    } else {
      log->warn("file timer: ignored a line ({})", why);
    }
    last_warning_ = t;
    quiet_rejections_ = 0;
  } else {
    ++quiet_rejections_;
    log->debug("file timer: ignored a line ({})", why);
  }
}

void FileTimerServer::handle_line(const TimerLineReader::Line& line) {
  if (!line.error.empty()) return reject(line.error);
  std::string error;
  auto r = parse_timer_request(line.text, &error);
  if (!r) return reject(error);
  auto log = get_logger("agent");
  log->debug("file timer: {} pid={} scope={} expiration_time={} signal={}",
             r->is_release() ? "release" : "acquire", r->pid, excerpt(r->scope_id, 200),
             r->expiration_time, r->signal);
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.requests;
  stats_.last_request = now();
  if (!table_.apply(*r)) {
    log->warn("file timer: {} timers held; ignored the timer of pid {} scope {}", table_.size(),
              r->pid, excerpt(r->scope_id));
  }
}

void FileTimerServer::pass() {
  if (reader_.has_partial() && Clock::now() - last_byte_ >= options_.partial_line_timeout) {
    const size_t n = reader_.drop_partial();
    reject("a fragment of " + std::to_string(n) + " bytes without its newline");
  }
  reap();
  if (Clock::now() >= next_sweep_) {
    next_sweep_ = Clock::now() + 1s;
    // Timers of processes that exited are forgotten (torch's clear_timers).
    std::lock_guard<std::mutex> lock(mutex_);
    table_.drop_if([this](pid_t pid) { return !processes_->alive(pid); });
  }
}

void FileTimerServer::reap() {
  std::vector<FileTimerTable::Expired> expired;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    expired = table_.expired(now());
  }
  auto log = get_logger("agent");
  for (const auto& e : expired) {
    bool killed = false;
    bool deferred = false;
    const std::string scopes = scope_list(e.scopes);
    if (e.signal <= 0) {
      log->info("file timer: pid {} timer expired ({}) with no signal to send: not killed", e.pid,
                scopes);
    } else if (e.signal > SIGRTMAX) {
      log->warn(
          "file timer: pid {} timer expired ({}) with signal {}, which is no signal: not "
          "killed",
          e.pid, scopes, e.signal);
    } else {
      std::string error;
      switch (processes_->signal_if_permitted(e.pid, e.signal, &error)) {
        case ProcessAccess::SignalResult::kSent:
          killed = true;
          {
            std::lock_guard<std::mutex> lock(mutex_);
            ++stats_.kills;
          }
          log->warn("file timer: pid {} timer expired ({}); sent it {}", e.pid, scopes,
                    worker::signal_name(e.signal));
          break;
        case ProcessAccess::SignalResult::kGone:
          log->info("file timer: pid {} timer expired ({}); the process is gone", e.pid, scopes);
          break;
        case ProcessAccess::SignalResult::kNotPermitted:
          log->warn(
              "file timer: pid {} timer expired ({}), but that pid is no worker of this "
              "agent nor a descendant of one: not signalled",
              e.pid, scopes);
          break;
        case ProcessAccess::SignalResult::kNotYet:
          deferred = true;
          break;
        case ProcessAccess::SignalResult::kFailed:
          log->error("file timer: pid {} timer expired ({}); sending {} failed: {}", e.pid, scopes,
                     worker::signal_name(e.signal), error);
          break;
      }
    }
    if (deferred) continue;  // the timers stay: the next pass asks again
    {
      std::lock_guard<std::mutex> lock(mutex_);
      table_.remove_pid(e.pid);
    }
    if (options_.on_expired) {
      try {
        options_.on_expired(e, killed);
      } catch (const std::exception& ex) {
        log->warn("file timer: reporting the expiry of pid {} failed: {}", e.pid, ex.what());
      }
    }
  }
}

std::optional<std::string> file_timer_path(const std::map<std::string, std::string>& env) {
  auto on = env.find(kEnableFileTimerEnv);
  if (on == env.end() || on->second != "1") return std::nullopt;
  auto path = env.find(kTimerFileEnv);
  if (path != env.end() && !path->second.empty()) return path->second;
  return std::string(kDefaultTimerFilePrefix) + uuid4();
}

}  // namespace ctorchrun::agent

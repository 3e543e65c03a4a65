#include "worker/console.h"

#include <signal.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "worker/tee_writer.h"

namespace ctorchrun::worker {

namespace {

using Clock = std::chrono::steady_clock;

const char* stream_name(int fd) { return fd == STDOUT_FILENO ? "stdout" : "stderr"; }

// One console stream: a bounded queue and the thread that writes it. Never
// destroyed: a writer blocked in write() on a console nobody reads must not
// find its queue gone while the process exits.
class Stream {
 public:
  explicit Stream(int fd) : fd_(fd) {}

  bool write(std::string text) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_) return false;
      if (!queue_.empty() && bytes_ + text.size() > Console::kQueueLimit) {
        ++dropped_;
        ++unreported_;
        return false;
      }
      bytes_ += text.size();
      queue_.push_back(std::move(text));
      start_locked();
    }
    wake_.notify_one();
    return true;
  }

  // True when empty; false after `stall` without progress.
  // A stream found stalled by an earlier drain() is not waited for again
  // until it has made progress.
  bool drain(std::chrono::milliseconds stall) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (stalled_ && progress_ == stalled_progress_) return idle_locked();
    for (;;) {
      if (idle_locked()) return true;
      uint64_t before = progress_;
      done_.wait_for(lock, stall, [&] { return idle_locked() || progress_ != before; });
      if (!idle_locked() && progress_ == before) {
        stalled_ = true;
        stalled_progress_ = progress_;
        return false;
      }
    }
  }

  // Lines dropped and not yet reported, plus those still waiting; resets the
  // first count.
  void take_unwritten(uint64_t* dropped, uint64_t* waiting) {
    std::lock_guard<std::mutex> lock(mutex_);
    *dropped = unreported_;
    unreported_ = 0;
    *waiting = broken_ ? 0 : queue_.size() + (busy_ ? 1 : 0);
    // Said once while the console makes no progress.
    if (waiting_said_ && progress_ == waiting_said_progress_) *waiting = 0;
    if (*waiting > 0) {
      waiting_said_ = true;
      waiting_said_progress_ = progress_;
    }
  }

  uint64_t dropped() {
    std::lock_guard<std::mutex> lock(mutex_);
    return dropped_;
  }

 private:
  bool idle_locked() const { return broken_ || (queue_.empty() && !busy_); }

  void start_locked() {
    if (started_) return;
    started_ = true;
    // The writer takes no signal: the agent's are handled by its signal
    // thread, and a console pipe closed under it must give EPIPE, not SIGPIPE.
    sigset_t all;
    sigset_t old;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);
    std::thread([this] { run(); }).detach();
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return !queue_.empty(); });
      std::string text = std::move(queue_.front());
      queue_.pop_front();
      bytes_ -= text.size();
      busy_ = true;
      lock.unlock();
      bool ok = detail::write_all(fd_, text.data(), text.size());
      text = std::string();
      lock.lock();
      busy_ = false;
      ++progress_;
      if (!ok) {
        broken_ = true;
        queue_.clear();
        bytes_ = 0;
        done_.notify_all();
        return;
      }
      uint64_t report = 0;
      if (queue_.empty() && unreported_ > 0) report = std::exchange(unreported_, 0);
      done_.notify_all();
      if (report > 0) {
        lock.unlock();
        get_logger("worker")->warn(
            "{} lines for the console ({}) were dropped: it did not keep up and more than {} "
            "bytes waited; the log files have them",
            report, stream_name(fd_), Console::kQueueLimit);
        lock.lock();
      }
    }
  }

  const int fd_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::deque<std::string> queue_;
  size_t bytes_ = 0;
  bool busy_ = false;
  bool started_ = false;
  bool broken_ = false;
  uint64_t progress_ = 0;
  bool stalled_ = false;
  bool waiting_said_ = false;
  uint64_t waiting_said_progress_ = 0;
  uint64_t stalled_progress_ = 0;
  uint64_t dropped_ = 0;
  uint64_t unreported_ = 0;
};

Stream& stream(int fd) {
  static Stream* const out = new Stream(STDOUT_FILENO);
  static Stream* const err = new Stream(STDERR_FILENO);
  return fd == STDOUT_FILENO ? *out : *err;
}

class LogSink final : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    Console::write(STDERR_FILENO, std::string(formatted.data(), formatted.size()));
  }
  void flush_() override {}
};

}  // namespace

bool Console::write(int fd, std::string text) {
  if (fd != STDOUT_FILENO && fd != STDERR_FILENO) return false;
  return stream(fd).write(std::move(text));
}

bool Console::flush(std::chrono::milliseconds stall) {
  bool out_ok = stream(STDOUT_FILENO).drain(stall);
  bool err_ok = stream(STDERR_FILENO).drain(stall);
  uint64_t dropped[2] = {0, 0};
  uint64_t waiting[2] = {0, 0};
  for (int i = 0; i < 2; ++i) stream(i + 1).take_unwritten(&dropped[i], &waiting[i]);
  for (int i = 0; i < 2; ++i) {
    if (dropped[i] == 0 && waiting[i] == 0) continue;
    get_logger("worker")->warn(
        "{} lines for the console ({}) were not written: {} dropped as it did not keep up, {} "
        "still waiting; the log files have them",
        dropped[i] + waiting[i], stream_name(i + 1), dropped[i], waiting[i]);
  }
  err_ok = stream(STDERR_FILENO).drain(stall) && err_ok;
  return out_ok && err_ok;
}

uint64_t Console::dropped(int fd) {
  if (fd != STDOUT_FILENO && fd != STDERR_FILENO) return 0;
  return stream(fd).dropped();
}

std::shared_ptr<spdlog::sinks::sink> Console::log_sink() { return std::make_shared<LogSink>(); }

}  // namespace ctorchrun::worker

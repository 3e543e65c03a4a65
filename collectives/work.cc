#include "collectives/work.h"

#include <utility>

#include "common/error.h"

namespace ctorchrun::dist {

PromiseWork::PromiseWork(std::string description) : description_(std::move(description)) {}

void PromiseWork::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

void PromiseWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    throw TimeoutError(description_ + " did not complete within " +
                       std::to_string(timeout.count()) +
                       " ms (Work::wait timeout); it is still running");
  }
  if (error_) std::rethrow_exception(error_);
}

bool PromiseWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void PromiseWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

}  // namespace ctorchrun::dist

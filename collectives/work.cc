#include "collectives/work.h"

#include <thread>
#include <utility>

#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::dist {
namespace {

void run_callback(const std::function<void(std::exception_ptr)>& callback,
                  const std::exception_ptr& error) noexcept {
  try {
    callback(error);
  } catch (const std::exception& e) {
    get_logger("coll")->error("a Work completion callback threw, which it must not: {}", e.what());
  } catch (...) {
    get_logger("coll")->error("a Work completion callback threw, which it must not");
  }
}

}  // namespace

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
  std::vector<std::function<void(std::exception_ptr)>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  // error_ is written once, above: reading it unlocked from here on is safe.
  for (const auto& callback : callbacks) run_callback(callback, error_);
}

void PromiseWork::add_callback(std::function<void(std::exception_ptr)> callback) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  run_callback(callback, error_);
}

void when_complete(const WorkHandle& work, std::function<void(std::exception_ptr)> callback) {
  if (auto* promise = dynamic_cast<PromiseWork*>(work.get())) {
    promise->add_callback(std::move(callback));
    return;
  }
  // Every Work's own wait() is bounded by its operation's timeout, so this
  // thread ends; it holds the Work (and so its buffers' owner's callback).
  std::thread([work, callback = std::move(callback)] {
    std::exception_ptr error;
    try {
      work->wait();
    } catch (...) {
      error = std::current_exception();
    }
    run_callback(callback, error);
  }).detach();
}

}  // namespace ctorchrun::dist

#include "collectives/op_queue.h"

#include "common/error.h"

namespace ctorchrun::dist {

OpQueue::OpQueue(Execute execute) : execute_(std::move(execute)) {
  worker_ = std::thread([this] { work_loop(); });
}

OpQueue::~OpQueue() { stop(); }

void OpQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

std::exception_ptr OpQueue::execute(const Item& item) {
  try {
    execute_(item.op, item.tag, *item.work);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

WorkHandle OpQueue::run(const Op& op, bool async, std::string description) {
  auto work = std::make_shared<PromiseWork>(std::move(description));
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) {
    lock.unlock();
    work->finish(std::make_exception_ptr(
        IoError(work->description() + " never ran: its process group was destroyed")));
    if (!async) work->wait();
    return work;
  }
  // The tag is this call's place in the group's order: calls run in tag
  // order, blocking or not, so that every rank runs tag n as its n-th.
  const uint32_t tag = next_tag_++;
  queue_.push_back(Item{op, tag, work, !async});
  if (async) {
    lock.unlock();
    cv_.notify_all();
    return work;
  }
  cv_.wait(lock,
           [&] { return stopping_ || (!busy_ && !queue_.empty() && queue_.front().work == work); });
  if (stopping_) {
    lock.unlock();
    work->wait();  // the worker fails it: the group is being destroyed
    return work;
  }
  Item item = std::move(queue_.front());
  queue_.pop_front();
  busy_ = true;
  lock.unlock();
  const std::exception_ptr error = execute(item);
  lock.lock();
  busy_ = false;
  lock.unlock();
  cv_.notify_all();
  work->finish(error);
  if (error) std::rethrow_exception(error);
  return work;
}

void OpQueue::work_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] {
      return stopping_ || (!queue_.empty() && !busy_ && !queue_.front().caller_runs);
    });
    if (stopping_) {
      // A blocking caller may still be running its item: wait for it, so
      // that stop() returns with nothing in flight.
      cv_.wait(lock, [&] { return !busy_; });
      for (auto& item : queue_) {
        item.work->finish(std::make_exception_ptr(
            IoError(item.work->description() + " never ran: its process group was destroyed")));
      }
      queue_.clear();
      return;
    }
    Item item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    const std::exception_ptr error = execute(item);
    item.work->finish(error);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace ctorchrun::dist

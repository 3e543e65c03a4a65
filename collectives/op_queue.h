#pragma once

// OpQueue: a process group's collectives in the order they were started.
//
// Every rank must run a group's collectives in one order (torch's process
// groups promise it, and the transports rely on it). A backend hands each
// collective to run(): it is given the next tag (0, 1, 2, ... its place in
// the order) and runs once everything started before it has finished, one at
// a time. An async call returns at once and runs on the queue's own thread;
// a blocking call runs on its caller's thread when its turn comes, which
// saves the hand-off (a few microseconds a call) and returns the completed
// Work, or throws what the operation threw.
//
// stop() (and the destructor) waits for the running operation, then fails
// every queued one with IoError ("never ran: its process group was
// destroyed"); blocking callers then wake with that error. A backend calls
// stop() first in its destructor, before the state `execute` uses is gone.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "collectives/backend.h"
#include "collectives/work.h"

namespace ctorchrun::dist {

class OpQueue {
 public:
  // Runs one operation; throws on failure. `work` carries its description.
  using Execute = std::function<void(const Op& op, uint32_t tag, const PromiseWork& work)>;

  explicit OpQueue(Execute execute);
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `op`, described by `description` in its Work and errors.
  WorkHandle run(const Op& op, bool async, std::string description);

  void stop();

 private:
  struct Item {
    Op op;
    uint32_t tag;
    std::shared_ptr<PromiseWork> work;
    bool caller_runs;  // a blocking call: its own thread runs it
  };

  void work_loop();
  std::exception_ptr execute(const Item& item);

  const Execute execute_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  uint32_t next_tag_ = 0;
  std::thread worker_;
};

}  // namespace ctorchrun::dist

#pragma once

// Work: the handle an asynchronous collective returns.
//
// wait() blocks until the operation has completed and rethrows its failure:
// TimeoutError when the operation's own timeout passed, IoError when a peer
// failed (closed its connection, died). wait(timeout) gives up earlier with a
// TimeoutError of its own; the operation keeps running in the background
// until it completes or its own timeout ends it, so the buffers must stay
// alive until wait() returns normally or the group is destroyed.
//
// The same holds for send and recv, with one more rule on gloo: it cannot
// take back one posted send or recv, so dropping the last handle of one that
// has not completed cancels it by closing the group's connections, at once
// (the op's own timeout would do the same later); every later call on that
// group that goes through gloo's connections, on every rank, then fails with
// an IoError that says why. On the shared-memory path (a group on one host,
// collectives/shm_backend.h) those are send, recv, gather, scatter and
// all_to_all; the other collectives carry on through shared memory. Wait for a
// send or recv before dropping its Work. Their is_completed() turns true once
// a wait() has seen the completion.
//
// Thread safety: wait() and is_completed() may be called from any thread,
// several at once; a wait(timeout) is not held up by another thread's wait.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ctorchrun::dist {

class Work {
 public:
  virtual ~Work() = default;

  // Waits for completion (bounded by the operation's own timeout).
  virtual void wait() = 0;
  // Waits at most `timeout`; TimeoutError if the operation is still running.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  virtual bool is_completed() = 0;
};

using WorkHandle = std::shared_ptr<Work>;

// A Work completed by another thread through finish(). Backends use it.
class PromiseWork : public Work {
 public:
  explicit PromiseWork(std::string description);

  void wait() override;
  void wait(std::chrono::milliseconds timeout) override;
  bool is_completed() override;

  // Marks the operation completed, with `error` (null on success), then
  // runs the callbacks of when_complete on this thread, in the order given.
  void finish(std::exception_ptr error);
  const std::string& description() const { return description_; }

  // See when_complete below.
  void add_callback(std::function<void(std::exception_ptr)> callback);

 private:
  std::string description_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<std::function<void(std::exception_ptr)>> callbacks_;
};

// Calls `callback` once `work` has completed, with its error (null on
// success): on the thread that completes it (a group's queue thread, or a
// blocking caller), or at once on this thread when it already has. A Work
// that is no PromiseWork (gloo's send and recv) gets a thread of its own
// that waits for it. The callback must not throw (a throw is logged and
// dropped) and should be short: the group's next operation waits for it.
// torch's futures are completed this way (torch_backend/).
void when_complete(const WorkHandle& work, std::function<void(std::exception_ptr)> callback);

}  // namespace ctorchrun::dist

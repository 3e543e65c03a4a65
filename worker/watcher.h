#pragma once

// Internal to worker/: the watcher process, which kills the workers' process
// groups when the agent dies, however it dies.
//
// PR_SET_PDEATHSIG alone is not enough: it reaches only the worker itself,
// not the children it starts, and it fires when the *thread* that forked the
// worker exits. So the launcher forks this watcher first, before any worker,
// and keeps one end of a socket pair to it. The watcher closes every other
// descriptor, moves to a session of its own (so a signal to the agent's
// process group or terminal does not take it down with the agent), ignores
// SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGPIPE, sets no PDEATHSIG, and reads
// text lines:
//
//   "+<pgid>\n"   a worker's process group to kill if the agent dies
//   "-<pgid>\n"   forget it: the launcher has dealt with that group
//   "bye\n"       the launcher is shutting down cleanly: exit, kill nothing
//
// End of stream without "bye" means every copy of the agent's end is closed:
// the agent is gone. The watcher then sends SIGKILL to every group it knows
// (never to a pgid <= 1) and exits. The agent's end is close-on-exec and
// workers mark every descriptor above 2 close-on-exec, so only the agent
// holds it.
//
// Thread safety: watch(), forget() and the destructor may be called from any
// thread (a mutex serialises them).

#include <sys/types.h>

#include <memory>
#include <mutex>

#include "worker/unique_fd.h"

namespace ctorchrun::worker::detail {

class Watcher {
 public:
  // Forks the watcher. Throws IoError when the socket pair or fork fails.
  static std::unique_ptr<Watcher> spawn();

  // Says "bye" and reaps the watcher (it exits at once on "bye").
  ~Watcher();
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;

  void watch(pid_t pgid);
  // The agent's end of the channel, for a forked worker to announce its own
  // process group before it execs (see SpawnSetup): then no code of the
  // worker runs before the watcher knows its group.
  int channel_fd() const { return fd_.get(); }
  void forget(pid_t pgid);

  pid_t pid() const { return pid_; }

  // Reaps the watcher if it has exited, which it should never do while the
  // launcher lives; true (and a warning logged once) if it has. Never blocks.
  bool reap_if_exited();

  // Closes the agent's end without "bye", exactly as the agent's death would,
  // and reaps the watcher. For tests of the watcher itself.
  void close_without_bye_for_test();

 private:
  Watcher(UniqueFd fd, pid_t pid) : fd_(std::move(fd)), pid_(pid) {}
  void send(const char* line, size_t len);
  void reap_blocking();

  std::mutex mutex_;
  UniqueFd fd_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  bool broken_ = false;  // a send failed: warned once
};

}  // namespace ctorchrun::worker::detail

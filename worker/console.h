#pragma once

// worker::Console: the launcher's own stdout and stderr (descriptors 1 and 2,
// inherited and shared with the user's shell), written so that a console
// that does not drain (a paused pager, a stopped log collector, a FIFO nobody
// reads) can never stall the launcher.
//
// Everything the launcher itself prints goes through here: teed worker lines
// (stdout and stderr), its log lines (see log_sink()) and the failure
// summary. Each stream has a queue and a thread of its own that does the
// blocking write(); callers only append to the queue, so no other thread
// (reaping workers, forwarding signals, logging) ever blocks on the console.
//
//  - At most kQueueLimit bytes wait per stream; a line that does not fit is
//    dropped whole (a single line of any size is taken when nothing waits)
//    and counted. When the stream has drained again, the count is logged at
//    warning level; what is dropped at exit is logged by flush().
//  - Lines are written whole, each with one write(), in the order queued.
//  - The descriptors are never switched to O_NONBLOCK (the shell shares
//    them); if somebody else did, the writer thread waits with poll().
//  - A write error (a closed pipe) ends that stream's console output; later
//    lines are discarded without counting.
//
// Descriptors of workers that are not teed are the workers' own business: they
// write to the inherited descriptors directly, as under torchrun.
//
// Thread safety: every function may be called from any thread. None is
// async-signal-safe. The queues live until the process ends.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace spdlog::sinks {
class sink;
}

namespace ctorchrun::worker {

class Console {
 public:
  static constexpr size_t kQueueLimit = size_t{1} << 20;

  // Queues `text` (whole lines, each ending in '\n') for descriptor `fd` (1
  // or 2). Never blocks. False when it was dropped.
  static bool write(int fd, std::string text);

  // Waits until both queues are written, or until neither made progress for
  // `stall` (a console that does not drain). Then logs (and waits, with the
  // same bound, for) how many lines of each stream were dropped or are still
  // waiting and will not be written. True when everything was written.
  static bool flush(std::chrono::milliseconds stall);

  // Lines of `fd` dropped so far (not counting those discarded after a
  // write error).
  static uint64_t dropped(int fd);

  // An spdlog sink that queues each formatted log line for stderr.
  static std::shared_ptr<spdlog::sinks::sink> log_sink();

  // How long flush() waits for a stalled console at the launcher's exit.
  static constexpr std::chrono::milliseconds kExitStall{500};
};

}  // namespace ctorchrun::worker

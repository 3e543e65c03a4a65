#pragma once

// Progress of a worker read from outside, for --hang_timeout: what a stalled
// worker's process tree does not advance, sampled from /proc without the
// worker's help.
//
// A sample holds counters that only move when the tree does something:
//  - the worker's main thread's CPU time (/proc/<pid>/task/<pid>/stat): a
//    Python worker's interpreter runs there, so a thread pool or a
//    communication thread busy on its own does not hide a stalled script;
//  - the CPU time of its live descendants (/proc/<d>/stat) and of those it
//    reaped (cutime + cstime of the worker): data-loader workers are child
//    processes;
//  - the bytes read and written by the worker (all its threads) and by every
//    live descendant (rchar + wchar of /proc/<p>/io: files, sockets, pipes,
//    the console);
//  - the size of the worker's teed or redirected output files;
//  - the number of live descendants (a child starting or ending is progress).
// Any difference between two samples is progress; two equal samples mean the
// tree did nothing measurable between them. What it misses: a thread spinning
// in a busy wait on the main thread counts as progress (a false negative,
// never a false positive).
//
// Everything is read under `proc_root` ("/proc"; tests pass a directory laid
// out the same way). Reading never throws: a file that cannot be read (the
// process ended meanwhile) reads as zero, and a worker that is gone samples
// with alive = false. Thread-safe (no state).

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ctorchrun::worker {

struct ProgressSample {
  bool alive = false;
  uint64_t main_thread_ticks = 0;   // utime + stime of the main thread
  uint64_t reaped_child_ticks = 0;  // cutime + cstime of the worker
  uint64_t descendant_ticks = 0;    // utime + stime of every live descendant
  uint64_t io_bytes = 0;            // rchar + wchar of the worker and its descendants
  uint64_t output_bytes = 0;        // sizes of the output files
  uint64_t descendants = 0;         // live descendants

  bool operator==(const ProgressSample& o) const {
    return alive == o.alive && main_thread_ticks == o.main_thread_ticks &&
           reaped_child_ticks == o.reaped_child_ticks && descendant_ticks == o.descendant_ticks &&
           io_bytes == o.io_bytes && output_bytes == o.output_bytes && descendants == o.descendants;
  }
  bool operator!=(const ProgressSample& o) const { return !(*this == o); }
};

// Samples the process tree rooted at `pid`. Descendants are found through
// /proc/<p>/task/<t>/children (a descendant that moved to another parent,
// such as a daemon, is not the worker's any more).
ProgressSample sample_progress(pid_t pid, const std::vector<std::string>& output_files,
                               const std::string& proc_root = "/proc");

// utime + stime (fields 14 and 15) of a /proc stat line, and cutime + cstime
// (16 and 17) when `children`; nullopt-like 0 when the line is not one.
// The command name (field 2) may hold spaces and parentheses: fields are
// counted from the last ')'.
uint64_t stat_ticks(const std::string& stat_line, bool children = false);

// rchar + wchar of a /proc/<p>/io file's text; 0 when absent.
uint64_t io_chars(const std::string& io_text);

// One worker's stall clock: fed samples, it remembers when the sample last
// changed. The first sample counts as progress. Pure: the caller passes the
// time (tests use a manual clock). Not thread-safe.
class StallTracker {
 public:
  using Clock = std::chrono::steady_clock;

  // Feeds a sample taken at `now`; returns true when it shows progress.
  bool observe(const ProgressSample& sample, Clock::time_point now);
  // When the last progress was seen; the epoch when nothing was observed.
  Clock::time_point last_progress() const { return last_progress_; }
  // How long nothing moved, as of `now` (zero before the first sample).
  std::chrono::milliseconds stalled_for(Clock::time_point now) const;
  bool observed() const { return observed_; }

 private:
  bool observed_ = false;
  ProgressSample last_;
  Clock::time_point last_progress_{};
};

}  // namespace ctorchrun::worker

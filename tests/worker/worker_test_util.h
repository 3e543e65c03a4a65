#pragma once

// Shared by the worker tests: temporary directories, files, /proc look-ups
// and bounded waits for effects that come with no event to wait on.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"
#include "worker/launcher.h"

namespace ctorchrun::worker::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents.
using ctorchrun::testing::TempDir;

std::string read_file(const std::string& path);  // "" when missing
std::vector<std::string> split_lines(const std::string& text);

// Polls `pred` every few ms until true (returns true) or `timeout` passes.
// For effects with no event to await (another process's death, a file).
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

// Exists and is not a zombie.
bool process_alive(pid_t pid);
// Pids whose parent is `parent` (zombies included), with their names.
struct ChildProcess {
  pid_t pid;
  std::string comm;
  char state;
};
std::vector<ChildProcess> children_of(pid_t parent);

// The pid written to `path` by fake_worker --pidfile/--grandchild, waiting
// up to `timeout` for the file; -1 if it never appeared.
pid_t wait_for_pid_file(const std::string& path, std::chrono::milliseconds timeout);

// A spec that runs fake_worker with `args`, env {PATH, LOCAL_RANK}.
WorkerSpec fake_spec(int local_rank, std::vector<std::string> args);

// wait()s until `count` exits were returned or `timeout` passed.
std::vector<WorkerExit> wait_for_exits(Launcher& launcher, size_t count,
                                       std::chrono::milliseconds timeout);

}  // namespace ctorchrun::worker::testing

#pragma once

// Reading /proc without exceptions. A process's /proc files answer read(2)
// with ESRCH once it has exited between the open and the read, and
// libstdc++'s std::filebuf turns a failed read into an exception
// (std::ios_base::failure, "basic_filebuf::underflow error reading the
// file") that escapes through std::istreambuf_iterator. On the launcher's io
// thread such an exception once stopped the SIGCHLD handler from re-arming,
// so the workers' exits went unseen. Read /proc with these instead.

#include <string>

namespace ctorchrun::worker {

// What `fd` gives until end of file or an error (at most 4 MiB); never
// throws. An error ends the text where it happened.
std::string read_fd_text(int fd);
// The whole of `path` (opened read-only); "" when it cannot be opened.
std::string read_proc_file(const std::string& path);

}  // namespace ctorchrun::worker

#pragma once

// Reading /proc without exceptions. A process's /proc files answer read(2)
// with ESRCH once it has exited between the open and the read, and
// libstdc++'s std::filebuf turns a failed read into an exception
// (std::ios_base::failure, "basic_filebuf::underflow error reading the
// file") that escapes through std::istreambuf_iterator. On the launcher's io
// thread such an exception once stopped the SIGCHLD handler from re-arming,
// so the workers' exits went unseen. Read /proc with these instead.

#include <cstddef>
#include <optional>
#include <string>

namespace ctorchrun::worker {

// The most a /proc file read here may hold.
constexpr size_t kProcTextLimit = size_t{4} << 20;

// What `fd` gives until end of file; never throws. nullopt when a read fails
// or the text would pass kProcTextLimit: a text cut short is never taken for
// a whole one (a pid cut to its first digits is another process's pid).
std::optional<std::string> read_fd_text(int fd);
// The whole of `path` (opened read-only); "" when it cannot be opened, a read
// fails or it is too long, which callers take as "the process is gone".
std::string read_proc_file(const std::string& path);

}  // namespace ctorchrun::worker

#pragma once

// Internal to worker/: finding the program a worker runs, before forking, so
// that a missing or non-executable program is reported as what it is instead
// of as a mysterious exit code.

#include <string>

namespace ctorchrun::worker::detail {

// Returns the path to exec for `program` (a worker's argv[0]):
//  - with a '/', the program itself, taken relative to `cwd` when relative
//    and `cwd` is not empty (the worker execs after changing directory);
//  - otherwise the first executable regular file `dir/program` for the dirs
//    of `search_path` (a PATH value; an empty entry is the current directory,
//    i.e. `cwd`), as execvp searches.
// Throws IoError with a one-line reason naming the program, e.g.
// "/nonexistent/x: No such file or directory" or
// "trainer: not found in PATH=/usr/bin:/bin".
std::string find_executable(const std::string& program, const std::string& search_path,
                            const std::string& cwd);

}  // namespace ctorchrun::worker::detail

#include "worker/executable.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace ctorchrun::worker::detail {

namespace {

// 0 when `path` is an executable regular file, else the errno execve would
// most likely give.
int check_executable(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno;
  if (S_ISDIR(st.st_mode)) return EISDIR;
  if (::access(path.c_str(), X_OK) != 0) return errno;
  return 0;
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace

std::string find_executable(const std::string& program, const std::string& search_path,
                            const std::string& cwd) {
  if (program.empty()) throw IoError("empty program name (argv[0])");
  if (program.find('/') != std::string::npos) {
    std::string full = program[0] != '/' && !cwd.empty() ? join(cwd, program) : program;
    if (int err = check_executable(full)) throw IoError(program + ": " + std::strerror(err));
    return full;
  }
  std::string denied;
  size_t begin = 0;
  for (;;) {
    size_t end = search_path.find(':', begin);
    std::string dir =
        search_path.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (dir.empty()) dir = ".";
    if (dir[0] != '/' && !cwd.empty()) dir = join(cwd, dir);
    std::string candidate = join(dir, program);
    int err = check_executable(candidate);
    if (err == 0) return candidate;
    if (err == EACCES && denied.empty()) denied = candidate;
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  if (!denied.empty()) {
    throw IoError(program + ": " + std::strerror(EACCES) + " (" + denied + " is not executable)");
  }
  throw IoError(program + ": not found in PATH=" + search_path);
}

}  // namespace ctorchrun::worker::detail

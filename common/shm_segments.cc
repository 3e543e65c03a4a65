#include "common/shm_segments.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

namespace ctorchrun::shm_segments {

std::string pid_namespace() {
  char link[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
  const std::string text = n > 0 ? std::string(link, static_cast<size_t>(n)) : "";
  std::string digits;
  for (char c : text) {
    if (c >= '0' && c <= '9') digits += c;
  }
  return digits.empty() ? "0" : digits;
}

std::string prefix_of(pid_t pid) {
  return std::string(kPrefix) + pid_namespace() + "." + std::to_string(pid) + ".";
}

std::string folder(const std::string& shm_dir_setting) {
  return shm_dir_setting.empty() ? "/dev/shm" : shm_dir_setting;
}

int remove_created_by(const std::vector<pid_t>& pids, const std::string& dir) {
  if (pids.empty()) return 0;
  std::vector<std::string> prefixes;
  for (pid_t pid : pids) prefixes.push_back(prefix_of(pid));
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    for (const std::string& p : prefixes) {
      if (name.rfind(p, 0) == 0 && ::unlinkat(::dirfd(d), name.c_str(), 0) == 0) {
        ++removed;
        break;
      }
    }
  }
  ::closedir(d);
  return removed;
}

}  // namespace ctorchrun::shm_segments

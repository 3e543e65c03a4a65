#include "worker/procfs.h"

#include <charconv>
#include <cstring>
#include <vector>

#include "worker/proc_file.h"

namespace ctorchrun::worker {

namespace {

bool to_number(const std::string& field, unsigned long long* out) {
  auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), *out);
  return ec == std::errc() && end == field.data() + field.size();
}

}  // namespace

std::optional<ProcStat> parse_stat(const std::string& text) {
  // "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
  // cmajflt utime stime ...": comm ends at the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return std::nullopt;
  std::vector<std::string> fields;
  size_t at = close + 2;
  while (at < text.size()) {
    size_t space = text.find_first_of(" \n", at);
    if (space == std::string::npos) space = text.size();
    fields.push_back(text.substr(at, space - at));
    at = space + 1;
  }
  // state is field 3; starttime field 22: index 19 after the state.
  if (fields.size() < 20 || fields[0].size() != 1) return std::nullopt;
  ProcStat s;
  s.state = fields[0][0];
  unsigned long long n[7] = {};
  const size_t index[7] = {1, 2, 3, 11, 12, 19, 0};
  for (int i = 0; i < 6; ++i) {
    if (!to_number(fields[index[i]], &n[i])) return std::nullopt;
  }
  s.ppid = static_cast<pid_t>(n[0]);
  s.pgrp = static_cast<pid_t>(n[1]);
  s.session = static_cast<pid_t>(n[2]);
  s.utime = n[3];
  s.stime = n[4];
  s.starttime = n[5];
  return s;
}

std::optional<ProcStat> read_stat(pid_t pid, const std::string& proc_root) {
  const std::string text = read_proc_file(proc_root + "/" + std::to_string(pid) + "/stat");
  if (text.empty()) return std::nullopt;
  return parse_stat(text);
}

}  // namespace ctorchrun::worker

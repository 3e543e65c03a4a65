#include "tests/worker/worker_test_util.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace ctorchrun::worker::testing {

using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t nl = text.find('\n', begin);
    if (nl == std::string::npos) {
      lines.push_back(text.substr(begin));
      break;
    }
    lines.push_back(text.substr(begin, nl - begin));
    begin = nl + 1;
  }
  return lines;
}

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

namespace {

// Fields of /proc/<pid>/stat after the command name: state, ppid, ...
bool read_stat(pid_t pid, std::string* comm, char* state, pid_t* ppid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto open = stat.find('(');
  auto close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close + 4 > stat.size()) {
    return false;
  }
  if (comm) *comm = stat.substr(open + 1, close - open - 1);
  std::istringstream rest(stat.substr(close + 2));
  char s = '?';
  long parent = 0;
  rest >> s >> parent;
  if (state) *state = s;
  if (ppid) *ppid = static_cast<pid_t>(parent);
  return true;
}

}  // namespace

bool process_alive(pid_t pid) {
  char state = '?';
  if (pid <= 0 || !read_stat(pid, nullptr, &state, nullptr)) return false;
  return state != 'Z' && state != 'X';
}

std::vector<ChildProcess> children_of(pid_t parent) {
  std::vector<ChildProcess> children;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return children;
  while (dirent* ent = ::readdir(dir)) {
    char* end = nullptr;
    long pid = std::strtol(ent->d_name, &end, 10);
    if (end == ent->d_name || *end != '\0') continue;
    ChildProcess child{static_cast<pid_t>(pid), "", '?'};
    pid_t ppid = 0;
    if (read_stat(child.pid, &child.comm, &child.state, &ppid) && ppid == parent) {
      children.push_back(child);
    }
  }
  ::closedir(dir);
  return children;
}

pid_t wait_for_pid_file(const std::string& path, std::chrono::milliseconds timeout) {
  pid_t pid = -1;
  eventually(
      [&] {
        std::string text = read_file(path);
        if (text.empty()) return false;
        pid = static_cast<pid_t>(std::stol(text));
        return true;
      },
      timeout);
  return pid;
}

WorkerSpec fake_spec(int local_rank, std::vector<std::string> args) {
  WorkerSpec spec;
  spec.local_rank = local_rank;
  spec.argv.push_back(FAKE_WORKER);
  for (auto& a : args) spec.argv.push_back(std::move(a));
  spec.env = {{"PATH", "/usr/bin:/bin"}, {"LOCAL_RANK", std::to_string(local_rank)}};
  spec.prefix = "[default" + std::to_string(local_rank) + "]:";
  return spec;
}

std::vector<WorkerExit> wait_for_exits(Launcher& launcher, size_t count,
                                       std::chrono::milliseconds timeout) {
  std::vector<WorkerExit> exits;
  auto deadline = Clock::now() + timeout;
  while (exits.size() < count && Clock::now() < deadline) {
    for (auto& e : launcher.wait(deadline)) exits.push_back(e);
  }
  return exits;
}

}  // namespace ctorchrun::worker::testing

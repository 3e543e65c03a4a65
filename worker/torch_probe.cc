#include "worker/torch_probe.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <vector>

#include "common/error.h"
#include "worker/executable.h"

namespace ctorchrun::worker {

namespace {

constexpr const char* kDefaultPath = "/usr/bin:/bin";  // execvp's, as for workers
constexpr size_t kMaxOutput = 256;

}  // namespace

std::optional<std::string> installed_torch_version(const std::string& python,
                                                   const std::map<std::string, std::string>& env,
                                                   std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  std::string program;
  try {
    auto path = env.find("PATH");
    program = detail::find_executable(python, path == env.end() ? kDefaultPath : path->second, "");
  } catch (const IoError&) {
    return std::nullopt;  // the workers' own start names what is missing
  }
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return std::nullopt;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  std::vector<std::string> args = {program, "-c",
                                   "import importlib.metadata as m; print(m.version('torch'))"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> vars;
  for (const auto& [k, v] : env) vars.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  if (rc != 0) {
    ::close(out[0]);
    return std::nullopt;
  }
  std::string text;
  bool done = false;
  for (int i = 0; i < 10'000 && !done; ++i) {  // bounded: EINTR, short reads
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd p{out[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    char buf[128];
    const ssize_t got = ::read(out[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      done = true;  // EOF: the child closed its stdout (it exits)
    } else if (text.size() < kMaxOutput) {
      text.append(buf, static_cast<size_t>(got));
    }
  }
  ::close(out[0]);
  if (!done) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!done || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text.empty() || text.size() >= kMaxOutput) return std::nullopt;
  return text;
}

std::optional<std::pair<int, int>> major_minor(const std::string& version) {
  int parts[2] = {0, 0};
  size_t at = 0;
  for (int i = 0; i < 2; ++i) {
    size_t digits = 0;
    long value = 0;
    while (at < version.size() && std::isdigit(static_cast<unsigned char>(version[at])) &&
           digits < 6) {
      value = value * 10 + (version[at] - '0');
      ++at;
      ++digits;
    }
    if (digits == 0) return std::nullopt;
    parts[i] = static_cast<int>(value);
    if (i == 0) {
      if (at >= version.size() || version[at] != '.') return std::nullopt;
      ++at;
    }
  }
  return std::pair{parts[0], parts[1]};
}

std::optional<std::string> ctorch_package_dir(const std::string& launcher) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path bin = fs::canonical(launcher, ec).parent_path();
  if (ec) return std::nullopt;
  for (const fs::path& dir : {bin / ".." / "python", bin / ".." / "lib" / "ctorchrun" / "python"}) {
    if (fs::is_regular_file(dir / "ctorch" / "__init__.py", ec)) {
      return fs::weakly_canonical(dir, ec).string();
    }
  }
  return std::nullopt;
}

}  // namespace ctorchrun::worker

#include "tests/launcher/launcher_support.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace ctorchrun::testing {

using Clock = std::chrono::steady_clock;

namespace {
std::vector<std::string> full_argv(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {CTORCHRUN_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}
}  // namespace

LaunchResult run_ctorchrun(const std::vector<std::string>& args,
                           std::map<std::string, std::string> env, std::chrono::seconds timeout) {
  auto p = start_ctorchrun(args, std::move(env));
  LaunchResult r;
  r.output = p->read_all(timeout);
  r.exit_code = p->exit_code(std::chrono::seconds(10));
  return r;
}

std::unique_ptr<Process> start_ctorchrun(const std::vector<std::string>& args,
                                         std::map<std::string, std::string> env) {
  env.emplace("CTORCHRUN_PYTHON", test_python());
  return std::make_unique<Process>(full_argv(args), env, /*capture_stderr=*/true);
}

int free_port() {
  // Below the kernel's ephemeral range (32768-60999 here): a port picked from
  // that range can be taken as the local port of some outgoing connection
  // between this check and the launcher's bind, and parallel tests make many.
  static std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(20000, 32000);
  for (int attempt = 0; attempt < 200; ++attempt) {
    int port = pick(rng);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (free) return port;
  }
  throw std::runtime_error("free_port: no free port in 20000-32000 after 200 tries");
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) { return std::filesystem::exists(path); }

bool wait_for_file(const std::string& path, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (!read_file(path).empty()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

bool wait_for_line(Process& p, const std::string& needle, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    auto line = p.read_line(left);
    if (!line) return false;
    if (line->find(needle) != std::string::npos) return true;
  }
  return false;
}

bool wait_for_port(int port, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

bool process_gone_within(int pid, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
    std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
    auto close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z')
      return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int> read_pids(const std::string& dir, const std::string& prefix) {
  std::vector<int> pids;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    std::string s = read_file(e.path().string());
    if (!s.empty()) pids.push_back(std::stoi(s));
  }
  return pids;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> out;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool wait_for_lines(const std::string& path, size_t n, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (lines_of(path).size() >= n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::vector<std::string> recording_worker(const std::string& record_file,
                                          const std::string& stop_file) {
  return sh("echo \"$WORLD_SIZE $CTORCHRUN_FAILED_RESTARTS\" >> " + record_file +
            "; i=0; while [ ! -e " + stop_file +
            " ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done");
}

int count_lines_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.find(needle) != std::string::npos) ++n;
  }
  return n;
}

std::vector<std::string> sh(const std::string& body) {
  return {"--no_python", "/bin/sh", "-c", body};
}

std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace ctorchrun::testing

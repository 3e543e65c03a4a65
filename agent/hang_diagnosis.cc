#include "agent/hang_diagnosis.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "common/json_text.h"
#include "common/log.h"
#include "common/procfs.h"

extern char** environ;

namespace ctorchrun::agent {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

std::string read_file(const std::string& path, std::streamoff from = 0) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  in.seekg(from);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::streamoff file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::streamoff>(st.st_size) : 0;
}

// A dump written at `path` since `since` (a file with content, modified then
// or later, a second of slack for coarse timestamps): a dump an earlier job
// left at the same path is not this hang's.
bool written_since(const std::string& path, std::chrono::system_clock::time_point since) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || st.st_size == 0) return false;
  const auto modified = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)));
  return modified + std::chrono::seconds(1) >= since;
}

// Alive and not a zombie (a worker's zombie stays until the launcher's stop()).
bool running(pid_t pid) { return procfs::running(pid); }

bool executable(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

std::string base_name(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string source_line(const std::string& file, int line) {
  std::ifstream in(file);
  std::string text;
  for (int i = 1; in && std::getline(in, text); ++i) {
    if (i == line) {
      auto b = text.find_first_not_of(" \t");
      return b == std::string::npos ? "" : text.substr(b);
    }
  }
  return "";
}

// One `File "f", line N[,] in name` line: file, line, name.
bool parse_file_line(const std::string& l, std::string* file, int* line, std::string* name) {
  auto f = l.find("File \"");
  if (f == std::string::npos) return false;
  auto fe = l.find('"', f + 6);
  if (fe == std::string::npos) return false;
  auto ln = l.find("line ", fe);
  if (ln == std::string::npos) return false;
  auto in = l.find(" in ", ln);
  if (in == std::string::npos) return false;
  *file = l.substr(f + 6, fe - f - 6);
  *line = std::atoi(l.c_str() + ln + 5);
  *name = l.substr(in + 4);
  while (!name->empty() && (name->back() == '\r' || name->back() == ' ')) name->pop_back();
  return true;
}

std::string frame_text(const std::string& file, int line, const std::string& name) {
  std::string out = name + " at " + base_name(file) + ":" + std::to_string(line);
  std::string src = source_line(file, line);
  // At most 80 bytes of the line, cut between characters: a cut inside one
  // (a comment in Chinese, an accented string) would be invalid UTF-8 in the
  // summary and in the events that carry it.
  if (!src.empty()) out += " (" + json_text::utf8_prefix(src, 80) + ")";
  return out;
}

// Spawns `eu-stack -p pid` with its output in `out_path`; 0 on failure.
pid_t spawn_eu_stack(const std::string& eu_stack, pid_t pid, const std::string& out_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::string pid_text = std::to_string(pid);
  std::vector<char*> argv = {const_cast<char*>(eu_stack.c_str()), const_cast<char*>("-p"),
                             pid_text.data(), nullptr};
  pid_t child = 0;
  const int rc = ::posix_spawn(&child, eu_stack.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? child : 0;
}

}  // namespace

DiagnosisOptions diagnosis_options(const std::string& trace_buffer_size,
                                   const std::string& pipe_file, const std::string& dump_file,
                                   const std::string& path) {
  DiagnosisOptions o;
  char* end = nullptr;
  const long size = std::strtol(trace_buffer_size.c_str(), &end, 10);
  if (!trace_buffer_size.empty() && end != trace_buffer_size.c_str() && size > 0 &&
      !pipe_file.empty()) {
    o.pipe_prefix = pipe_file;
  }
  if (!dump_file.empty()) o.dump_prefix = dump_file;
  std::istringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (!dir.empty() && executable(dir + "/eu-stack")) {
      o.eu_stack = dir + "/eu-stack";
      break;
    }
  }
  return o;
}

bool request_flight_recorder(const std::string& pipe, std::chrono::milliseconds wait) {
  const auto deadline = Clock::now() + wait;
  for (;;) {
    // O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) rather than
    // blocking the diagnosis; no O_CREAT: never a regular file in its place.
    int fd = ::open(pipe.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      struct stat st {};
      bool ok = ::fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode) && ::write(fd, "1", 1) == 1;
      ::close(fd);
      return ok;
    }
    if ((errno != ENXIO && errno != ENOENT) || Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
}

std::string innermost_python_frame(const std::string& text) {
  std::istringstream in(text);
  std::string l;
  // Blocks of frames; a faulthandler block starts with "... (most recent call
  // first):", a traceback with "(most recent call last):".
  std::vector<std::pair<bool, std::vector<std::string>>> blocks;  // (first?, lines)
  while (std::getline(in, l)) {
    if (l.find("(most recent call first)") != std::string::npos) {
      blocks.push_back({true, {}});
    } else if (l.find("(most recent call last)") != std::string::npos) {
      blocks.push_back({false, {}});
    } else if (!blocks.empty() && l.find("File \"") != std::string::npos) {
      blocks.back().second.push_back(l);
    }
  }
  // The main thread's block is the last one faulthandler prints (threads
  // newest first); a traceback's innermost frame is its last line.
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    if (it->second.empty()) continue;
    const std::string& pick = it->first ? it->second.front() : it->second.back();
    std::string file, name;
    int line = 0;
    if (parse_file_line(pick, &file, &line, &name)) return frame_text(file, line, name);
  }
  return "";
}

std::string group_frames(std::vector<RankFrame> frames) {
  std::sort(frames.begin(), frames.end(),
            [](const RankFrame& a, const RankFrame& b) { return a.rank < b.rank; });
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& f : frames) {
    const std::string key = f.frame.empty() ? "an unknown frame" : f.frame;
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {f.rank}});
    } else {
      it->second.push_back(f.rank);
    }
  }
  std::string out;
  for (const auto& [frame, ranks] : groups) {
    std::string list;
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      list += (list.empty() ? "" : ",") + std::to_string(ranks[i]);
      if (j > i) list += "-" + std::to_string(ranks[j]);
      i = j + 1;
    }
    out += (out.empty() ? "" : "; ") + std::string(ranks.size() == 1 ? "rank " : "ranks ") + list +
           " in " + frame;
  }
  return out;
}

std::vector<RankFrame> diagnose_hang(const std::vector<DiagnosisTarget>& targets,
                                     const DiagnosisOptions& o) {
  auto log = get_logger("agent");
  const auto deadline = Clock::now() + o.budget;
  auto until = [&](std::chrono::milliseconds d) { return std::min(deadline, Clock::now() + d); };
  auto left = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
        std::max(Clock::duration::zero(), t - Clock::now()));
  };
  std::vector<std::string> report(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    report[i] = "hang report: rank " + std::to_string(t.rank) + " (local_rank " +
                std::to_string(t.local_rank) + ", pid " + std::to_string(t.pid) + ")\n";
  }

  // Frozen first (SIGSTOP), on every node at once as the verdict arrives:
  // a peer that dies during the diagnosis (its own node's SIGABRT) must not
  // wake a rank out of its collective before its stack is taken, or the
  // stack would show the error path, not where it hung.
  for (const auto& t : targets) {
    if (running(t.pid)) ::kill(t.pid, SIGSTOP);
  }

  // 1. The flight recorder, every rank at once.
  if (!o.pipe_prefix.empty()) {
    const auto fr_deadline = until(o.flight_recorder_wait);
    const auto requested_at = std::chrono::system_clock::now();
    std::vector<std::thread> requests;
    std::vector<char> delivered(targets.size(), 0);
    for (size_t i = 0; i < targets.size(); ++i) {
      requests.emplace_back([&, i] {
        delivered[i] = request_flight_recorder(
            o.pipe_prefix + std::to_string(targets[i].rank) + ".pipe", left(fr_deadline));
      });
    }
    for (auto& th : requests) th.join();
    for (size_t i = 0; i < targets.size(); ++i) {
      const std::string dump = o.dump_prefix + std::to_string(targets[i].rank);
      while (delivered[i] && !written_since(dump, requested_at) && Clock::now() < fr_deadline) {
        std::this_thread::sleep_for(20ms);
      }
      report[i] += "\n--- NCCL flight recorder ---\n";
      if (!delivered[i]) {
        report[i] += "no reader on " + o.pipe_prefix + std::to_string(targets[i].rank) + ".pipe\n";
      } else if (written_since(dump, requested_at)) {
        report[i] += "dump requested: " + dump + "\n";
      } else {
        report[i] += "dump requested; none written to " + dump + " in time\n";
      }
    }
  }

  // 2. Native stacks, every rank at once.
  if (!o.eu_stack.empty()) {
    const auto native_deadline = until(o.native_wait);
    std::vector<pid_t> children(targets.size(), 0);
    std::vector<std::string> outs(targets.size());
    for (size_t i = 0; i < targets.size(); ++i) {
      outs[i] = targets[i].dir + "/hang.native.tmp";
      if (running(targets[i].pid))
        children[i] = spawn_eu_stack(o.eu_stack, targets[i].pid, outs[i]);
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      if (children[i] == 0) continue;
      int status = 0;
      pid_t r = 0;
      while ((r = ::waitpid(children[i], &status, WNOHANG)) == 0 &&
             Clock::now() < native_deadline) {
        std::this_thread::sleep_for(10ms);
      }
      if (r == 0) {
        ::kill(children[i], SIGKILL);
        while (::waitpid(children[i], &status, 0) < 0 && errno == EINTR) {
        }
        report[i] += "\n--- native stacks (eu-stack, cut off after the bound) ---\n";
      } else {
        report[i] += "\n--- native stacks (eu-stack) ---\n";
      }
      report[i] += read_file(outs[i]);
      ::unlink(outs[i].c_str());
    }
  }

  // 3. Python stacks: SIGABRT, faulthandler writes them to stderr. The
  // abort is pending while the worker is stopped (a detaching eu-stack may
  // have let it run: stopped again) and is taken before it runs any more
  // Python code once SIGCONT arrives.
  std::vector<std::streamoff> from(targets.size(), 0);
  std::vector<char> aborted(targets.size(), 0);
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    from[i] = file_size(t.stderr_path);
    if (running(t.pid)) {
      ::kill(t.pid, SIGSTOP);
      // No core dump for an abort that only asks for stacks: where cores are
      // enabled, each would be the worker's whole memory (over 100 MB with
      // torch imported), one per hung worker, often in a shared working
      // directory. The target's own limit, set from here (prlimit(2)).
      const struct rlimit no_core { 0, 0 };
      if (::prlimit(t.pid, RLIMIT_CORE, &no_core, nullptr) != 0) {
        log->debug("hang: cannot turn off core dumps of pid {}: {}", t.pid, std::strerror(errno));
      }
      aborted[i] = ::kill(t.pid, SIGABRT) == 0;
    }
  }
  // Never left stopped: the stop that follows is SIGTERM with a grace.
  for (const auto& t : targets) ::kill(t.pid, SIGCONT);
  const auto abort_deadline = until(o.abort_wait);
  for (size_t i = 0; i < targets.size(); ++i) {
    while (aborted[i] && running(targets[i].pid) && Clock::now() < abort_deadline) {
      std::this_thread::sleep_for(10ms);
    }
  }
  // The launcher's thread copies the last bytes of a dead worker's stderr
  // pipe into its file: wait until the files stop growing (bounded).
  std::vector<std::streamoff> sizes(targets.size(), -1);
  while (Clock::now() < deadline) {
    bool settled = true;
    for (size_t i = 0; i < targets.size(); ++i) {
      auto s = file_size(targets[i].stderr_path);
      settled = settled && s == sizes[i];
      sizes[i] = s;
    }
    if (settled) break;
    std::this_thread::sleep_for(100ms);
  }
  std::vector<RankFrame> frames;
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    // A worker that had died already (a peer's abort broke its collective)
    // left its traceback earlier in the file: the last 64 KiB then.
    std::string py = aborted[i]
                         ? read_file(t.stderr_path, from[i])
                         : read_file(t.stderr_path,
                                     std::max<std::streamoff>(0, file_size(t.stderr_path) - 65536));
    std::string frame = innermost_python_frame(py);
    report[i] += std::string("\n--- Python stacks (") +
                 (aborted[i] ? "faulthandler on SIGABRT" : "stderr: the worker had exited") +
                 ") ---\n" + py;
    report[i] += "\n--- frame ---\n" + (frame.empty() ? "none found" : frame) + "\n";
    frames.push_back({t.rank, frame});
    std::ofstream out(t.dir + "/hang.txt", std::ios::trunc);
    out << report[i];
    if (!out) log->warn("cannot write {}/hang.txt", t.dir);
  }
  return frames;
}

}  // namespace ctorchrun::agent

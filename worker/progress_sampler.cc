#include "worker/progress_sampler.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/procfs.h"

namespace ctorchrun::worker {

namespace fs = std::filesystem;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// A process's children are the union of what each of its threads forked
// (torch's DataLoader forks from the main thread, but helper threads may).
std::vector<pid_t> children_of(pid_t pid, const std::string& proc) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (fs::directory_iterator it(proc + "/" + std::to_string(pid) + "/task", ec), end;
       !ec && it != end; it.increment(ec)) {
    std::istringstream in(read_all(it->path().string() + "/children"));
    long child = 0;
    while (in >> child) {
      if (child > 0) out.push_back(static_cast<pid_t>(child));
    }
  }
  return out;
}

}  // namespace

uint64_t stat_ticks(const std::string& line, bool children) {
  const auto s = procfs::parse_stat(line);
  if (!s) return 0;
  return children ? s->cutime + s->cstime : s->utime + s->stime;
}

uint64_t io_chars(const std::string& text) {
  std::istringstream in(text);
  std::string name;
  uint64_t value = 0, sum = 0;
  while (in >> name >> value) {
    if (name == "rchar:" || name == "wchar:") sum += value;
  }
  return sum;
}

ProgressSample sample_progress(pid_t pid, const std::vector<std::string>& output_files,
                               const std::string& proc) {
  ProgressSample s;
  const std::string dir = proc + "/" + std::to_string(pid);
  const std::string stat = read_all(dir + "/stat");
  // A zombie (exited, not reaped yet) is no progress either way: its exit
  // is the launcher's news, not ours.
  const auto parsed = procfs::parse_stat(stat);
  s.alive = parsed && parsed->state != 'Z' && parsed->state != 'X';
  if (!s.alive) return s;
  s.main_thread_ticks = stat_ticks(read_all(dir + "/task/" + std::to_string(pid) + "/stat"));
  s.reaped_child_ticks = stat_ticks(stat, true);
  s.io_bytes = io_chars(read_all(dir + "/io"));
  // Breadth-first over the live descendants; `seen` guards against a pid
  // reused into a cycle while we read.
  std::set<pid_t> seen{pid};
  std::vector<pid_t> queue = children_of(pid, proc);
  while (!queue.empty()) {
    pid_t d = queue.back();
    queue.pop_back();
    if (!seen.insert(d).second) continue;
    const std::string ddir = proc + "/" + std::to_string(d);
    ++s.descendants;
    s.descendant_ticks += stat_ticks(read_all(ddir + "/stat"));
    s.io_bytes += io_chars(read_all(ddir + "/io"));
    for (pid_t c : children_of(d, proc)) queue.push_back(c);
  }
  for (const auto& f : output_files) {
    struct stat st {};
    if (!f.empty() && ::stat(f.c_str(), &st) == 0)
      s.output_bytes += static_cast<uint64_t>(st.st_size);
  }
  return s;
}

bool StallTracker::observe(const ProgressSample& sample, Clock::time_point now) {
  const bool progress = !observed_ || sample != last_;
  observed_ = true;
  last_ = sample;
  if (progress) last_progress_ = now;
  return progress;
}

std::chrono::milliseconds StallTracker::stalled_for(Clock::time_point now) const {
  if (!observed_ || now < last_progress_) return std::chrono::milliseconds(0);
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - last_progress_);
}

}  // namespace ctorchrun::worker

// The agent's file-timer server (agent/file_timer.h): torch's request lines
// parsed totally, the timer table, and the server over a real named pipe with
// an injected clock; then real processes, where only the agent's workers and
// their descendants may be signalled.

#include "agent/file_timer.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using namespace ctorchrun::agent;
using namespace std::chrono_literals;

namespace {

// What torch's FileTimerClient writes (json.dumps of its request).
std::string torch_line(long pid, const std::string& scope, double expiration, int sig) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"version\": 1, \"pid\": %ld, \"scope_id\": \"%s\", \"expiration_time\": %.6f, "
                "\"signal\": %d}",
                pid, scope.c_str(), expiration, sig);
  return buf;
}

bool printable(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c >= 0x7f) return false;
  }
  return true;
}

// Processes as the server sees them, scripted: which pids may be signalled,
// which exist; every signal sent is recorded.
class FakeProcesses : public ProcessAccess {
 public:
  explicit FakeProcesses(std::vector<pid_t> permitted) : permitted_(std::move(permitted)) {}
  bool alive(pid_t pid) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::find(gone_.begin(), gone_.end(), pid) == gone_.end();
  }
  SignalResult signal_if_permitted(pid_t pid, int sig, std::string*) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(permitted_.begin(), permitted_.end(), pid) == permitted_.end()) {
      if (starting_) {
        ++deferrals_;
        return SignalResult::kNotYet;
      }
      refused_.push_back(pid);
      return SignalResult::kNotPermitted;
    }
    sent_.emplace_back(pid, sig);
    return SignalResult::kSent;
  }
  // Workers starting: unknown pids are kNotYet until set_workers.
  void starting() {
    std::lock_guard<std::mutex> lock(mutex_);
    starting_ = true;
  }
  void set_workers(std::vector<pid_t> pids) {
    std::lock_guard<std::mutex> lock(mutex_);
    permitted_ = std::move(pids);
    starting_ = false;
  }
  int deferrals() {
    std::lock_guard<std::mutex> lock(mutex_);
    return deferrals_;
  }
  void mark_gone(pid_t pid) {
    std::lock_guard<std::mutex> lock(mutex_);
    gone_.push_back(pid);
  }
  std::vector<std::pair<pid_t, int>> sent() {
    std::lock_guard<std::mutex> lock(mutex_);
    return sent_;
  }
  std::vector<pid_t> refused() {
    std::lock_guard<std::mutex> lock(mutex_);
    return refused_;
  }

 private:
  std::mutex mutex_;
  std::vector<pid_t> permitted_, gone_, refused_;
  std::vector<std::pair<pid_t, int>> sent_;
  bool starting_ = false;
  int deferrals_ = 0;
};

// The pipe's path in a fresh directory, removed with it.
struct TempPath {
  testing::TempDir dir{"timer_test"};
  const std::string path = dir.file("pipe");
};

// A client as torch's: opens the pipe without blocking, writes, closes.
void send(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fd >= 0);
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EAGAIN) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    REQUIRE(n > 0);
    off += static_cast<size_t>(n);
  }
  ::close(fd);
}

// Polls `cond` every 5 ms for at most `timeout`.
template <typename F>
bool eventually(F cond, std::chrono::milliseconds timeout = 3000ms) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return cond();
}

struct ManualClock {
  std::shared_ptr<std::atomic<double>> t = std::make_shared<std::atomic<double>>(1000.0);
  std::function<double()> fn() const {
    return [t = t] { return t->load(); };
  }
  void set(double v) { t->store(v); }
};

FileTimerOptions test_options(const std::string& path, const ManualClock& clock) {
  FileTimerOptions o;
  o.path = path;
  o.interval = 10ms;
  o.partial_line_timeout = 50ms;
  o.now = clock.fn();
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------

TEST_CASE("file timer: a request line as torch's client writes it parses", "[unit]") {
  std::string error;
  auto r = parse_timer_request(torch_line(4242, "train.py#57", 1764032105.25, 9), &error);
  REQUIRE(r.has_value());
  CHECK(r->version == 1);
  CHECK(r->pid == 4242);
  CHECK(r->scope_id == "train.py#57");
  CHECK(r->expiration_time == Approx(1764032105.25));
  CHECK(r->signal == 9);
  CHECK_FALSE(r->is_release());

  auto rel = parse_timer_request(
      R"({"version": 1, "pid": 7, "scope_id": "s", "expiration_time": -1, "signal": 0})", &error);
  REQUIRE(rel.has_value());
  CHECK(rel->is_release());
  // No version (torch's server ignores it), integer expiration, extra fields.
  auto loose = parse_timer_request(
      R"({"pid": 7, "scope_id": "s", "expiration_time": 5, "signal": 15, "x": [1]})", &error);
  REQUIRE(loose.has_value());
  CHECK(loose->expiration_time == 5.0);
  CHECK(loose->signal == 15);
}

TEST_CASE("file timer: every malformed line is refused with a printable reason", "[unit]") {
  const std::string deep = std::string(2000, '[') + std::string(2000, ']');
  const std::vector<std::string> hostile = {
      "",
      "   ",
      "not json",
      "{\"pid\": 1",
      "[1, 2, 3]",
      "42",
      "null",
      deep,
      R"({"scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": "12", "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": 0, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": -5, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": 1.5, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": 1099511627776, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": 18446744073709551615, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      R"({"pid": 12, "scope_id": 3, "expiration_time": 1, "signal": 9})",
      R"({"pid": 12, "expiration_time": 1, "signal": 9})",
      R"({"pid": 12, "scope_id": "s", "expiration_time": "soon", "signal": 9})",
      R"({"pid": 12, "scope_id": "s", "signal": 9})",
      R"({"pid": 12, "scope_id": "s", "expiration_time": 1e999, "signal": 9})",
      R"({"pid": 12, "scope_id": "s", "expiration_time": 1, "signal": 9.5})",
      R"({"pid": 12, "scope_id": "s", "expiration_time": 1, "signal": 99999999999})",
      R"({"pid": 12, "scope_id": "s", "expiration_time": 1})",
      R"({"version": "one", "pid": 12, "scope_id": "s", "expiration_time": 1, "signal": 9})",
      std::string(
          "{\"pid\": 12, \"scope_id\": \"\xff\xfe\", \"expiration_time\": 1, \"signal\": 9}"),
      std::string("{\"pid\": 12,\0 \"scope_id\": \"s\"}", 28),
      std::string(5000, 'x'),
  };
  for (const auto& line : hostile) {
    std::string error;
    INFO("line: " << line.substr(0, 100));
    CHECK_FALSE(parse_timer_request(line, &error).has_value());
    CHECK_FALSE(error.empty());
    CHECK(printable(error));
    CHECK(error.size() < 300);
  }
}

TEST_CASE("file timer: lines are cut at newlines across reads and bounded in length", "[unit]") {
  TimerLineReader reader(16);
  auto a = reader.feed("abc\nde");
  REQUIRE(a.size() == 1);
  CHECK(a[0].text == "abc");
  CHECK(reader.has_partial());
  auto b = reader.feed("f\n\nxyz\n");
  REQUIRE(b.size() == 3);
  CHECK(b[0].text == "def");
  CHECK(b[1].text.empty());
  CHECK(b[1].error.empty());
  CHECK(b[2].text == "xyz");
  CHECK_FALSE(reader.has_partial());

  // A long line, in pieces: dropped once, with its length; the next one is intact.
  CHECK(reader.feed(std::string(10, 'a')).empty());
  CHECK(reader.feed(std::string(10, 'b')).empty());
  CHECK(reader.has_partial());
  auto c = reader.feed(std::string(100, 'c') + "\nok\n");
  REQUIRE(c.size() == 2);
  CHECK(c[0].text.empty());
  CHECK(c[0].error.find("120 bytes") != std::string::npos);
  CHECK(c[1].text == "ok");
  CHECK(c[1].error.empty());

  // A fragment left without its newline is forgotten on request.
  CHECK(reader.feed("frag").empty());
  CHECK(reader.drop_partial() == 4);
  CHECK_FALSE(reader.has_partial());
  auto d = reader.feed("next\n");
  REQUIRE(d.size() == 1);
  CHECK(d[0].text == "next");
}

TEST_CASE("file timer: the table keeps one timer per pid and scope and reaps as torch does",
          "[unit]") {
  FileTimerTable t(4);
  auto req = [](pid_t pid, const std::string& scope, double exp, int sig) {
    FileTimerRequest r;
    r.pid = pid;
    r.scope_id = scope;
    r.expiration_time = exp;
    r.signal = sig;
    return r;
  };
  REQUIRE(t.apply(req(10, "a", 100, 9)));
  REQUIRE(t.apply(req(10, "a", 105, 9)));  // re-acquired: moved
  REQUIRE(t.apply(req(10, "b", 103, 0)));
  REQUIRE(t.apply(req(11, "a", 200, 15)));
  CHECK(t.size() == 3);
  CHECK(*t.next_expiration() == 103);
  CHECK(t.expired(102.9).empty());
  REQUIRE(t.apply(req(10, "c", 900, 15)));

  // pid 10: "b" expired first with no signal, then "a" with 9: 9 is used;
  // reaped, every timer of pid 10 goes ("c" too), pid 11's stays.
  auto e = t.expired(105);
  REQUIRE(e.size() == 1);
  CHECK(e[0].pid == 10);
  CHECK(e[0].signal == 9);
  CHECK(e[0].scopes == std::vector<std::string>{"b", "a"});
  CHECK(t.size() == 4);
  t.remove_pid(10);
  CHECK(t.size() == 1);

  // Released timers never expire.
  REQUIRE(t.apply(req(11, "a", -1, 0)));
  CHECK(t.size() == 0);
  CHECK(t.expired(1e12).empty());

  // Bounded: a fifth timer is refused, an update of a held one is not.
  for (int i = 0; i < 4; ++i) REQUIRE(t.apply(req(20 + i, "s", 500, 9)));
  CHECK_FALSE(t.apply(req(30, "s", 500, 9)));
  CHECK(t.apply(req(20, "s", 600, 9)));
  CHECK(t.size() == 4);
  // Timers of processes that are gone are dropped.
  CHECK(t.drop_if([](pid_t pid) { return pid % 2 == 0; }) == 2);
  CHECK(t.size() == 2);
}

TEST_CASE("file timer: a timer fires only when the injected clock passes it", "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{4242, 4243});
  std::atomic<int> reported{0};
  auto o = test_options(tmp.path, clock);
  o.on_expired = [&](const FileTimerTable::Expired&, bool killed) {
    if (killed) ++reported;
  };
  FileTimerServer server(o, procs);
  struct stat st {};
  REQUIRE(::lstat(tmp.path.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  CHECK((st.st_mode & 0777) == 0600);

  send(tmp.path, torch_line(4242, "step", 1001.0, 9) + "\n");
  send(tmp.path, torch_line(4243, "released", 1001.0, 9) + "\n");
  send(tmp.path, torch_line(4243, "released", -1, 0) + "\n");
  REQUIRE(eventually([&] { return server.stats().requests == 3; }));
  CHECK(server.stats().active_timers == 1);
  REQUIRE(server.stats().last_request.has_value());
  CHECK(*server.stats().last_request == 1000.0);

  clock.set(1000.99);
  std::this_thread::sleep_for(100ms);  // ten passes of the server
  CHECK(procs->sent().empty());
  clock.set(1001.0);
  REQUIRE(eventually([&] { return !procs->sent().empty(); }));
  CHECK(procs->sent() == std::vector<std::pair<pid_t, int>>{{4242, 9}});
  REQUIRE(eventually([&] { return reported.load() == 1; }));
  CHECK(server.stats().active_timers == 0);
  CHECK(server.stats().kills == 1);
  // Nothing fires twice, and the released timer never does.
  clock.set(5000);
  std::this_thread::sleep_for(100ms);
  CHECK(procs->sent().size() == 1);
}

TEST_CASE("file timer: junk on the pipe is ignored and the next request still works", "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{77});
  FileTimerServer server(test_options(tmp.path, clock), procs);

  send(tmp.path, "garbage\n{\"pid\": \n\n[1,2]\n");
  send(tmp.path, std::string(200 * 1024, 'x') + "\n");  // far past the line bound
  send(tmp.path, std::string("\0\x01\xff\n", 4));
  send(tmp.path, "{\"pid\": 77, \"scope_id\": \"half");  // a fragment, never finished
  REQUIRE(eventually([&] { return server.stats().rejected_lines >= 7; }));
  // The fragment was dropped on its own: the next line is not glued to it.
  send(tmp.path, torch_line(77, "after junk", 900, 15) + "\n");
  REQUIRE(eventually([&] { return !procs->sent().empty(); }));
  CHECK(procs->sent() == std::vector<std::pair<pid_t, int>>{{77, 15}});
  CHECK(server.stats().requests == 1);
  CHECK(server.stats().rejected_lines == 7);
}

TEST_CASE(
    "file timer: a pid that is not the agent's is never signalled and a timer without a "
    "signal kills nothing",
    "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{500});
  std::vector<std::pair<pid_t, bool>> reports;
  std::mutex m;
  auto o = test_options(tmp.path, clock);
  o.on_expired = [&](const FileTimerTable::Expired& e, bool killed) {
    std::lock_guard<std::mutex> lock(m);
    reports.emplace_back(e.pid, killed);
  };
  FileTimerServer server(o, procs);
  send(tmp.path, torch_line(1, "init", 10, 9) + "\n" + torch_line(999, "stranger", 10, 9) + "\n" +
                     torch_line(500, "no signal", 10, 0) + "\n" +
                     torch_line(500, "bad signal", 11, 4096) + "\n");
  REQUIRE(eventually([&] {
    std::lock_guard<std::mutex> lock(m);
    return reports.size() == 3;
  }));
  CHECK(procs->sent().empty());
  CHECK(procs->refused() == std::vector<pid_t>{1, 999});
  std::lock_guard<std::mutex> lock(m);
  for (const auto& [pid, killed] : reports) CHECK_FALSE(killed);
  CHECK(server.stats().active_timers == 0);
}

TEST_CASE(
    "file timer: a worker's timer that expires before the agent knows its pid is reaped "
    "once it does",
    "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{});
  FileTimerServer server(test_options(tmp.path, clock), procs);
  procs->starting();  // the agent spawns workers; their pids are not known yet
  send(tmp.path,
       torch_line(4100, "early", 10, 9) + "\n" + torch_line(4200, "stranger", 10, 9) + "\n");
  REQUIRE(eventually([&] { return procs->deferrals() >= 6; }));  // asked again, pass by pass
  CHECK(procs->sent().empty());
  CHECK(server.stats().active_timers == 2);
  procs->set_workers({4100});
  REQUIRE(eventually([&] { return server.stats().active_timers == 0; }));
  CHECK(procs->sent() == std::vector<std::pair<pid_t, int>>{{4100, 9}});
  CHECK(procs->refused() == std::vector<pid_t>{4200});
}

TEST_CASE("file timer: timers of processes that exited are forgotten", "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{31, 32});
  FileTimerServer server(test_options(tmp.path, clock), procs);
  send(tmp.path, torch_line(31, "a", 5000, 9) + "\n" + torch_line(32, "b", 5000, 9) + "\n");
  REQUIRE(eventually([&] { return server.stats().active_timers == 2; }));
  procs->mark_gone(31);
  // Swept once a second.
  REQUIRE(eventually([&] { return server.stats().active_timers == 1; }, 3000ms));
}

TEST_CASE("file timer: the pipe replaces a stale pipe but never another file and goes at exit",
          "[unit]") {
  TempPath tmp;
  ManualClock clock;
  auto procs = std::make_shared<FakeProcesses>(std::vector<pid_t>{});
  {
    std::ofstream(tmp.path) << "precious";
    REQUIRE_THROWS_AS(FileTimerServer(test_options(tmp.path, clock), procs), ConfigError);
    std::ifstream in(tmp.path);
    std::string content;
    in >> content;
    CHECK(content == "precious");
    ::unlink(tmp.path.c_str());
  }
  REQUIRE(::mkfifo(tmp.path.c_str(), 0600) == 0);  // as an agent killed with SIGKILL leaves it
  {
    FileTimerServer server(test_options(tmp.path, clock), procs);
    CHECK(::access(tmp.path.c_str(), F_OK) == 0);
  }
  CHECK(::access(tmp.path.c_str(), F_OK) != 0);
  // A directory that does not exist: a configuration error naming the variable.
  try {
    FileTimerServer server(test_options(tmp.dir.file("missing/pipe"), clock), procs);
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("TORCHELASTIC_TIMER_FILE") != std::string::npos);
  }
}

TEST_CASE("file timer: the pipe's path comes from torch's variables", "[unit]") {
  CHECK_FALSE(file_timer_path({}).has_value());
  CHECK_FALSE(file_timer_path({{"TORCHELASTIC_ENABLE_FILE_TIMER", "0"}}).has_value());
  CHECK_FALSE(file_timer_path({{"TORCHELASTIC_ENABLE_FILE_TIMER", "true"}}).has_value());
  CHECK_FALSE(file_timer_path({{"TORCHELASTIC_TIMER_FILE", "/tmp/x"}}).has_value());
  CHECK(file_timer_path({{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"},
                         {"TORCHELASTIC_TIMER_FILE", "/tmp/x"}}) == "/tmp/x");
  auto a = file_timer_path({{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}});
  auto b = file_timer_path({{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}});
  REQUIRE(a.has_value());
  CHECK(a->rfind("/tmp/watchdog_timer_", 0) == 0);
  CHECK(a->size() == std::string("/tmp/watchdog_timer_").size() + 36);
  CHECK(a != b);
}

// ---------------------------------------------------------------------------
// Real processes: the agent's own check of who may be signalled.

TEST_CASE(
    "file timer: a line naming a process outside the workers' trees kills nothing but a "
    "worker's child is killed",
    "[multiproc]") {
  using ctorchrun::testing::Process;
  // A "worker" whose child is a sleep it waits for; and a stranger.
  Process worker({"/bin/sh", "-c", "sleep 60 & echo $!; wait"});
  Process stranger({"/bin/sleep", "60"});
  auto line = worker.read_line(10s);
  REQUIRE(line.has_value());
  const pid_t child = static_cast<pid_t>(std::stol(*line));
  REQUIRE(child > 1);

  auto workers = std::make_shared<WorkerProcesses>();
  workers->set_workers({worker.pid()});
  CHECK(workers->local_rank_of(worker.pid()) == 0);
  CHECK(workers->local_rank_of(stranger.pid()) == -1);
  CHECK(in_process_tree(child, {worker.pid()}));
  CHECK_FALSE(in_process_tree(stranger.pid(), {worker.pid()}));
  CHECK_FALSE(in_process_tree(getpid(), {worker.pid()}));
  CHECK_FALSE(in_process_tree(1, {worker.pid()}));

  TempPath tmp;
  FileTimerOptions o;
  o.path = tmp.path;
  o.interval = 10ms;
  std::atomic<int> expiries{0};
  o.on_expired = [&](const FileTimerTable::Expired&, bool) { ++expiries; };
  FileTimerServer server(o, workers);
  // Already expired (1970), SIGKILL: the stranger, this test and init are
  // named, none is touched.
  send(tmp.path, torch_line(stranger.pid(), "hostile", 1, 9) + "\n" +
                     torch_line(getpid(), "hostile", 1, 9) + "\n" + torch_line(1, "hostile", 1, 9) +
                     "\n");
  REQUIRE(eventually([&] { return expiries.load() == 3; }));
  CHECK(server.stats().kills == 0);
  CHECK_FALSE(stranger.wait(200ms).has_value());  // still running

  // The worker's child, by SIGTERM: it dies, and the worker (waiting for it) ends.
  send(tmp.path, torch_line(child, "stuck", 1, SIGTERM) + "\n");
  REQUIRE(eventually([&] { return server.stats().kills == 1; }));
  auto status = worker.wait(10s);
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK_FALSE(stranger.wait(100ms).has_value());
}

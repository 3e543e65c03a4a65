// worker::sample_progress and StallTracker: the stall signal of
// --hang_timeout, from a laid-out /proc (unit) and from real processes.

#include "worker/progress_sampler.h"

#include <signal.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/support/process.h"
#include "tests/worker/worker_test_util.h"

using namespace ctorchrun;
using namespace ctorchrun::worker;
using namespace ctorchrun::worker::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// One process of a fake /proc: stat lines (utime, stime, cutime, cstime as
// given), io counters, children per thread.
struct FakeProc {
  explicit FakeProc(const std::string& root) : root_(root) {}
  void process(pid_t pid, uint64_t ut, uint64_t st, uint64_t cut, uint64_t cst, uint64_t rchar,
               uint64_t wchar, const std::vector<pid_t>& children = {}, char state = 'S') {
    const std::string dir = root_ + "/" + std::to_string(pid);
    fs::create_directories(dir + "/task/" + std::to_string(pid));
    std::string stat = std::to_string(pid) + " (py thon) (x)) " + state +
                       " 1 1 1 0 -1 4194304 0 0 0 0 " + std::to_string(ut) + " " +
                       std::to_string(st) + " " + std::to_string(cut) + " " + std::to_string(cst) +
                       " 20 0 1 0\n";
    write(dir + "/stat", stat);
    write(dir + "/task/" + std::to_string(pid) + "/stat", stat);
    write(dir + "/io", "rchar: " + std::to_string(rchar) + "\nwchar: " + std::to_string(wchar) +
                           "\nsyscr: 1\nsyscw: 1\nread_bytes: 0\nwrite_bytes: 0\n");
    std::string kids;
    for (pid_t c : children) kids += std::to_string(c) + " ";
    write(dir + "/task/" + std::to_string(pid) + "/children", kids);
  }
  void main_thread_ticks(pid_t pid, uint64_t ut) {
    const std::string path = root_ + "/" + std::to_string(pid) + "/task/" + std::to_string(pid);
    write(path + "/stat", std::to_string(pid) + " (p) S 1 1 1 0 -1 0 0 0 0 0 " +
                              std::to_string(ut) + " 0 0 0 20 0 1 0\n");
  }
  static void write(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
  }
  std::string root_;
};

}  // namespace

TEST_CASE("progress: stat_ticks counts fields from the last parenthesis of the name", "[unit]") {
  CHECK(stat_ticks("42 (a) b) S 1 1 1 0 -1 0 0 0 0 0 7 5 3 2 20") == 12);
  CHECK(stat_ticks("42 (a) b) S 1 1 1 0 -1 0 0 0 0 0 7 5 3 2 20", true) == 5);
  CHECK(stat_ticks("garbage") == 0);
  CHECK(stat_ticks("42 (x) S 1 1 1 0 -1 0 0 0 0 0 x 5 3 2") == 0);
  CHECK(io_chars("rchar: 10\nwchar: 32\nsyscr: 99\n") == 42);
  CHECK(io_chars("") == 0);
}

TEST_CASE("progress: a sample sums the main thread and the whole tree under a fake /proc",
          "[unit]") {
  TempDir dir;
  FakeProc p(dir.path);
  p.process(100, 50, 10, 4, 1, 1000, 2000, {101});
  p.main_thread_ticks(100, 30);  // other threads burnt the rest
  p.process(101, 7, 3, 0, 0, 5, 5, {102});
  p.process(102, 1, 1, 0, 0, 0, 10);
  FakeProc::write(dir.file("out.log"), "hello");
  ProgressSample s = sample_progress(100, {dir.file("out.log"), dir.file("missing")}, dir.path);
  CHECK(s.alive);
  CHECK(s.main_thread_ticks == 30);
  CHECK(s.reaped_child_ticks == 5);
  CHECK(s.descendant_ticks == 12);
  CHECK(s.io_bytes == 3020);
  CHECK(s.output_bytes == 5);
  CHECK(s.descendants == 2);

  SECTION("a busy helper thread alone is no progress; the main thread is") {
    p.process(100, 90, 10, 4, 1, 1000, 2000, {101});
    p.main_thread_ticks(100, 30);
    CHECK(sample_progress(100, {dir.file("out.log")}, dir.path) == s);
    p.main_thread_ticks(100, 31);
    CHECK(sample_progress(100, {dir.file("out.log")}, dir.path) != s);
  }
  SECTION("a grandchild's I/O is progress") {
    p.process(102, 1, 1, 0, 0, 0, 11);
    CHECK(sample_progress(100, {dir.file("out.log")}, dir.path) != s);
  }
  SECTION("output written to the log file is progress") {
    FakeProc::write(dir.file("out.log"), "hello world");
    CHECK(sample_progress(100, {dir.file("out.log")}, dir.path) != s);
  }
  SECTION("a zombie or a missing process is not alive") {
    p.process(100, 50, 10, 4, 1, 1000, 2000, {}, 'Z');
    CHECK_FALSE(sample_progress(100, {}, dir.path).alive);
    CHECK_FALSE(sample_progress(999, {}, dir.path).alive);
  }
}

TEST_CASE("progress: StallTracker measures the time since the sample last changed", "[unit]") {
  using Clock = StallTracker::Clock;
  const Clock::time_point t0{};  // a manual clock: times are offsets from it
  StallTracker t;
  ProgressSample a;
  a.alive = true;
  a.main_thread_ticks = 1;
  CHECK(t.stalled_for(t0) == 0ms);
  CHECK(t.observe(a, t0 + 1s));  // the first sample is progress
  CHECK_FALSE(t.observe(a, t0 + 2s));
  CHECK(t.stalled_for(t0 + 6s) == 5s);
  ProgressSample b = a;
  b.io_bytes = 1;
  CHECK(t.observe(b, t0 + 6500ms));
  CHECK(t.stalled_for(t0 + 7s) == 500ms);
  CHECK(t.last_progress() == t0 + 6500ms);
}

namespace {

// Samples `pid` every 100 ms for `span` and says whether any two differed.
bool progressed(pid_t pid, std::chrono::milliseconds span) {
  ProgressSample first = sample_progress(pid, {});
  REQUIRE(first.alive);
  auto end = std::chrono::steady_clock::now() + span;
  while (std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(100ms);
    if (sample_progress(pid, {}) != first) return true;
  }
  return false;
}

}  // namespace

TEST_CASE(
    "progress: real processes - a sleeping tree is stalled but CPU or I/O anywhere in it is "
    "progress",
    "[multiproc]") {
  // Each shell sets itself up, then says "go" so that start-up is not sampled.
  SECTION("a process asleep, with a child asleep") {
    ctorchrun::testing::Process p({"/bin/sh", "-c", "sleep 30 & echo go; wait"});
    REQUIRE(p.read_line(5s) == "go");
    std::this_thread::sleep_for(200ms);
    CHECK(sample_progress(p.pid(), {}).descendants == 1);
    CHECK_FALSE(progressed(p.pid(), 1500ms));
  }
  SECTION("a waiting parent whose child burns CPU") {
    ctorchrun::testing::Process p({"/bin/sh", "-c", "(while :; do :; done) & echo go; wait"});
    REQUIRE(p.read_line(5s) == "go");
    CHECK(progressed(p.pid(), 3s));
  }
  SECTION("a waiting parent whose grandchild writes a file") {
    TempDir dir;
    ctorchrun::testing::Process p(
        {"/bin/sh", "-c",
         "sh -c 'while :; do echo x >> " + dir.file("f") + "; sleep 0.05; done' & echo go; wait"});
    REQUIRE(p.read_line(5s) == "go");
    CHECK(progressed(p.pid(), 3s));
  }
}

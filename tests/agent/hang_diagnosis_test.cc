// What a hang verdict collects before the workers stop: the NCCL flight
// recorder's request against a fake reader of its pipe (Debian's torch is
// CPU-only), and the stacks of a real stalled Python process.

#include "agent/hang_diagnosis.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/json_text.h"
#include "tests/launcher/launcher_support.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::agent;
using namespace std::chrono_literals;

namespace {

// torch's DumpPipe, as ProcessGroupNCCL has it: a FIFO it creates and opens
// for reading without blocking; any byte read makes it write its trace to
// the dump file.
struct FakeFlightRecorder {
  // `writes`: false for a reader that takes the request and writes nothing.
  FakeFlightRecorder(const std::string& pipe, const std::string& dump, bool writes = true)
      : dump_(dump), writes_(writes) {
    REQUIRE(::mkfifo(pipe.c_str(), 0600) == 0);
    fd_ = ::open(pipe.c_str(), O_RDONLY | O_NONBLOCK);
    REQUIRE(fd_ >= 0);
    thread_ = std::thread([this] {
      const auto end = std::chrono::steady_clock::now() + 5s;
      while (std::chrono::steady_clock::now() < end && !stop_) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 10) > 0) {
          char buf[16];
          if (::read(fd_, buf, sizeof buf) > 0) {
            ++requests_;
            if (writes_) std::ofstream(dump_) << "{\"entries\": []}";
          }
        }
      }
    });
  }
  ~FakeFlightRecorder() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  std::string dump_;
  bool writes_ = true;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};

}  // namespace

TEST_CASE("hang: the flight recorder's request reaches a reader of its pipe", "[unit]") {
  testing::TempDir dir;
  {
    FakeFlightRecorder fr(dir.file("pipe3.pipe"), dir.file("dump3"));
    CHECK(request_flight_recorder(dir.file("pipe3.pipe"), 500ms));
    CHECK(testing::wait_for_file(dir.file("dump3"), 2s));
    CHECK(fr.requests_ >= 1);
  }
  // No reader (the FIFO is there, nobody opened it), no pipe at all, or a
  // regular file in its place: false within the bound, nothing created.
  REQUIRE(::mkfifo(dir.file("lonely.pipe").c_str(), 0600) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(request_flight_recorder(dir.file("lonely.pipe"), 100ms));
  CHECK_FALSE(request_flight_recorder(dir.file("missing.pipe"), 100ms));
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK_FALSE(testing::file_exists(dir.file("missing.pipe")));
  std::ofstream(dir.file("plain.pipe")) << "";
  CHECK_FALSE(request_flight_recorder(dir.file("plain.pipe"), 100ms));
}

TEST_CASE("hang: the options follow the workers' environment", "[unit]") {
  testing::TempDir dir;
  DiagnosisOptions off = diagnosis_options("", "/tmp/p", "", "");
  CHECK(off.pipe_prefix.empty());
  CHECK(diagnosis_options("0", "/tmp/p", "", "").pipe_prefix.empty());
  CHECK(diagnosis_options("2000", "", "", "").pipe_prefix.empty());
  DiagnosisOptions on = diagnosis_options("2000", "/tmp/p", "/tmp/d", "/nonexistent:/usr/bin");
  CHECK(on.pipe_prefix == "/tmp/p");
  CHECK(on.dump_prefix == "/tmp/d");
  CHECK(on.eu_stack == (testing::file_exists("/usr/bin/eu-stack") ? "/usr/bin/eu-stack" : ""));
}

TEST_CASE("hang: a stalled Python process's stacks and flight recorder dump land in hang.txt",
          "[multiproc]") {
  testing::TempDir dir;
  const std::string script = dir.file("stalled.py");
  std::ofstream(script) << "import time\n"
                           "def wait_forever():\n"
                           "    print('ready', flush=True)\n"
                           "    time.sleep(3600)\n"
                           "wait_forever()\n";
  // Its stdout is a pipe nobody reads after "ready"; stderr goes to a file,
  // as a worker's does through the launcher in hang mode.
  testing::Process p(
      {"/bin/sh", "-c",
       "PYTHONFAULTHANDLER=1 exec /usr/bin/python3 " + script + " 2>" + dir.file("stderr.log")});
  REQUIRE(p.read_line(10s) == "ready");
  // "ready" comes just before the sleep: sample only once the process is in
  // it, so that its innermost frame is line 4 (at most 10 s).
  const std::string syscall = "/proc/" + std::to_string(p.pid()) + "/syscall";
  const std::string sleeping = std::to_string(SYS_clock_nanosleep) + " ";
  bool in_sleep = false;
  for (int i = 0; i < 1000 && !in_sleep; ++i) {
    in_sleep = testing::read_file(syscall).rfind(sleeping, 0) == 0;
    if (!in_sleep) std::this_thread::sleep_for(10ms);
  }
  REQUIRE(in_sleep);
  FakeFlightRecorder fr(dir.file("pipe7.pipe"), dir.file("dump7"));
  DiagnosisOptions o =
      diagnosis_options("100", dir.file("pipe"), dir.file("dump"), "/usr/bin:/bin");
  const auto t0 = std::chrono::steady_clock::now();
  auto frames = diagnose_hang({{7, 0, p.pid(), dir.path, dir.file("stderr.log")}}, o);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  REQUIRE(frames.size() == 1);
  CHECK(frames[0].rank == 7);
  CHECK(frames[0].frame == "wait_forever at stalled.py:4 (time.sleep(3600))");
  const std::string report = testing::read_file(dir.file("hang.txt"));
  CHECK_THAT(report, Catch::Contains("rank 7"));
  CHECK_THAT(report, Catch::Contains("dump requested: " + dir.file("dump7")));
  CHECK_THAT(report, Catch::Contains("most recent call first"));
  if (!o.eu_stack.empty()) CHECK_THAT(report, Catch::Contains("TID " + std::to_string(p.pid())));
  CHECK(fr.requests_ == 1);
  // SIGABRT ended it (never left stopped).
  auto status = p.wait(5s);
  REQUIRE(status);
  CHECK(WIFSIGNALED(*status));
  CHECK(WTERMSIG(*status) == SIGABRT);
}

TEST_CASE("hang: a frame's source line is cut at 80 bytes between UTF-8 characters", "[unit]") {
  testing::TempDir dir;
  // Lines 2-4 hold multi-byte characters across byte 80: a Chinese comment, an
  // accented string, an emoji.
  const std::string zh = "\xe4\xb8\xad\xe6\x96\x87";  // "中文"
  std::string comment = "time.sleep(3600)  # x ";     // 22 bytes
  // "等", 3 bytes each: one spans bytes 79-81.
  while (comment.size() < 100) comment += "\xe7\xad\x89";
  const std::string accented = "x = '" + std::string(74, 'a') + "\xc3\xa9\xc3\xa9\xc3\xa9'";
  const std::string emoji = "y = '" + std::string(73, 'b') + "\xf0\x9f\x98\x80\xf0\x9f\x98\x80'";
  std::ofstream(dir.file("w.py")) << "import time\n"
                                  << comment << "\n"
                                  << accented << "\n"
                                  << emoji << "\n"
                                  << zh << "\n";
  for (int line = 2; line <= 4; ++line) {
    const std::string dump = "Current thread 0x00007f (most recent call first):\n  File \"" +
                             dir.file("w.py") + "\", line " + std::to_string(line) + " in main\n";
    const std::string frame = innermost_python_frame(dump);
    INFO(frame);
    REQUIRE(frame.rfind("main at w.py:" + std::to_string(line) + " (", 0) == 0);
    const std::string shown =
        frame.substr(frame.find(" (") + 2, frame.size() - frame.find(" (") - 3);
    CHECK(shown.size() <= 80);
    CHECK(shown.size() > 76);
    CHECK(json_text::is_utf8(frame));
    // The summary's events take it.
    CHECK_NOTHROW(nlohmann::json{{"frames", frame}}.dump());
  }
}

TEST_CASE("hang: the stacks' SIGABRT is sent with core dumps turned off", "[multiproc]") {
  testing::TempDir dir;
  // Cores allowed, SIGABRT ignored (so that the process outlives the abort
  // and its limit can be read back).
  testing::Process p(
      {"/bin/sh", "-c", "ulimit -c unlimited && trap '' ABRT && echo ready && exec sleep 60"});
  REQUIRE(p.read_line(10s) == "ready");
  const std::string limits = "/proc/" + std::to_string(p.pid()) + "/limits";
  auto core_limit = [&] {
    for (std::istringstream in(testing::read_file(limits)); in;) {
      std::string l;
      std::getline(in, l);
      if (l.rfind("Max core file size", 0) == 0) return l;
    }
    return std::string();
  };
  REQUIRE_THAT(core_limit(), Catch::Contains("unlimited"));
  DiagnosisOptions o;
  o.budget = 2s;
  o.abort_wait = 100ms;
  auto frames = diagnose_hang({{0, 0, p.pid(), dir.path, dir.file("stderr.log")}}, o);
  REQUIRE(frames.size() == 1);
  const std::string after = core_limit();
  INFO(after);
  std::istringstream fields(after.substr(std::string("Max core file size").size()));
  std::string soft, hard;
  fields >> soft >> hard;
  CHECK(soft == "0");
  CHECK(hard == "0");
}

TEST_CASE("hang: a flight recorder dump an earlier job left at the path is not this hang's",
          "[multiproc]") {
  testing::TempDir dir;
  // Last week's dump at the path; this time the recorder takes the request
  // and writes nothing.
  std::ofstream(dir.file("dump5")) << "{\"entries\": [\"old\"]}";
  const timespec old[2] = {{::time(nullptr) - 7 * 86400, 0}, {::time(nullptr) - 7 * 86400, 0}};
  REQUIRE(::utimensat(AT_FDCWD, dir.file("dump5").c_str(), old, 0) == 0);
  FakeFlightRecorder fr(dir.file("pipe5.pipe"), dir.file("dump5"), /*writes=*/false);
  testing::Process p({"/bin/sleep", "30"});
  DiagnosisOptions o =
      diagnosis_options("100", dir.file("pipe"), dir.file("dump"), "/usr/bin:/bin");
  o.flight_recorder_wait = 500ms;
  diagnose_hang({{5, 0, p.pid(), dir.path, dir.file("stderr.log")}}, o);
  const std::string report = testing::read_file(dir.file("hang.txt"));
  INFO(report);
  CHECK(fr.requests_ == 1);
  CHECK_THAT(report, Catch::Contains("dump requested; none written to " + dir.file("dump5")));
  CHECK_THAT(report, !Catch::Contains("dump requested: "));
}

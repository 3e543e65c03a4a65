// Pure pieces of worker/: the tee line writer, executable lookup, names.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/worker/worker_test_util.h"
#include "worker/executable.h"
#include "worker/launcher.h"
#include "worker/proc_file.h"
#include "worker/tee_writer.h"

using namespace ctorchrun;
using namespace ctorchrun::worker;
using namespace ctorchrun::worker::testing;

namespace {

// A TeeWriter writing to a temporary file (the log) and collecting its
// console lines in a string.
struct TeeFixture {
  TempDir dir;
  int file_fd = ::open(dir.file("file").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::string console_text;
  ~TeeFixture() { ::close(file_fd); }
  std::string file() const { return read_file(dir.file("file")); }
  const std::string& console() const { return console_text; }
  worker::detail::TeeWriter::ConsoleLine sink() {
    return [this](std::string line) { console_text += line; };
  }
};

}  // namespace

TEST_CASE("TeeWriter: prefixes whole lines on the console, joins lines split across chunks",
          "[unit]") {
  TeeFixture f;
  worker::detail::TeeWriter tee(f.file_fd, f.sink(), "[default3]:");
  tee.write("al", 2);
  CHECK(f.console().empty());  // nothing until the line is complete
  tee.write("pha\nbeta\nga", 11);
  tee.write("mma\n\n", 5);
  CHECK(f.console() == "[default3]:alpha\n[default3]:beta\n[default3]:gamma\n[default3]:\n");
  CHECK(f.file() == "alpha\nbeta\ngamma\n\n");
  tee.finish();
  CHECK(f.console() == "[default3]:alpha\n[default3]:beta\n[default3]:gamma\n[default3]:\n");
}

TEST_CASE(
    "TeeWriter: a last line without newline gets one on the console at finish(), not in "
    "the file",
    "[unit]") {
  TeeFixture f;
  worker::detail::TeeWriter tee(f.file_fd, f.sink(), "[p]:");
  tee.write("done\nno newline", 15);
  CHECK(f.console() == "[p]:done\n");
  tee.finish();
  CHECK(f.console() == "[p]:done\n[p]:no newline\n");
  CHECK(f.file() == "done\nno newline");
}

TEST_CASE("TeeWriter: without a console only the file is written, and vice versa", "[unit]") {
  TeeFixture f;
  {
    worker::detail::TeeWriter tee(f.file_fd, {}, "[p]:");
    tee.write("a\nb", 3);
    tee.finish();
  }
  CHECK(f.file() == "a\nb");
  CHECK(f.console().empty());
  {
    worker::detail::TeeWriter tee(-1, f.sink(), "[p]:");
    tee.write("c\n", 2);
    tee.finish();
  }
  CHECK(f.console() == "[p]:c\n");
}

TEST_CASE("TeeWriter: a line longer than kMaxLine reaches the console in bounded pieces",
          "[unit]") {
  TeeFixture f;
  worker::detail::TeeWriter tee(f.file_fd, f.sink(), "[p]:");
  std::string huge(worker::detail::TeeWriter::kMaxLine + 10, 'y');
  tee.write(huge.data(), huge.size());
  tee.write("\n", 1);
  tee.finish();
  CHECK(f.console() == "[p]:" + std::string(worker::detail::TeeWriter::kMaxLine, 'y') +
                           "\n[p]:" + std::string(10, 'y') + "\n");
  CHECK(f.file() == huge + "\n");
}

// Issue 7, item 6: a line of exactly N * kMaxLine bytes gave an extra empty
// prefixed line.
TEST_CASE("TeeWriter: a line exactly kMaxLine or 2 * kMaxLine long adds no empty console line",
          "[unit]") {
  const size_t max = worker::detail::TeeWriter::kMaxLine;
  for (size_t pieces : {1, 2}) {
    TeeFixture f;
    worker::detail::TeeWriter tee(f.file_fd, f.sink(), "[p]:");
    std::string line(pieces * max, 'z');
    tee.write(line.data(), line.size());
    tee.write("\nnext\n", 6);
    tee.finish();
    std::string expected;
    for (size_t i = 0; i < pieces; ++i) expected += "[p]:" + std::string(max, 'z') + "\n";
    expected += "[p]:next\n";
    CHECK(f.console() == expected);
  }
  // The same with the newline in the chunk that completes the line.
  TeeFixture f;
  worker::detail::TeeWriter tee(f.file_fd, f.sink(), "[p]:");
  std::string line(max, 'z');
  line += "\n\n";
  tee.write(line.data(), line.size());
  tee.finish();
  CHECK(f.console() == "[p]:" + std::string(max, 'z') + "\n[p]:\n");  // the real empty line stays
}

TEST_CASE("TeeWriter: a file that cannot be written is reported once, the console carries on",
          "[unit]") {
  TeeFixture f;
  int p[2];
  REQUIRE(::pipe(p) == 0);
  ::close(p[0]);
  // Writing to a pipe without readers must give EPIPE here, not kill the test.
  struct sigaction ign {};
  struct sigaction old {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, &old);
  std::vector<int> errors;
  {
    worker::detail::TeeWriter tee(p[1], f.sink(), "[p]:", [&](int e) { errors.push_back(e); });
    tee.write("one\ntwo\n", 8);
    tee.write("three\n", 6);
    tee.finish();
  }
  ::sigaction(SIGPIPE, &old, nullptr);
  ::close(p[1]);
  CHECK(errors == std::vector<int>{EPIPE});
  CHECK(f.console() == "[p]:one\n[p]:two\n[p]:three\n");
}

TEST_CASE("find_executable: paths are checked, names are searched in the given PATH", "[unit]") {
  TempDir dir;
  std::string prog = dir.file("prog");
  { std::ofstream(prog) << "#!/bin/sh\n"; }
  ::chmod(prog.c_str(), 0755);
  std::string plain = dir.file("plain");
  { std::ofstream(plain) << "data\n"; }
  ::mkdir(dir.file("sub").c_str(), 0755);

  CHECK(worker::detail::find_executable(prog, "", "") == prog);
  CHECK(worker::detail::find_executable("prog", "/nonexistent:" + dir.path, "") == prog);
  CHECK(worker::detail::find_executable("prog", "/nonexistent:" + dir.path + "/", "") == prog);
  // Relative paths and PATH entries are taken from the worker's cwd.
  CHECK(worker::detail::find_executable("./prog", "", dir.path) == dir.path + "/./prog");
  CHECK(worker::detail::find_executable("prog", "/nonexistent::", dir.path) ==
        dir.path + "/./prog");
  // The first match wins; directories and non-executables are skipped.
  CHECK(worker::detail::find_executable("sh", "/nonexistent:/bin:/usr/bin", "") == "/bin/sh");

  auto why = [](const std::string& program, const std::string& path, const std::string& cwd) {
    try {
      worker::detail::find_executable(program, path, cwd);
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    return std::string("found");
  };
  CHECK(why("/nonexistent/x", "", "") == "/nonexistent/x: No such file or directory");
  CHECK(why(plain, "", "") == plain + ": Permission denied");
  CHECK(why(dir.file("sub"), "", "") == dir.file("sub") + ": Is a directory");
  CHECK(why("sub", dir.path, "") == "sub: not found in PATH=" + dir.path);
  CHECK(why("plain", dir.path, "") == "plain: Permission denied (" + plain + " is not executable)");
  CHECK(why("", "/bin", "") == "empty program name (argv[0])");
}

TEST_CASE("WorkerExit: signals are named and never read as exit codes", "[unit]") {
  CHECK(signal_name(SIGSEGV) == "SIGSEGV");
  CHECK(signal_name(SIGTERM) == "SIGTERM");
  CHECK(signal_name(SIGKILL) == "SIGKILL");
  CHECK(signal_name(1000) == "signal 1000");

  WorkerExit ok;
  CHECK_FALSE(ok.failed());
  CHECK(describe(ok) == "exit code 0");
  WorkerExit code;
  code.exit_code = 3;
  CHECK(code.failed());
  CHECK(describe(code) == "exit code 3");
  WorkerExit segv;
  segv.signaled = true;
  segv.signal = SIGSEGV;
  CHECK(segv.failed());
  CHECK(describe(segv) == "signal SIGSEGV (11)");
}

// A /proc file of a process that exits between the open and the read: the
// read fails with ESRCH. std::filebuf throws on that (it once stopped the
// launcher's SIGCHLD handler); read_fd_text ends the text instead.
TEST_CASE("proc files: a process gone between open and read ends the text and throws nothing",
          "[unit]") {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const std::string path = "/proc/" + std::to_string(child) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  std::ifstream stream(path);
  REQUIRE(fd >= 0);
  REQUIRE(stream.is_open());
  ::kill(child, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  // The hazard itself, so that this test shows what it guards against.
  CHECK_THROWS_AS(
      std::string((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>()),
      std::ios_base::failure);
  std::optional<std::string> text = "unchanged";
  CHECK_NOTHROW(text = ctorchrun::worker::read_fd_text(fd));
  CHECK(!text);  // a failed read is no text, not an empty one
  ::close(fd);
  CHECK(ctorchrun::worker::read_proc_file(path).empty());  // gone: cannot be opened
  CHECK(ctorchrun::worker::read_proc_file("/proc/self/stat").find(')') != std::string::npos);
}

TEST_CASE("proc files: a text past the limit or a failing read is never returned cut short",
          "[unit]") {
  ctorchrun::testing::TempDir dir("procfile");
  const auto write_bytes = [&](const std::string& name, size_t bytes) {
    std::ofstream out(dir.file(name), std::ios::binary);
    out << std::string(bytes, '7');
    return dir.file(name);
  };
  const auto read_path = [](const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    auto text = ctorchrun::worker::read_fd_text(fd);
    ::close(fd);
    return text;
  };
  const size_t limit = ctorchrun::worker::kProcTextLimit;
  const auto whole = read_path(write_bytes("at_limit", limit));
  REQUIRE(whole);
  CHECK(whole->size() == limit);
  CHECK(!read_path(write_bytes("past_limit", limit + 1)));
  CHECK(ctorchrun::worker::read_proc_file(dir.file("past_limit")).empty());
  CHECK(!read_path(dir.path));  // read(2) on a directory fails with EISDIR
  const auto empty = read_path(write_bytes("empty", 0));
  REQUIRE(empty);
  CHECK(empty->empty());
}

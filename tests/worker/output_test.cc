// Worker output as the console sees it: the launcher runs inside
// launcher_host, whose stdout is a pipe read by the test.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/process.h"
#include "tests/worker/worker_test_util.h"

using namespace ctorchrun::worker::testing;
using ctorchrun::testing::Process;
using namespace std::chrono_literals;

namespace {

struct HostRun {
  std::string console;  // launcher_host's stdout
  std::string stderr_text;
  int exit_code = -1;
};

// Runs launcher_host with `host_args`, then "--", fake_worker and
// `worker_args`; its stderr goes to a file in `dir`.
HostRun run_host(const TempDir& dir, std::vector<std::string> host_args,
                 const std::vector<std::string>& worker_args) {
  std::vector<std::string> argv = {LAUNCHER_HOST, "--log-dir", dir.path, "--stderr-file",
                                   dir.file("host.err")};
  argv.insert(argv.end(), host_args.begin(), host_args.end());
  argv.push_back("--");
  argv.push_back(FAKE_WORKER);
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  Process host(argv);
  HostRun run;
  run.console = host.read_all(60s);
  run.exit_code = host.exit_code(10s);
  run.stderr_text = read_file(dir.file("host.err"));
  return run;
}

std::string worker_file(const TempDir& dir, int rank, const char* stream) {
  return read_file(dir.path + "/" + std::to_string(rank) + "/" + stream + ".log");
}

std::string numbered_line(const std::string& kind, int rank, long i, long bytes) {
  std::string line = kind + " " + std::to_string(rank) + " " + std::to_string(i) + " ";
  line.append(static_cast<size_t>(bytes) - line.size(), 'x');
  return line;
}

// A whole teed line: "[default<r>]:<kind> <r> <index> xxx...", the line
// after the prefix exactly `bytes` long and of the prefix's own rank.
bool parse_teed(const std::string& line, const std::string& kind, long bytes, int* rank,
                long* index) {
  const std::string head = "[default";
  if (line.rfind(head, 0) != 0 || line.size() < head.size() + 3) return false;
  char r = line[head.size()];
  if (r < '0' || r > '9' || line.compare(head.size() + 1, 2, "]:") != 0) return false;
  std::string rest = line.substr(head.size() + 3);
  if (static_cast<long>(rest.size()) != bytes) return false;
  std::string start = kind + " " + r + " ";
  if (rest.rfind(start, 0) != 0) return false;
  size_t digits_end = rest.find(' ', start.size());
  if (digits_end == std::string::npos || digits_end == start.size()) return false;
  std::string digits = rest.substr(start.size(), digits_end - start.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos) return false;
  if (rest.find_first_not_of('x', digits_end + 1) != std::string::npos) return false;
  *rank = r - '0';
  *index = std::stol(digits);
  return true;
}

// Lines of launcher_host's stderr that are not its own log lines.
std::vector<std::string> non_log_lines(const std::string& text) {
  std::vector<std::string> lines;
  for (auto& line : split_lines(text)) {
    bool log_line = line.rfind("[20", 0) == 0;  // "[%Y-%m-%d ..."
    bool summary = line.rfind("exit ", 0) == 0;
    if (!log_line && !summary) lines.push_back(line);
  }
  return lines;
}

}  // namespace

TEST_CASE("Worker output: without tee or redirects workers write straight to the agent's stdout",
          "[multiproc]") {
  TempDir dir;
  auto run = run_host(dir, {"--workers", "2"}, {"--stdout", "hello-{rank}"});
  CHECK(run.exit_code == 0);
  auto lines = split_lines(run.console);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"hello-0", "hello-1"});  // no prefix
}

TEST_CASE(
    "Worker output: without tee or redirects a worker's stdout and stderr are the agent's own",
    "[multiproc]") {
  TempDir dir;
  Process host({LAUNCHER_HOST, "--mode", "block", "--stderr-file", dir.file("host.err"), "--",
                FAKE_WORKER, "--info-json", dir.file("info.json"), "--sleep-ms", "30000"});
  REQUIRE(host.read_line(20s));  // "pid N"
  REQUIRE(host.read_line(10s) == std::string("ready"));
  REQUIRE(eventually([&] { return !read_file(dir.file("info.json")).empty(); }, 10s));
  auto info = nlohmann::json::parse(read_file(dir.file("info.json")));
  for (int fd : {1, 2}) {
    char target[256] = {};
    std::string link = "/proc/" + std::to_string(host.pid()) + "/fd/" + std::to_string(fd);
    REQUIRE(::readlink(link.c_str(), target, sizeof target - 1) > 0);
    // The very same pipe or file, not a copy the launcher pumps.
    CHECK(info["fd_targets"][std::to_string(fd)] == std::string(target));
  }
}

TEST_CASE("Worker output: redirected streams reach their files and not the console",
          "[multiproc]") {
  TempDir dir;
  auto run = run_host(dir, {"--workers", "2", "--redirects", "3"},
                      {"--stdout", "to-out", "--stderr", "to-err", "--stdout-partial", "tail"});
  CHECK(run.exit_code == 0);
  CHECK(run.console.empty());
  CHECK(non_log_lines(run.stderr_text).empty());
  for (int r = 0; r < 2; ++r) {
    CHECK(worker_file(dir, r, "stdout") == "to-out\ntail");
    CHECK(worker_file(dir, r, "stderr") == "to-err\n");
  }
}

TEST_CASE(
    "Worker output: teed lines of several busy workers reach the console prefixed and whole, "
    "and the files unchanged",
    "[multiproc]") {
  TempDir dir;
  const int workers = 4;
  // Under worker::Console's 1 MiB per stream in all, so that no line may be
  // dropped however slowly the test reads.
  const long out_lines = 700;
  const long err_lines = 300;
  const long bytes = 301;  // lines do not divide stdio's 4096-byte chunks
  auto run = run_host(dir, {"--workers", std::to_string(workers), "--tee", "3"},
                      {"--line-bytes", std::to_string(bytes), "--stdout-lines",
                       std::to_string(out_lines), "--stderr-lines", std::to_string(err_lines)});
  REQUIRE(run.exit_code == 0);

  // Every console line: a valid prefix, then one whole line of the same rank,
  // in order per rank.
  auto check_console = [&](const std::vector<std::string>& lines, const std::string& kind,
                           long per_rank) {
    std::map<int, long> next;
    size_t bad = 0;
    for (const auto& line : lines) {
      int rank = -1;
      long index = -1;
      if (!parse_teed(line, kind, bytes, &rank, &index)) {
        if (++bad <= 3) UNSCOPED_INFO("torn or foreign console line: " << line.substr(0, 120));
        continue;
      }
      if (index != next[rank]) ++bad;
      next[rank] = index + 1;
    }
    CHECK(bad == 0);
    for (int r = 0; r < workers; ++r) CHECK(next[r] == per_rank);
  };
  CHECK(run.console.back() == '\n');
  check_console(split_lines(run.console), "out", out_lines);
  check_console(non_log_lines(run.stderr_text), "err", err_lines);

  for (int r = 0; r < workers; ++r) {
    std::string expected_out;
    for (long i = 0; i < out_lines; ++i) expected_out += numbered_line("out", r, i, bytes) + "\n";
    std::string expected_err;
    for (long i = 0; i < err_lines; ++i) expected_err += numbered_line("err", r, i, bytes) + "\n";
    // Extra parentheses: no multi-megabyte expansion when it fails.
    CHECK((worker_file(dir, r, "stdout") == expected_out));
    CHECK((worker_file(dir, r, "stderr") == expected_err));
  }
}

TEST_CASE(
    "Worker output: a last line without newline is teed with one appended on the console, "
    "unchanged in the file",
    "[multiproc]") {
  TempDir dir;
  auto run = run_host(dir, {"--workers", "1", "--tee", "1"},
                      {"--stdout", "first", "--stdout-partial", "no newline"});
  CHECK(run.exit_code == 0);
  CHECK(run.console == "[default0]:first\n[default0]:no newline\n");
  CHECK(worker_file(dir, 0, "stdout") == "first\nno newline");
}

TEST_CASE("Worker output: console=false keeps a worker's teed lines off the console only",
          "[multiproc]") {
  TempDir dir;
  auto run = run_host(dir, {"--workers", "3", "--tee", "3", "--console-ranks", "1"},
                      {"--stdout", "out-line", "--stderr", "err-line"});
  CHECK(run.exit_code == 0);
  CHECK(run.console == "[default1]:out-line\n");
  CHECK(non_log_lines(run.stderr_text) == std::vector<std::string>{"[default1]:err-line"});
  for (int r = 0; r < 3; ++r) {
    CHECK(worker_file(dir, r, "stdout") == "out-line\n");
    CHECK(worker_file(dir, r, "stderr") == "err-line\n");
  }
}

TEST_CASE("Worker output: tee and redirect mix per stream", "[multiproc]") {
  TempDir dir;
  // stdout teed, stderr redirected only.
  auto run = run_host(dir, {"--workers", "1", "--tee", "1", "--redirects", "2"},
                      {"--stdout", "shown", "--stderr", "hidden"});
  CHECK(run.exit_code == 0);
  CHECK(run.console == "[default0]:shown\n");
  CHECK(non_log_lines(run.stderr_text).empty());
  CHECK(worker_file(dir, 0, "stdout") == "shown\n");
  CHECK(worker_file(dir, 0, "stderr") == "hidden\n");
}

// Issue 7, item 1: nothing reads the console while the worker writes 6 MB.
TEST_CASE(
    "Worker output: a console that does not keep up loses whole lines, counted, and the file "
    "keeps every byte",
    "[multiproc]") {
  TempDir dir;
  const long lines = 30000;
  const long bytes = 200;
  Process host({LAUNCHER_HOST, "--log-dir", dir.path, "--stderr-file", dir.file("host.err"),
                "--tee", "1", "--", FAKE_WORKER, "--line-bytes", std::to_string(bytes),
                "--stdout-lines", std::to_string(lines)});
  const std::string file = dir.path + "/0/stdout.log";
  auto file_complete = [&] {
    struct stat st;
    return ::stat(file.c_str(), &st) == 0 && st.st_size == lines * (bytes + 1);
  };
  // The worker finishes although its console is stuck.
  REQUIRE(eventually(file_complete, 60s));
  std::string console = host.read_all(60s);
  CHECK(host.exit_code(10s) == 0);
  auto shown = split_lines(console);
  CHECK(shown.size() > 0);
  CHECK(static_cast<long>(shown.size()) < lines);
  long last = -1;
  size_t bad = 0;
  for (const auto& line : shown) {
    int rank = -1;
    long index = -1;
    if (!parse_teed(line, "out", bytes, &rank, &index) || index <= last) ++bad;
    last = index;
  }
  CHECK(bad == 0);  // whole lines, in order, gaps where lines were dropped
  std::string err = read_file(dir.file("host.err"));
  INFO(err);
  CHECK(err.find("lines for the console (stdout) were") != std::string::npos);
  CHECK((read_file(file).size() == static_cast<size_t>(lines * (bytes + 1))));
}

// --local_ranks_filter through the real ctorchrun binary: the ranks left out
// put nothing on the console, whatever --redirects and --tee say, as torch
// 2.x's DefaultLogsSpecs.reify decides: their teed streams go to the log
// files only, and a stream neither redirected nor teed goes to /dev/null.
// The log files keep everything.

#include <catch2/catch.hpp>
#include <filesystem>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;

namespace {

// Two local ranks; each prints two lines "out <local_rank> <i> ..." to stdout
// and two "err <local_rank> <i> ..." to stderr. Returns the console (stdout
// and stderr merged) and, through `run_dir`, the run's log directory.
LaunchResult run_filtered(const std::vector<std::string>& options, const TempDir& d,
                          std::string* run_dir) {
  auto r = run_ctorchrun(
      concat(concat({"--standalone", "--nproc_per_node=2", "--log_dir=" + d.path}, options),
             {"--no_python", FAKE_WORKER, "--line-bytes", "24", "--stdout-lines", "2",
              "--stderr-lines", "2"}));
  for (const auto& e : std::filesystem::directory_iterator(d.path)) *run_dir = e.path().string();
  return r;
}

int lines_in_file(const std::string& path, const std::string& needle) {
  return file_exists(path) ? count_lines_with(read_file(path), needle) : 0;
}

}  // namespace

TEST_CASE("ctorchrun: ranks left out by --local_ranks_filter without --tee print nothing",
          "[multiproc]") {
  TempDir d;
  std::string run_dir;
  auto r = run_filtered({"--local_ranks_filter=0"}, d, &run_dir);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_lines_with(r.output, "out 0 ") == 2);
  CHECK(count_lines_with(r.output, "err 0 ") == 2);
  CHECK(count_lines_with(r.output, "out 1 ") == 0);
  CHECK(count_lines_with(r.output, "err 1 ") == 0);
}

TEST_CASE("ctorchrun: with --tee a rank left out by the filter writes its files, not the console",
          "[multiproc]") {
  TempDir d;
  std::string run_dir;
  // Rank 1: stdout teed (so to its file only), stderr neither teed nor
  // redirected (so to /dev/null, not the console).
  auto r = run_filtered({"--tee=1", "--local-ranks-filter=0"}, d, &run_dir);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_lines_with(r.output, "[default0]:out 0 ") == 2);
  CHECK(count_lines_with(r.output, "err 0 ") == 2);
  CHECK(count_lines_with(r.output, "out 1 ") == 0);
  CHECK(count_lines_with(r.output, "err 1 ") == 0);
  CHECK(lines_in_file(run_dir + "/attempt_0/0/stdout.log", "out 0 ") == 2);
  CHECK(lines_in_file(run_dir + "/attempt_0/1/stdout.log", "out 1 ") == 2);
}

TEST_CASE("ctorchrun: with --redirects a rank left out by the filter keeps its redirected file",
          "[multiproc]") {
  TempDir d;
  std::string run_dir;
  // Rank 0: stderr redirected (file), stdout neither (/dev/null).
  auto r = run_filtered({"--redirects=2", "--local_ranks_filter=1"}, d, &run_dir);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(count_lines_with(r.output, "out 0 ") == 0);
  CHECK(count_lines_with(r.output, "err 0 ") == 0);
  CHECK(count_lines_with(r.output, "out 1 ") == 2);  // not redirected: the console
  CHECK(count_lines_with(r.output, "err 1 ") == 0);  // redirected: its file
  CHECK(lines_in_file(run_dir + "/attempt_0/0/stderr.log", "err 0 ") == 2);
  CHECK(lines_in_file(run_dir + "/attempt_0/1/stderr.log", "err 1 ") == 2);
}

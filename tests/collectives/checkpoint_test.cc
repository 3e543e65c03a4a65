// Checkpoint files through the API every version has had (save, load, list,
// load the latest): pruning, temporary files of saves that died, missing
// parent directories, two writers, and the memory a load takes.

#include "collectives/checkpoint.h"

#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/collectives/checkpoint_support.h"

namespace dist = ctorchrun::dist;
using ckpt_test::Child;
using ckpt_test::names_starting;
using ckpt_test::peak_kib;
using ckpt_test::reset_peak;
using ckpt_test::slurp;
using ckpt_test::spit;
using ckpt_test::TempDir;
using ckpt_test::valid_steps;

namespace {

std::vector<int64_t> steps_in(const std::string& dir) { return dist::list_checkpoints(dir); }

}  // namespace

TEST_CASE("checkpoint pruning keeps the file just written when a higher step is invalid",
          "[unit]") {
  TempDir dir;
  dist::save_checkpoint(dir.path, 100, "step 100", 1);
  const std::string garbage =
      "not a checkpoint, but long enough to hold a header and a trailer: 0123456789";
  const std::string bad = dist::checkpoint_path(dir.path, 120);
  spit(bad, garbage);
  auto resumed = dist::load_latest_checkpoint(dir.path);
  REQUIRE(resumed.has_value());
  CHECK(resumed->step == 100);

  const std::string written = dist::save_checkpoint(dir.path, 101, "step 101", 1);
  auto reread = dist::load_checkpoint(written);
  REQUIRE(reread.has_value());
  CHECK(reread->payload == "step 101");
  // The invalid file is neither counted nor removed: a person looks at it.
  CHECK(steps_in(dir.path) == std::vector<int64_t>{101, 120});
  CHECK(slurp(bad) == garbage);
  auto latest = dist::load_latest_checkpoint(dir.path);
  REQUIRE(latest.has_value());
  CHECK(latest->step == 101);
}

TEST_CASE("checkpoint pruning counts only valid files and keeps keep_last of them", "[unit]") {
  TempDir dir;
  for (int step = 1; step <= 3; ++step) {
    dist::save_checkpoint(dir.path, step, "step " + std::to_string(step), 3);
  }
  // Step 2 goes bad on disk: one bit flipped.
  const std::string two = dist::checkpoint_path(dir.path, 2);
  std::string bad = slurp(two);
  bad[26] = static_cast<char>(bad[26] ^ 0x01);
  spit(two, bad);

  dist::save_checkpoint(dir.path, 4, "step 4", 3);
  // Three valid ones are kept (4, 3 and 1); the invalid 2 stays untouched.
  CHECK(valid_steps(dir.path) == std::vector<int64_t>{1, 3, 4});
  CHECK(steps_in(dir.path) == std::vector<int64_t>{1, 2, 3, 4});
  CHECK(slurp(two) == bad);

  dist::save_checkpoint(dir.path, 5, "step 5", 3);
  CHECK(steps_in(dir.path) == std::vector<int64_t>{2, 3, 4, 5});

  // A step written below a valid higher one is still kept: never the file
  // just written.
  dist::save_checkpoint(dir.path, 9, "step 9", 1);
  CHECK(steps_in(dir.path) == std::vector<int64_t>{2, 9});
  dist::save_checkpoint(dir.path, 7, "step 7", 1);
  CHECK(steps_in(dir.path) == std::vector<int64_t>{2, 7, 9});
  CHECK(valid_steps(dir.path) == std::vector<int64_t>{7, 9});
}

TEST_CASE(
    "checkpoint temporary files of a save killed midway are swept by the next save or load, "
    "this host's only",
    "[unit]") {
  TempDir dir;
  // Each save runs in a process of its own, as a restarted worker's would.
  {
    Child first([&](int, int) { dist::save_checkpoint(dir.path, 1, "step 1"); });
    const int status = first.wait(60000);
    INFO(first.output());
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
  }
  // A save killed midway: the file size limit stops it after 1 MiB of 2.
  Child crash([&](int, int) {
    ::signal(SIGXFSZ, SIG_DFL);
    rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    rlimit one_mib{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &one_mib);
    dist::save_checkpoint(dir.path, 2, std::string(2 << 20, 'x'));
  });
  const pid_t dead = crash.pid();
  const int status = crash.wait(60000);
  INFO(crash.output());
  REQUIRE(WIFSIGNALED(status));
  REQUIRE(WTERMSIG(status) == SIGXFSZ);

  auto temps = names_starting(dir.path, ".tmp-");
  REQUIRE(temps.size() == 1);
  CHECK(std::filesystem::file_size(dir.path + "/" + temps[0]) > 0);
  // Its name says whose it is: the pid and the host (the directory may be
  // shared between hosts).
  CHECK_THAT(temps[0], Catch::Contains("-" + std::to_string(dead) + "-") &&
                           Catch::Contains("-" + ckpt_test::temp_host() + "-"));

  // What a sweep leaves: another host's file, and a live process's.
  std::vector<std::string> kept = {
      ".tmp-" + std::to_string(dead) + "-another-host.example-ckpt-000000000005.ctckpt",
      ".tmp-" + std::to_string(::getppid()) + "-" + ckpt_test::temp_host() +
          "-ckpt-000000000006.ctckpt"};
  for (const auto& name : kept) spit(dir.path + "/" + name, "partial");
  std::sort(kept.begin(), kept.end());

  SECTION("by the next save") {
    dist::save_checkpoint(dir.path, 3, "step 3");
    CHECK(steps_in(dir.path) == std::vector<int64_t>{1, 3});
  }
  SECTION("by the next load") {
    auto latest = dist::load_latest_checkpoint(dir.path);
    REQUIRE(latest.has_value());
    CHECK(latest->step == 1);
  }
  CHECK(names_starting(dir.path, ".tmp-") == kept);
}

TEST_CASE("checkpoint save creates the missing parents of its directory", "[unit]") {
  TempDir dir;
  const std::string nested = dir.path + "/runs/job 7/ckpt";
  REQUIRE_NOTHROW(dist::save_checkpoint(nested, 1, "step 1"));
  auto latest = dist::load_latest_checkpoint(nested);
  REQUIRE(latest.has_value());
  CHECK(latest->payload == "step 1");
  // A file in the way is an error, and stays as it was.
  spit(dir.path + "/file", "mine");
  CHECK_THROWS_AS(dist::save_checkpoint(dir.path + "/file/ckpt", 1, "step 1"), ctorchrun::IoError);
  CHECK(slurp(dir.path + "/file") == "mine");
}

TEST_CASE("checkpoint a second process writing a directory gets InvalidArgument naming the holder",
          "[unit]") {
  TempDir dir;
  Child holder([&](int out, int in) {
    dist::save_checkpoint(dir.path, 1, "step 1");
    ckpt_test::write_text(out, "saved\n");
    ckpt_test::read_line_fd(in, 60000);  // until the test lets it go
  });
  REQUIRE(holder.read_line(60000) == "saved\n");

  std::string message;
  try {
    dist::save_checkpoint(dir.path, 2, "step 2");
  } catch (const ctorchrun::InvalidArgument& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains("pid " + std::to_string(holder.pid())) &&
                          Catch::Contains(ckpt_test::temp_host()) && Catch::Contains(dir.path));
  CHECK(steps_in(dir.path) == std::vector<int64_t>{1});
  CHECK(names_starting(dir.path, ".tmp-").empty());

  // The holder exits, and its lock goes with it.
  holder.send("go\n");
  const int status = holder.wait(60000);
  CHECK(WIFEXITED(status));
  REQUIRE_NOTHROW(dist::save_checkpoint(dir.path, 2, "step 2"));
  CHECK(steps_in(dir.path) == std::vector<int64_t>{1, 2});
}

TEST_CASE("checkpoint loading a 64 MiB checkpoint grows peak memory by under 1.1 times its size",
          "[unit]") {
  TempDir dir;
  constexpr size_t kSize = size_t{64} << 20;
  const std::string path = ckpt_test::save_large_checkpoint(dir.path, kSize);
  // Measured in a child of its own: its peak starts at what it holds now.
  Child child([&](int out, int) {
    if (!reset_peak()) throw std::runtime_error("cannot reset VmHWM");
    const long before = peak_kib();
    auto loaded = dist::load_checkpoint(path);
    const long after = peak_kib();
    const bool ok = loaded && loaded->payload.size() == kSize &&
                    loaded->payload[4096 * 77] == static_cast<char>(77);
    ckpt_test::write_text(out, std::to_string(after - before) + (ok ? " ok\n" : " bad\n"));
  });
  std::istringstream line(child.read_line(120000));
  long growth_kib = -1;
  std::string ok;
  line >> growth_kib >> ok;
  const int status = child.wait(60000);
  INFO(child.output());
  CHECK(WIFEXITED(status));
  CAPTURE(growth_kib);
  CHECK(ok == "ok");
  // The payload itself is there (the measure measures), and little more.
  CHECK(growth_kib * 1024 >= static_cast<long>(kSize * 9 / 10));
  CHECK(growth_kib * 1024 <= static_cast<long>(kSize * 11 / 10 + (4 << 20)));
}

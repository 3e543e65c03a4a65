// common/procfs.h: /proc/<pid>/stat read totally.

#include "common/procfs.h"

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "tests/support/process.h"

using namespace ctorchrun::procfs;
using namespace std::chrono_literals;

TEST_CASE("procfs: stat's fields after a command name with spaces and parentheses", "[unit]") {
  const std::string text =
      "4242 (a (b) c) D 17 4242 4242 0 -1 4194560 100 0 0 0 57 31 0 0 20 0 1 0 98765 0 0 "
      "18446744073709551615\n";
  auto s = parse_stat(text);
  REQUIRE(s);
  CHECK(s->state == 'D');
  CHECK(s->ppid == 17);
  CHECK(s->pgrp == 4242);
  CHECK(s->session == 4242);
  CHECK(s->utime == 57);
  CHECK(s->stime == 31);
  CHECK(s->starttime == 98765);
  // A line that ends after cstime has no starttime (0).
  auto short_line = parse_stat("42 (a) b) S 1 1 1 0 -1 0 0 0 0 0 7 5 3 2 20");
  REQUIRE(short_line);
  CHECK(short_line->utime + short_line->stime == 12);
  CHECK(short_line->cutime + short_line->cstime == 5);
  CHECK(short_line->starttime == 0);
  for (const std::string bad : {"", "12 (x", "12 (x) ", "12 (x) DD 1 2 3", "12 (x) R 1 2",
                                "12 (x) R a 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19",
                                "42 (x) S 1 1 1 0 -1 0 0 0 0 0 x 5 3 2"}) {
    INFO(bad);
    CHECK_FALSE(parse_stat(bad));
  }
}

TEST_CASE("procfs: a process blocked in vfork reads as D, then gone", "[multiproc]") {
  ctorchrun::testing::Process p({FAKE_WORKER, "--vfork-sleep-ms", "1500"});
  std::optional<Stat> s;
  for (int i = 0; i < 100; ++i) {  // up to 1 s for the vfork to begin
    s = read_stat(p.pid());
    if (s && s->state == 'D') break;
    std::this_thread::sleep_for(10ms);
  }
  REQUIRE(s);
  CHECK(s->state == 'D');
  CHECK(s->ppid == ::getpid());
  CHECK(p.exit_code(10s) == 0);
  CHECK_FALSE(read_stat(p.pid()));
  CHECK_FALSE(running(p.pid()));
  CHECK(read_stat(::getpid())->state == 'R');
  CHECK(running(::getpid()));
}

// Checkpoints through the API added for issue 23: loads into the caller's
// buffer, the test hook of dist::detail (the order of a save's syncs, a crash
// at every step of a save), release_checkpoint_lock.

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "collectives/checkpoint.h"
#include "common/error.h"
#include "tests/collectives/checkpoint_support.h"

namespace dist = ctorchrun::dist;
using ckpt_test::Child;
using ckpt_test::names_starting;
using ckpt_test::peak_kib;
using ckpt_test::reset_peak;
using ckpt_test::spit;
using ckpt_test::TempDir;
using ckpt_test::valid_steps;

namespace {

std::vector<std::pair<std::string, std::string>> g_events;
void record_event(const char* event, const std::string& path) {
  g_events.emplace_back(event, path);
}

// The crash: the process ends at event number g_crash_at (from 0).
long g_crash_at = -1;
long g_seen = 0;
void crash_at_event(const char* /*event*/, const std::string& /*path*/) {
  if (g_seen++ == g_crash_at) ::_exit(77);
}

struct EventHook {
  explicit EventHook(dist::detail::CheckpointEventHook hook) {
    dist::detail::set_checkpoint_event_hook(hook);
  }
  ~EventHook() { dist::detail::set_checkpoint_event_hook(nullptr); }
};

// The first event `event` on `path` at or after `from`; -1 if none.
long find_event(const std::string& event, const std::string& path, long from = 0) {
  for (size_t i = static_cast<size_t>(from); i < g_events.size(); ++i) {
    if (g_events[i].first == event && g_events[i].second == path) return static_cast<long>(i);
  }
  return -1;
}

std::string payload_of(int64_t step) {
  return "step " + std::to_string(step) + std::string(3000, static_cast<char>('a' + step));
}

}  // namespace

TEST_CASE("checkpoint save syncs each directory it creates and the file before the rename",
          "[unit]") {
  TempDir dir;
  const std::string a = dir.path + "/a";
  const std::string b = a + "/b";
  g_events.clear();
  std::string written;
  {
    EventHook hook(record_event);
    written = dist::save_checkpoint(b, 1, "step 1");
  }
  const long rename = find_event("rename", written);
  REQUIRE(rename >= 0);
  // Each new directory: made, then its parent synced, before the rename.
  const long mkdir_a = find_event("mkdir", a);
  const long mkdir_b = find_event("mkdir", b);
  REQUIRE(mkdir_a >= 0);
  REQUIRE(mkdir_b > mkdir_a);
  const long sync_top = find_event("fsync-dir", dir.path, mkdir_a);
  const long sync_a = find_event("fsync-dir", a, mkdir_b);
  CHECK(sync_top > mkdir_a);
  CHECK(sync_top < rename);
  CHECK(sync_a > mkdir_b);
  CHECK(sync_a < rename);
  // The file: created, written, synced, renamed; then its directory synced.
  long create = -1;
  std::string temp;
  for (size_t i = 0; i < g_events.size() && create < 0; ++i) {
    if (g_events[i].first == "create") {
      create = static_cast<long>(i);
      temp = g_events[i].second;
    }
  }
  REQUIRE(create >= 0);
  CHECK_THAT(temp, Catch::StartsWith(b + "/.tmp-"));
  const long sync_file = find_event("fsync", temp);
  CHECK(find_event("write", temp) > create);
  CHECK(sync_file > create);
  CHECK(sync_file < rename);
  CHECK(find_event("fsync-dir", b, rename) > rename);
}

TEST_CASE("checkpoint a crash at every step of a save leaves the old or the new checkpoint",
          "[unit]") {
  // Before: steps 1 and 2 valid, a corrupt 9; the save writes 3, keeping 2.
  TempDir before;
  for (int64_t step : {1, 2}) dist::save_checkpoint(before.path, step, payload_of(step));
  spit(dist::checkpoint_path(before.path, 9), "corrupt, and long enough to have a header and more");
  dist::release_checkpoint_lock(before.path);
  auto copy_of_before = [&](const std::string& to) {
    std::filesystem::copy(before.path, to, std::filesystem::copy_options::recursive);
  };

  // The steps of a whole save, recorded once.
  size_t steps = 0;
  {
    TempDir scratch;
    const std::string work = scratch.path + "/ckpt";
    copy_of_before(work);
    g_events.clear();
    {
      EventHook hook(record_event);
      dist::save_checkpoint(work, 3, payload_of(3), 2);
    }
    dist::release_checkpoint_lock(work);
    steps = g_events.size();
    CHECK(find_event("unlink", dist::checkpoint_path(work, 1)) >= 0);
  }
  REQUIRE(steps >= 8);

  bool saw_old = false;
  bool saw_new = false;
  for (size_t k = 0; k < steps; ++k) {
    CAPTURE(k);
    TempDir scratch;
    const std::string work = scratch.path + "/ckpt";
    copy_of_before(work);
    Child child([&](int, int) {
      g_seen = 0;
      g_crash_at = static_cast<long>(k);
      dist::detail::set_checkpoint_event_hook(crash_at_event);
      dist::save_checkpoint(work, 3, payload_of(3), 2);
    });
    const int status = child.wait(60000);
    INFO(child.output());
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 77);

    auto latest = dist::load_latest_checkpoint(work);
    REQUIRE(latest.has_value());
    CHECK((latest->step == 2 || latest->step == 3));
    CHECK(latest->payload == payload_of(latest->step));
    (latest->step == 3 ? saw_new : saw_old) = true;
    // Nothing valid was lost before the new one was in place, and every
    // checkpoint name holds a whole file (the corrupt 9 aside).
    const auto valid = valid_steps(work);
    CHECK(valid.size() >= 2);
    CHECK(dist::list_checkpoints(work).size() == valid.size() + 1);

    // The next save recovers: the same result as a save that never crashed.
    dist::save_checkpoint(work, 3, payload_of(3), 2);
    dist::release_checkpoint_lock(work);
    CHECK(valid_steps(work) == std::vector<int64_t>{2, 3});
    CHECK(names_starting(work, ".tmp-").empty());
  }
  CHECK(saw_old);
  CHECK(saw_new);
}

TEST_CASE("checkpoint load into the caller's buffer fills it and rejects a payload too large",
          "[unit]") {
  TempDir dir;
  dist::save_checkpoint(dir.path, 1, "step 1");
  const std::string two = dist::save_checkpoint(dir.path, 2, std::string(1000, 'b'));
  std::vector<char> buffer(1000, '\0');
  std::string why;

  auto info = dist::load_checkpoint(two, buffer.data(), buffer.size(), &why);
  REQUIRE(info.has_value());
  CHECK(info->step == 2);
  CHECK(info->size == 1000);
  CHECK(info->path == two);
  CHECK(std::string(buffer.data(), buffer.size()) == std::string(1000, 'b'));

  std::fill(buffer.begin(), buffer.end(), '\0');
  CHECK_FALSE(dist::load_checkpoint(two, buffer.data(), 999, &why).has_value());
  CHECK_THAT(why, Catch::Contains("does not fit"));
  CHECK(buffer[0] == '\0');  // rejected before anything was read

  auto latest = dist::load_latest_checkpoint(dir.path, buffer.data(), buffer.size());
  REQUIRE(latest.has_value());
  CHECK(latest->step == 2);
  // The newest one too large for the buffer: skipped for the one that fits.
  auto small = dist::load_latest_checkpoint(dir.path, buffer.data(), 10);
  REQUIRE(small.has_value());
  CHECK(small->step == 1);
  CHECK(std::string(buffer.data(), small->size) == "step 1");

  // A corrupted file: rejected by its checksum, as the other load does.
  std::string bad = ckpt_test::slurp(two);
  bad[500] = static_cast<char>(bad[500] ^ 0x40);
  spit(two, bad);
  CHECK_FALSE(dist::load_checkpoint(two, buffer.data(), buffer.size(), &why).has_value());
  CHECK_THAT(why, Catch::Contains("checksum"));
}

TEST_CASE("checkpoint load of 64 MiB into the caller's buffer takes little memory besides",
          "[unit]") {
  TempDir dir;
  constexpr size_t kSize = size_t{64} << 20;
  const std::string path = ckpt_test::save_large_checkpoint(dir.path, kSize);
  Child child([&](int out, int) {
    std::vector<char> buffer(kSize, '\1');  // the caller's, touched before the measure
    if (!reset_peak()) throw std::runtime_error("cannot reset VmHWM");
    const long before = peak_kib();
    auto info = dist::load_checkpoint(path, buffer.data(), buffer.size());
    const long after = peak_kib();
    const bool ok = info && info->size == kSize && buffer[4096 * 77] == static_cast<char>(77);
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
  CHECK(growth_kib >= 0);
  CHECK(growth_kib * 1024 <= (4 << 20));
}

TEST_CASE("checkpoint release_checkpoint_lock lets another process write the directory", "[unit]") {
  TempDir dir;
  dist::save_checkpoint(dir.path, 1, "step 1");
  auto save_in_child = [&](int64_t step) {
    Child child([&](int out, int) {
      try {
        dist::save_checkpoint(dir.path, step, "step " + std::to_string(step));
        ckpt_test::write_text(out, "saved\n");
      } catch (const ctorchrun::ConfigError& e) {
        ckpt_test::write_text(out, std::string("refused: ") + e.what() + "\n");
      }
    });
    std::string line = child.read_line(60000);
    child.wait(60000);
    return line;
  };
  // A forked child is another process: the parent's lock keeps it out.
  CHECK_THAT(save_in_child(2),
             Catch::StartsWith("refused") && Catch::Contains("pid " + std::to_string(::getpid())));
  dist::release_checkpoint_lock(dir.path);
  CHECK(save_in_child(3) == "saved\n");
  // The child has exited; a save here takes the lock again.
  REQUIRE_NOTHROW(dist::save_checkpoint(dir.path, 4, "step 4"));
  CHECK(dist::list_checkpoints(dir.path) == std::vector<int64_t>{1, 3, 4});
}

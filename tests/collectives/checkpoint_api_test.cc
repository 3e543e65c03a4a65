// Checkpoints through the API added for issue 23: loads into the caller's
// buffer.

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
  std::string path;
  {
    std::string payload(kSize, '\0');
    for (size_t i = 0; i < kSize; i += 4096) payload[i] = static_cast<char>(i / 4096);
    path = dist::save_checkpoint(dir.path, 1, payload);
  }
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

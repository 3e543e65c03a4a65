// Checkpoint files through the API every version has had (save, load, list,
// load the latest): the memory a load takes.

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

TEST_CASE("checkpoint loading a 64 MiB checkpoint grows peak memory by under 1.1 times its size",
          "[unit]") {
  TempDir dir;
  constexpr size_t kSize = size_t{64} << 20;
  std::string path;
  {
    std::string payload(kSize, '\0');
    for (size_t i = 0; i < kSize; i += 4096) payload[i] = static_cast<char>(i / 4096);
    path = dist::save_checkpoint(dir.path, 1, payload);
  }
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

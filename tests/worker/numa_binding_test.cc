// --numa-binding's plan against a fake sysfs tree (2 sockets x 2 NUMA nodes
// of 4 CPUs each, an L3 per 2 CPUs, 8 NVIDIA GPUs two per node, plus a
// memory-only node and a non-GPU PCI device), and on this machine's own.

#include "worker/numa_binding.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using worker::NumaBinding;

namespace {

namespace fs = std::filesystem;

void put(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text << "\n";
}

// The fake tree under a fresh directory, removed with it.
struct FakeSysfs {
  FakeSysfs() {
    const fs::path r(root);
    for (int node = 0; node < 4; ++node) {
      const int first = node * 4;
      put(r / "devices/system/node" / ("node" + std::to_string(node)) / "cpulist",
          std::to_string(first) + "-" + std::to_string(first + 3));
      for (int cpu = first; cpu < first + 4; ++cpu) {
        const fs::path c = r / "devices/system/cpu" / ("cpu" + std::to_string(cpu));
        put(c / "topology/physical_package_id", std::to_string(node / 2));
        const int l3 = cpu - cpu % 2;
        put(c / "cache/index3/shared_cpu_list", std::to_string(l3) + "-" + std::to_string(l3 + 1));
      }
    }
    put(r / "devices/system/node/node4/cpulist", "");  // memory only
    // GPUs on buses 0x10..0x17 (listed out of order on purpose), two per node.
    for (int g : {3, 0, 7, 1, 2, 6, 4, 5}) {
      const fs::path d = r / "bus/pci/devices" / ("0000:" + std::to_string(10 + g) + ":00.0");
      put(d / "vendor", "0x10de");
      put(d / "class", "0x030200");
      put(d / "numa_node", std::to_string(g / 2));
    }
    const fs::path nic = r / "bus/pci/devices/0000:05:00.0";
    put(nic / "vendor", "0x15b3");
    put(nic / "class", "0x020000");
    put(nic / "numa_node", "3");
  }
  ctorchrun::testing::TempDir dir{"sysfs"};
  const std::string root = dir.path;
};

std::vector<int> range(int lo, int hi) {
  std::vector<int> v;
  for (int i = lo; i <= hi; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST_CASE("numa binding: the topology is read from sysfs, GPUs in PCI bus order", "[unit]") {
  FakeSysfs sys;
  auto t = worker::read_cpu_topology(sys.root);
  REQUIRE(t.nodes.size() == 4);  // the memory-only node has no CPUs
  CHECK(t.nodes[2].cpus == range(8, 11));
  CHECK(t.nodes[2].socket == 1);
  CHECK(t.core_complex.size() == 8);
  CHECK(t.gpu_nodes == std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3});
  CHECK(worker::parse_cpu_list("0-3,8,10-11") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK_THROWS_AS(worker::parse_cpu_list("3-1"), IoError);
  CHECK_THROWS_AS(worker::parse_cpu_list("x"), IoError);
  CHECK_THROWS_AS(worker::read_cpu_topology(sys.root + "/nonexistent"), IoError);
}

TEST_CASE("numa binding: each mode's CPUs per local rank, by GPU and CUDA_VISIBLE_DEVICES",
          "[unit]") {
  FakeSysfs sys;
  auto t = worker::read_cpu_topology(sys.root);
  auto node = worker::numa_cpus(NumaBinding::kNode, t, 8, std::nullopt);
  REQUIRE(node.size() == 8);
  CHECK(node[0] == range(0, 3));
  CHECK(node[1] == range(0, 3));
  CHECK(node[5] == range(8, 11));
  CHECK(node[7] == range(12, 15));
  auto socket = worker::numa_cpus(NumaBinding::kSocket, t, 8, std::nullopt);
  CHECK(socket[0] == range(0, 7));
  CHECK(socket[6] == range(8, 15));
  auto exclusive = worker::numa_cpus(NumaBinding::kExclusive, t, 8, std::nullopt);
  CHECK(exclusive[0] == range(0, 1));
  CHECK(exclusive[1] == range(2, 3));
  CHECK(exclusive[7] == range(14, 15));
  auto ccx = worker::numa_cpus(NumaBinding::kCoreComplex, t, 8, std::nullopt);
  CHECK(ccx[2] == range(4, 5));
  CHECK(ccx[3] == range(6, 7));
  // CUDA_VISIBLE_DEVICES picks the GPUs: local rank 0 on GPU 6 (node 3).
  auto visible = worker::numa_cpus(NumaBinding::kNode, t, 2, std::string("6,1"));
  CHECK(visible[0] == range(12, 15));
  CHECK(visible[1] == range(0, 3));
  CHECK_THROWS_AS(worker::numa_cpus(NumaBinding::kNode, t, 3, std::string("6,1")), ConfigError);
  CHECK_THROWS_AS(worker::numa_cpus(NumaBinding::kNode, t, 1, std::string("8")), ConfigError);
  CHECK_THROWS_AS(worker::numa_cpus(NumaBinding::kNode, t, 1, std::string("GPU-uuid")),
                  ConfigError);
  // Without GPUs, ranks are spread over the nodes in order.
  t.gpu_nodes.clear();
  auto spread = worker::numa_cpus(NumaBinding::kNode, t, 5, std::nullopt);
  CHECK(spread[0] == range(0, 3));
  CHECK(spread[3] == range(12, 15));
  CHECK(spread[4] == range(0, 3));
  CHECK(worker::parse_numa_binding("core-complex") == NumaBinding::kCoreComplex);
  CHECK_FALSE(worker::parse_numa_binding("numa").has_value());
}

TEST_CASE("numa binding: each rank prefers its GPU's node's memory, socket mode its socket's nodes",
          "[unit]") {
  FakeSysfs sys;
  auto t = worker::read_cpu_topology(sys.root);
  for (auto mode : {NumaBinding::kNode, NumaBinding::kExclusive, NumaBinding::kCoreComplex}) {
    auto mem = worker::numa_memory_nodes(mode, t, 8, std::nullopt);
    REQUIRE(mem.size() == 8);
    CHECK(mem[0] == std::vector<int>{0});
    CHECK(mem[3] == std::vector<int>{1});
    CHECK(mem[7] == std::vector<int>{3});
  }
  // Socket: every node of the socket, the rank's own first.
  auto socket = worker::numa_memory_nodes(NumaBinding::kSocket, t, 8, std::nullopt);
  CHECK(socket[0] == std::vector<int>{0, 1});
  CHECK(socket[2] == std::vector<int>{1, 0});
  CHECK(socket[5] == std::vector<int>{2, 3});
  auto visible = worker::numa_memory_nodes(NumaBinding::kNode, t, 2, std::string("6,1"));
  CHECK(visible == std::vector<std::vector<int>>{{3}, {0}});
  CHECK_THROWS_AS(worker::numa_memory_nodes(NumaBinding::kNode, t, 1, std::string("8")),
                  ConfigError);
}

TEST_CASE("numa binding: this machine's own sysfs gives every local rank CPUs it has", "[unit]") {
  auto t = worker::read_cpu_topology("/sys");
  REQUIRE_FALSE(t.nodes.empty());
  for (auto mode : {NumaBinding::kNode, NumaBinding::kSocket, NumaBinding::kExclusive,
                    NumaBinding::kCoreComplex}) {
    auto cpus = worker::numa_cpus(mode, t, 2, std::nullopt);
    REQUIRE(cpus.size() == 2);
    for (const auto& c : cpus) CHECK_FALSE(c.empty());
  }
}

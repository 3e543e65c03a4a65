// --numa-binding's plan against a fake sysfs tree (2 sockets x 2 NUMA nodes
// of 4 CPUs each, an L3 per 2 CPUs, 8 NVIDIA GPUs two per node, plus a
// memory-only node and a non-GPU PCI device) and a fake /proc of the NVIDIA
// driver's GPU list, and on this machine's own.

#include "worker/numa_binding.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using ctorchrun::testing::TempDir;
using worker::NumaBinding;

namespace {

namespace fs = std::filesystem;

void put(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text << "\n";
}

std::string bus_of(int gpu) { return "0000:" + std::to_string(10 + gpu) + ":00.0"; }
std::string uuid_of(int gpu) {
  return "GPU-" + std::to_string(gpu) + "a1b2c3d-0000-1111-2222-33334444555" + std::to_string(gpu);
}

// Shows GPU `g` (bus 0x10 + g) in the fake driver list under `proc`.
void show_gpu(const fs::path& proc, int g, const std::string& model = "NVIDIA H100 80GB HBM3") {
  put(proc / "driver/nvidia/gpus" / bus_of(g) / "information",
      "Model: \t\t " + model + "\nIRQ:   \t\t 100\nGPU UUID: \t " + uuid_of(g) +
          "\nVideo BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
          "Bus Location: \t " +
          bus_of(g) + "\nDevice Minor: \t " + std::to_string(g));
}

// The fake trees under a fresh directory, removed with it. With
// `hyperthreads`, node N's CPUs 4N..4N+3 are two cores whose threads are
// numbered as x86 does (4N and 4N+2 on one core, 4N+1 and 4N+3 on the other).
struct FakeSysfs {
  explicit FakeSysfs(bool hyperthreads = false) {
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
        if (hyperthreads) {
          const int core = first + (cpu - first) % 2;
          put(c / "topology/thread_siblings_list",
              std::to_string(core) + "," + std::to_string(core + 2));
        } else {
          put(c / "topology/thread_siblings_list", std::to_string(cpu));
        }
      }
    }
    put(r / "devices/system/node/node4/cpulist", "");  // memory only
    // GPUs on buses 0x10..0x17 (made out of order on purpose), two per node.
    for (int g : {3, 0, 7, 1, 2, 6, 4, 5}) {
      const fs::path d = r / "bus/pci/devices" / bus_of(g);
      put(d / "vendor", "0x10de");
      put(d / "class", "0x030200");
      put(d / "numa_node", std::to_string(g / 2));
      show_gpu(proc, g);
    }
    const fs::path nic = r / "bus/pci/devices/0000:05:00.0";
    put(nic / "vendor", "0x15b3");
    put(nic / "class", "0x020000");
    put(nic / "numa_node", "3");
  }
  // A host that may use every CPU and node of the fake machine.
  worker::NumaHost host(std::optional<std::string> visible = std::nullopt) const {
    worker::NumaHost h;
    h.sysfs_root = root;
    h.proc_root = proc;
    h.cuda_visible_devices = std::move(visible);
    h.allowed_cpus = range(0, 15);
    h.allowed_memory_nodes = range(0, 4);
    h.mig_parent = nullptr;
    return h;
  }
  static std::vector<int> range(int lo, int hi) {
    std::vector<int> v;
    for (int i = lo; i <= hi; ++i) v.push_back(i);
    return v;
  }
  ctorchrun::testing::TempDir dir{"sysfs"};
  const std::string root = dir.file("sys");
  const std::string proc = dir.file("proc");
};

std::vector<int> range(int lo, int hi) { return FakeSysfs::range(lo, hi); }

std::vector<std::vector<int>> cpus(NumaBinding mode, int nproc, const worker::NumaHost& host) {
  return worker::plan_numa_binding(mode, nproc, host).cpus;
}

}  // namespace

TEST_CASE("numa binding: the topology is read from sysfs, cores from thread siblings", "[unit]") {
  FakeSysfs sys;
  auto t = worker::read_cpu_topology(sys.root);
  REQUIRE(t.nodes.size() == 4);  // the memory-only node has no CPUs
  CHECK(t.nodes[2].cpus == range(8, 11));
  CHECK(t.nodes[2].socket == 1);
  CHECK(t.core_complex.size() == 8);
  CHECK(t.cores.size() == 16);
  FakeSysfs ht(true);
  auto h = worker::read_cpu_topology(ht.root);
  REQUIRE(h.cores.size() == 8);
  CHECK(h.cores[0] == std::vector<int>{0, 2});
  CHECK(h.cores[1] == std::vector<int>{1, 3});
  CHECK(worker::parse_cpu_list("0-3,8,10-11") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK_THROWS_AS(worker::parse_cpu_list("3-1"), IoError);
  CHECK_THROWS_AS(worker::parse_cpu_list("x"), IoError);
  CHECK_THROWS_AS(worker::read_cpu_topology(sys.root + "/nonexistent"), IoError);
}

TEST_CASE("numa binding: each mode's CPUs per local rank, by GPU and CUDA_VISIBLE_DEVICES",
          "[unit]") {
  FakeSysfs sys;
  auto node = cpus(NumaBinding::kNode, 8, sys.host());
  REQUIRE(node.size() == 8);
  CHECK(node[0] == range(0, 3));
  CHECK(node[1] == range(0, 3));
  CHECK(node[5] == range(8, 11));
  CHECK(node[7] == range(12, 15));
  auto socket = cpus(NumaBinding::kSocket, 8, sys.host());
  CHECK(socket[0] == range(0, 7));
  CHECK(socket[6] == range(8, 15));
  auto exclusive = cpus(NumaBinding::kExclusive, 8, sys.host());
  CHECK(exclusive[0] == range(0, 1));
  CHECK(exclusive[1] == range(2, 3));
  CHECK(exclusive[7] == range(14, 15));
  // Three ranks on four cores: the lowest rank gets the extra one, as torch does.
  auto three = cpus(NumaBinding::kExclusive, 3, sys.host("0,1,0"));
  CHECK(three == std::vector<std::vector<int>>{{0, 1}, {2}, {3}});
  auto ccx = cpus(NumaBinding::kCoreComplex, 8, sys.host());
  CHECK(ccx[2] == range(4, 5));
  CHECK(ccx[3] == range(6, 7));
  // CUDA_VISIBLE_DEVICES picks the GPUs: local rank 0 on GPU 6 (node 3).
  auto visible = cpus(NumaBinding::kNode, 2, sys.host("6,1"));
  CHECK(visible[0] == range(12, 15));
  CHECK(visible[1] == range(0, 3));
  CHECK_THROWS_AS(cpus(NumaBinding::kNode, 3, sys.host("6,1")), ConfigError);
  CHECK_THROWS_AS(cpus(NumaBinding::kNode, 1, sys.host("8")), ConfigError);
  CHECK_THROWS_AS(cpus(NumaBinding::kNode, 1, sys.host("gpu0")), ConfigError);
  // Without GPUs, ranks are spread over the nodes in order.
  auto no_gpus = sys.host();
  no_gpus.proc_root = sys.dir.file("no-proc");
  auto spread = cpus(NumaBinding::kNode, 5, no_gpus);
  CHECK(spread[0] == range(0, 3));
  CHECK(spread[3] == range(12, 15));
  CHECK(spread[4] == range(0, 3));
  CHECK(worker::parse_numa_binding("core-complex") == NumaBinding::kCoreComplex);
  CHECK_FALSE(worker::parse_numa_binding("numa").has_value());
}

TEST_CASE("numa binding: each rank prefers its GPU's node's memory, socket mode its socket's nodes",
          "[unit]") {
  FakeSysfs sys;
  auto memory = [&](NumaBinding mode, int nproc, const worker::NumaHost& host) {
    return worker::plan_numa_binding(mode, nproc, host).memory;
  };
  for (auto mode : {NumaBinding::kNode, NumaBinding::kExclusive, NumaBinding::kCoreComplex}) {
    auto mem = memory(mode, 8, sys.host());
    REQUIRE(mem.size() == 8);
    CHECK(mem[0] == std::vector<int>{0});
    CHECK(mem[3] == std::vector<int>{1});
    CHECK(mem[7] == std::vector<int>{3});
  }
  // Socket: every node of the socket, the rank's own first.
  auto socket = memory(NumaBinding::kSocket, 8, sys.host());
  CHECK(socket[0] == std::vector<int>{0, 1});
  CHECK(socket[2] == std::vector<int>{1, 0});
  CHECK(socket[5] == std::vector<int>{2, 3});
  CHECK(memory(NumaBinding::kNode, 2, sys.host("6,1")) == std::vector<std::vector<int>>{{3}, {0}});
  CHECK_THROWS_AS(memory(NumaBinding::kNode, 1, sys.host("8")), ConfigError);
  // Only nodes whose memory the launcher may use (its cpuset's mems).
  auto mems = sys.host();
  mems.allowed_memory_nodes = std::vector<int>{1, 2};
  auto plan = worker::plan_numa_binding(NumaBinding::kSocket, 8, mems);
  CHECK(plan.memory[0] == std::vector<int>{1});
  CHECK(plan.memory[4] == std::vector<int>{2});
  CHECK(plan.memory[6] == std::vector<int>{2});
  plan = worker::plan_numa_binding(NumaBinding::kNode, 8, mems);
  CHECK(plan.memory[0].empty());
  CHECK(plan.cpus[0] == range(0, 3));
  CHECK(plan.memory[2] == std::vector<int>{1});
  CHECK_FALSE(plan.warnings.empty());
}

TEST_CASE(
    "numa binding: only the CPUs the launcher may run on are given, and a rank left with none "
    "runs unbound with a warning",
    "[unit]") {
  FakeSysfs sys;
  auto host = sys.host();
  host.allowed_cpus = std::vector<int>{1, 2, 3, 9};  // taskset -c 1-3,9
  auto plan = worker::plan_numa_binding(NumaBinding::kNode, 8, host);
  CHECK(plan.cpus[0] == range(1, 3));
  CHECK(plan.cpus[1] == range(1, 3));
  CHECK(plan.cpus[2].empty());  // node 1: none of 4-7
  CHECK(plan.memory[2].empty());
  CHECK(plan.cpus[4] == std::vector<int>{9});
  CHECK(plan.cpus[6].empty());
  REQUIRE(plan.warnings.size() == 4);  // local ranks 2, 3, 6 and 7
  CHECK(plan.warnings[0] ==
        "--numa-binding: local rank 2: none of the CPUs 4,5,6,7 of NUMA node 1 is allowed to "
        "this launcher (CPUs 1,2,3,9): left unbound");
  // Exclusive splits what is allowed; socket mode keeps the socket's allowed CPUs.
  auto exclusive = worker::plan_numa_binding(NumaBinding::kExclusive, 2, host).cpus;
  CHECK(exclusive == std::vector<std::vector<int>>{{1, 2}, {3}});
  CHECK(worker::plan_numa_binding(NumaBinding::kSocket, 1, host).cpus[0] == range(1, 3));
  CHECK(worker::plan_numa_binding(NumaBinding::kCoreComplex, 2, host).cpus ==
        std::vector<std::vector<int>>{{1}, {2, 3}});
  // Without GPUs, ranks go to the nodes the launcher has CPUs of.
  host.proc_root = sys.dir.file("no-proc");
  host.allowed_cpus = std::vector<int>{5, 13};
  CHECK(worker::plan_numa_binding(NumaBinding::kNode, 3, host).cpus ==
        std::vector<std::vector<int>>{{5}, {13}, {5}});
  // By default, this process's own affinity.
  const auto own = worker::allowed_cpus();
  REQUIRE_FALSE(own.empty());
  host.allowed_cpus.reset();
  for (const auto& c : worker::plan_numa_binding(NumaBinding::kNode, 2, host).cpus) {
    for (int cpu : c) CHECK(std::find(own.begin(), own.end(), cpu) != own.end());
  }
}

TEST_CASE(
    "numa binding: exclusive gives each rank whole physical cores, never a hyperthread of "
    "another rank's core",
    "[unit]") {
  FakeSysfs sys(true);
  // Two ranks on node 0 (GPUs 0 and 1): cores {0,2} and {1,3}.
  auto two = cpus(NumaBinding::kExclusive, 2, sys.host());
  CHECK(two == std::vector<std::vector<int>>{{0, 2}, {1, 3}});
  // Three ranks on two cores: one core each, in turn.
  auto three = cpus(NumaBinding::kExclusive, 3, sys.host("0,1,0"));
  CHECK(three == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {0, 2}});
  // One thread of a core not allowed: the other thread is still that core.
  auto host = sys.host();
  host.allowed_cpus = std::vector<int>{0, 1, 3};
  CHECK(cpus(NumaBinding::kExclusive, 2, host) == std::vector<std::vector<int>>{{0}, {1, 3}});
}

TEST_CASE(
    "numa binding: CUDA_VISIBLE_DEVICES by GPU UUID or MIG instance, over the GPUs the driver "
    "shows this process, in PCI order only when that is CUDA's",
    "[unit]") {
  FakeSysfs sys;
  // UUIDs (a unique prefix is enough, as for CUDA), in any order.
  auto by_uuid = cpus(NumaBinding::kNode, 2, sys.host(uuid_of(6) + "," + uuid_of(1).substr(0, 8)));
  CHECK(by_uuid == std::vector<std::vector<int>>{range(12, 15), range(0, 3)});
  // MIG instances: by the parent GPU NVML names, or unbound with one warning.
  auto mig = sys.host("MIG-aaaa,MIG-bbbb,MIG-GPU-" + uuid_of(2).substr(4) + "/1/0,MIG-cccc");
  mig.mig_parent = [](const std::string& uuid) -> std::optional<std::string> {
    if (uuid == "MIG-aaaa") return "00000000:16:00.0";  // NVML's form of GPU 6's bus
    return std::nullopt;
  };
  auto plan = worker::plan_numa_binding(NumaBinding::kNode, 4, mig);
  CHECK(plan.cpus == std::vector<std::vector<int>>{range(12, 15), {}, range(4, 7), {}});
  CHECK(plan.memory[1].empty());
  CHECK(plan.warnings.size() == 1);
  mig.mig_parent = nullptr;  // no NVML
  plan = worker::plan_numa_binding(NumaBinding::kNode, 4, mig);
  CHECK(plan.cpus[0].empty());
  CHECK(plan.warnings.size() == 1);
  // A UUID of no GPU shown here: unbound, not an error.
  plan = worker::plan_numa_binding(NumaBinding::kNode, 1, sys.host("GPU-ffff"));
  CHECK(plan.cpus[0].empty());
  CHECK(plan.warnings.size() == 1);

  // A container (or docker --gpus) shows only its own GPUs: device 0 is the
  // lowest bus of those, not the machine's first.
  TempDir container("proc");
  show_gpu(container.path, 5);
  show_gpu(container.path, 2);
  auto host = sys.host();
  host.proc_root = container.path;
  CHECK(cpus(NumaBinding::kNode, 2, host) ==
        std::vector<std::vector<int>>{range(4, 7), range(8, 11)});
  host.cuda_visible_devices = "1";
  CHECK(cpus(NumaBinding::kNode, 1, host) == std::vector<std::vector<int>>{range(8, 11)});
  host.cuda_visible_devices = "2";
  CHECK_THROWS_AS(cpus(NumaBinding::kNode, 1, host), ConfigError);

  // Models differ: CUDA's order (fastest first) is unknown, unless
  // CUDA_DEVICE_ORDER=PCI_BUS_ID; UUIDs need no order.
  TempDir mixed("proc");
  show_gpu(mixed.path, 0, "NVIDIA A100-SXM4-80GB");
  show_gpu(mixed.path, 2, "NVIDIA H100 80GB HBM3");
  host = sys.host();
  host.proc_root = mixed.path;
  plan = worker::plan_numa_binding(NumaBinding::kNode, 2, host);
  CHECK(plan.cpus == std::vector<std::vector<int>>{{}, {}});
  CHECK(plan.warnings.size() == 1);
  host.cuda_device_order = "PCI_BUS_ID";
  CHECK(cpus(NumaBinding::kNode, 2, host) ==
        std::vector<std::vector<int>>{range(0, 3), range(4, 7)});
  host.cuda_device_order.reset();
  host.cuda_visible_devices = uuid_of(2) + "," + uuid_of(0);
  CHECK(cpus(NumaBinding::kNode, 2, host) ==
        std::vector<std::vector<int>>{range(4, 7), range(0, 3)});
}

TEST_CASE("numa binding: this machine's own sysfs gives every local rank CPUs it has", "[unit]") {
  const auto own = worker::allowed_cpus();
  REQUIRE_FALSE(own.empty());
  for (auto mode : {NumaBinding::kNode, NumaBinding::kSocket, NumaBinding::kExclusive,
                    NumaBinding::kCoreComplex}) {
    worker::NumaHost host;
    host.cuda_visible_devices = std::nullopt;
    auto plan = worker::plan_numa_binding(mode, 2, host);
    REQUIRE(plan.cpus.size() == 2);
    for (const auto& c : plan.cpus) {
      CHECK_FALSE(c.empty());
      for (int cpu : c) CHECK(std::find(own.begin(), own.end(), cpu) != own.end());
    }
  }
}

TEST_CASE(
    "numa binding: under Slurm's ConstrainDevices a rank's device is the step's GPU that CUDA "
    "numbers from 0, not the machine's",
    "[unit]") {
  FakeSysfs sys;
  // A step given GPUs 6 and 1 (nodes 3 and 0): the cgroup lets it open
  // those two, CUDA numbers them 0 (bus 0x11, GPU 1) and 1 (GPU 6), and
  // Slurm says CUDA_VISIBLE_DEVICES=0,1.
  auto constrained = sys.host("0,1");
  constrained.slurm_gpus = "6,1";
  auto c = cpus(NumaBinding::kNode, 2, constrained);
  CHECK(c[0] == range(0, 3));    // GPU 1, node 0
  CHECK(c[1] == range(12, 15));  // GPU 6, node 3
  // Without the constraint Slurm repeats the step's own indices: as written.
  auto open = sys.host("6,1");
  open.slurm_gpus = "6,1";
  auto o = cpus(NumaBinding::kNode, 2, open);
  CHECK(o[0] == range(12, 15));
  CHECK(o[1] == range(0, 3));
  // The step's first GPUs are the machine's first: the same either way.
  auto first = sys.host("0,1");
  first.slurm_gpus = "0,1";
  CHECK(cpus(NumaBinding::kNode, 2, first)[1] == range(0, 3));
  // A minor the driver does not list, or a list that is no renumbering:
  // the machine's list, as without Slurm.
  auto unknown = sys.host("0");
  unknown.slurm_gpus = "42";
  CHECK(cpus(NumaBinding::kNode, 1, unknown)[0] == range(0, 3));
  auto shuffled = sys.host("1,0");
  shuffled.slurm_gpus = "6,7";
  CHECK(cpus(NumaBinding::kNode, 2, shuffled)[0] == range(0, 3));
}

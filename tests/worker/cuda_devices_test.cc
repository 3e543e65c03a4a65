// CUDA_VISIBLE_DEVICES entries -> the PCI bus ids of their GPUs, against a
// fake /proc/driver/nvidia/gpus.

#include "worker/cuda_devices.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.h"
#include "tests/support/temp_dir.h"

using namespace ctorchrun;
using ctorchrun::testing::TempDir;

namespace {

namespace fs = std::filesystem;

void show(const std::string& proc, const std::string& dir, const std::string& bus,
          const std::string& uuid, const std::string& model) {
  const fs::path file = fs::path(proc) / "driver/nvidia/gpus" / dir / "information";
  fs::create_directories(file.parent_path());
  std::ofstream(file) << "Model: \t\t " << model << "\nGPU UUID: \t " << uuid
                      << "\nBus Location: \t " << bus << "\n";
}

}  // namespace

TEST_CASE(
    "cuda devices: the driver's GPU list in bus order, and each local rank's entry of "
    "CUDA_VISIBLE_DEVICES as written",
    "[unit]") {
  TempDir proc("proc");
  show(proc.path, "0000:b3:00.0", "0000:b3:00.0", "GPU-bbbb0000-1111", "H100");
  show(proc.path, "0000:3b:00.0", "0000:3b:00.0", "GPU-aaaa0000-2222", "H100");
  auto gpus = worker::read_nvidia_gpus(proc.path);
  REQUIRE(gpus.size() == 2);
  CHECK(gpus[0].bus_id == "0000:3b:00.0");
  CHECK(gpus[0].uuid == "GPU-aaaa0000-2222");
  CHECK(gpus[0].model == "H100");
  CHECK(worker::read_nvidia_gpus(proc.file("missing")).empty());
  CHECK(worker::normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0");
  CHECK(worker::normalize_pci_bus_id("0000:3b:00.0") == "0000:3b:00.0");

  CHECK(worker::cuda_visible_entry(std::nullopt, 3) == "3");
  CHECK(worker::cuda_visible_entry(std::string("GPU-aaaa, MIG-1234"), 1) == "MIG-1234");
  CHECK_FALSE(worker::cuda_visible_entry(std::string("GPU-aaaa,MIG-1234"), 2).has_value());
  CHECK_FALSE(worker::cuda_visible_entry(std::string(""), 0).has_value());
  CHECK(worker::cuda_visible_entries("4, 2") == std::vector<std::string>{"4", "2"});

  auto map =
      worker::map_cuda_devices(3, gpus, std::string("1,GPU-aaaa,GPU-"), std::nullopt, nullptr);
  REQUIRE(map.bus_ids.size() == 3);
  CHECK(map.bus_ids[0] == "0000:b3:00.0");
  CHECK(map.bus_ids[1] == "0000:3b:00.0");
  CHECK_FALSE(map.bus_ids[2].has_value());  // "GPU-" matches both: CUDA takes neither
  CHECK(map.warnings.size() == 1);
  CHECK_THROWS_AS(worker::map_cuda_devices(1, gpus, std::string("2"), std::nullopt, nullptr),
                  ConfigError);
  CHECK_THROWS_AS(worker::map_cuda_devices(2, gpus, std::string("0"), std::nullopt, nullptr),
                  ConfigError);
  CHECK_THROWS_AS(worker::map_cuda_devices(1, gpus, std::string("cuda:0"), std::nullopt, nullptr),
                  ConfigError);
  // Without NVML (this machine has none) a MIG instance is not known.
  CHECK_FALSE(worker::nvml_mig_parent_bus_id("MIG-00000000-0000-0000-0000-000000000000"));
}

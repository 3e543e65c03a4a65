#include "worker/cuda_devices.h"

#include <dirent.h>
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <sstream>

#include "common/error.h"
#include "worker/proc_file.h"

namespace ctorchrun::worker {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 9 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

// The value of "Key:   value" in an information file, trimmed.
std::string field(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (starts_with(line, key + ":")) return trim(line.substr(key.size() + 1));
  }
  return "";
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::string normalize_pci_bus_id(const std::string& bus_id) {
  std::string id = lower(trim(bus_id));
  const auto colon = id.find(':');
  // A domain of 8 digits (NVML) -> 4 (sysfs): the upper ones are zero.
  if (colon != std::string::npos && colon > 4 && id.find(':', colon + 1) != std::string::npos) {
    id = id.substr(colon - 4);
  }
  return id;
}

std::vector<NvidiaGpu> read_nvidia_gpus(const std::string& proc_root) {
  std::vector<NvidiaGpu> gpus;
  const std::string dir = proc_root + "/driver/nvidia/gpus";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return gpus;
  std::vector<std::string> names;
  for (dirent* e = ::readdir(d); e != nullptr && names.size() < 4096; e = ::readdir(d)) {
    if (e->d_name[0] != '.') names.emplace_back(e->d_name);
  }
  ::closedir(d);
  for (const auto& name : names) {
    const std::string info = read_proc_file(dir + "/" + name + "/information");
    NvidiaGpu gpu;
    const std::string location = field(info, "Bus Location");
    gpu.bus_id = normalize_pci_bus_id(location.empty() ? name : location);
    gpu.uuid = field(info, "GPU UUID");
    gpu.model = field(info, "Model");
    const std::string minor = field(info, "Device Minor");
    if (all_digits(minor) && minor.size() <= 6) gpu.minor = std::stoi(minor);
    gpus.push_back(std::move(gpu));
  }
  std::sort(gpus.begin(), gpus.end(),
            [](const auto& a, const auto& b) { return a.bus_id < b.bus_id; });
  return gpus;
}

std::vector<NvidiaGpu> gpus_cuda_sees(const std::vector<NvidiaGpu>& gpus,
                                      const std::optional<std::string>& slurm_gpus,
                                      const std::optional<std::string>& visible_devices) {
  if (!slurm_gpus || !visible_devices) return gpus;
  const auto step = cuda_visible_entries(*slurm_gpus);
  const auto visible = cuda_visible_entries(*visible_devices);
  if (step.empty() || step == visible || visible.size() > step.size()) return gpus;
  for (size_t i = 0; i < visible.size(); ++i) {
    if (visible[i] != std::to_string(i)) return gpus;  // not CUDA's renumbering
  }
  std::vector<NvidiaGpu> seen;
  for (const auto& minor : step) {
    if (!all_digits(minor) || minor.size() > 6) return gpus;
    auto it = std::find_if(gpus.begin(), gpus.end(),
                           [&](const NvidiaGpu& g) { return g.minor == std::stoi(minor); });
    if (it == gpus.end()) return gpus;
    seen.push_back(*it);
  }
  // CUDA numbers what it can open as it numbers all: in bus order here.
  std::sort(seen.begin(), seen.end(),
            [](const auto& a, const auto& b) { return a.bus_id < b.bus_id; });
  return seen;
}

std::vector<std::string> cuda_visible_entries(const std::string& value) {
  std::vector<std::string> out;
  if (trim(value).empty()) return out;
  std::stringstream in(value);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(trim(item));
  return out;
}

std::optional<std::string> cuda_visible_entry(const std::optional<std::string>& visible_devices,
                                              int local_rank) {
  if (local_rank < 0) return std::nullopt;
  if (!visible_devices) return std::to_string(local_rank);
  const auto entries = cuda_visible_entries(*visible_devices);
  if (static_cast<size_t>(local_rank) >= entries.size()) return std::nullopt;
  return entries[static_cast<size_t>(local_rank)];
}

namespace {

// NVML's types and entry points used here (nvml.h, stable ABI).
using NvmlDevice = void*;
struct NvmlPciInfo {
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
using NvmlInit = int (*)();
using NvmlShutdown = int (*)();
using NvmlByUuid = int (*)(const char*, NvmlDevice*);
using NvmlParent = int (*)(NvmlDevice, NvmlDevice*);
using NvmlPci = int (*)(NvmlDevice, NvmlPciInfo*);

}  // namespace

std::optional<std::string> nvml_mig_parent_bus_id(const std::string& mig_uuid) {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return std::nullopt;
  auto sym = [lib](const char* name) { return ::dlsym(lib, name); };
  auto init = reinterpret_cast<NvmlInit>(sym("nvmlInit_v2"));
  auto shutdown = reinterpret_cast<NvmlShutdown>(sym("nvmlShutdown"));
  auto by_uuid = reinterpret_cast<NvmlByUuid>(sym("nvmlDeviceGetHandleByUUID"));
  auto parent = reinterpret_cast<NvmlParent>(sym("nvmlDeviceGetDeviceHandleFromMigDeviceHandle"));
  auto pci = reinterpret_cast<NvmlPci>(sym("nvmlDeviceGetPciInfo_v3"));
  std::optional<std::string> out;
  if (init != nullptr && shutdown != nullptr && by_uuid != nullptr && parent != nullptr &&
      pci != nullptr && init() == 0) {
    NvmlDevice mig = nullptr, gpu = nullptr;
    NvmlPciInfo info{};
    if (by_uuid(mig_uuid.c_str(), &mig) == 0 && parent(mig, &gpu) == 0 && pci(gpu, &info) == 0) {
      info.bus_id[sizeof info.bus_id - 1] = '\0';
      out = normalize_pci_bus_id(info.bus_id);
    }
    shutdown();
  }
  ::dlclose(lib);
  return out;
}

CudaDeviceMap map_cuda_devices(int nproc, const std::vector<NvidiaGpu>& gpus,
                               const std::optional<std::string>& visible_devices,
                               const std::optional<std::string>& device_order,
                               const MigParentLookup& mig_parent) {
  CudaDeviceMap map;
  map.bus_ids.resize(static_cast<size_t>(std::max(nproc, 0)));
  const std::string shown = visible_devices ? "CUDA_VISIBLE_DEVICES='" + *visible_devices + "'"
                                            : std::string("CUDA_VISIBLE_DEVICES unset");
  const bool same_model = std::all_of(gpus.begin(), gpus.end(),
                                      [&](const auto& g) { return g.model == gpus.front().model; });
  const bool bus_order = same_model || device_order == std::string("PCI_BUS_ID");
  bool order_warned = false, mig_warned = false;
  auto by_uuid = [&](const std::string& prefix) -> const NvidiaGpu* {
    const NvidiaGpu* found = nullptr;
    for (const auto& g : gpus) {
      if (g.uuid.empty() || !starts_with(lower(g.uuid), lower(prefix))) continue;
      if (found != nullptr) return nullptr;  // ambiguous: CUDA takes neither
      found = &g;
    }
    return found;
  };
  for (int r = 0; r < nproc; ++r) {
    auto& out = map.bus_ids[static_cast<size_t>(r)];
    const auto entry = cuda_visible_entry(visible_devices, r);
    const std::string rank = "--numa-binding: local rank " + std::to_string(r);
    if (!entry) throw ConfigError(rank + " has no GPU in " + shown);
    if (all_digits(*entry)) {
      const auto i = static_cast<size_t>(std::stoi(*entry));
      if (i >= gpus.size()) {
        throw ConfigError(rank + " would use GPU " + *entry + " (" + shown +
                          "), but this process sees " + std::to_string(gpus.size()));
      }
      if (!bus_order) {
        if (!order_warned) {
          map.warnings.push_back(
              "--numa-binding: the GPUs are of different models and CUDA_DEVICE_ORDER is not "
              "PCI_BUS_ID, so CUDA's device order is unknown: ranks that name a GPU by index "
              "are left unbound");
          order_warned = true;
        }
        continue;
      }
      out = gpus[i].bus_id;
    } else if (starts_with(*entry, "GPU-") || starts_with(*entry, "MIG-GPU-")) {
      // GPU-<uuid>, or MIG-GPU-<uuid>/<gi>/<ci>: an instance of that GPU.
      const std::string uuid =
          starts_with(*entry, "MIG-") ? entry->substr(4, entry->find('/') - 4) : *entry;
      if (const NvidiaGpu* g = by_uuid(uuid)) {
        out = g->bus_id;
      } else {
        map.warnings.push_back(rank + ": " + uuid +
                               " is not one GPU of the driver's list: the rank is left unbound");
      }
    } else if (starts_with(*entry, "MIG-")) {
      std::optional<std::string> bus = mig_parent ? mig_parent(*entry) : std::nullopt;
      if (bus) {
        out = normalize_pci_bus_id(*bus);
      } else if (!mig_warned) {
        map.warnings.push_back(
            "--numa-binding: NVML (libnvidia-ml.so.1) cannot tell the GPU of MIG instance " +
            *entry + ": ranks on such MIG instances are left unbound");
        mig_warned = true;
      }
    } else {
      throw ConfigError(rank + " would use GPU '" + *entry + "' (" + shown +
                        "), which is not an index, GPU-<uuid> or MIG-<uuid>");
    }
  }
  return map;
}

}  // namespace ctorchrun::worker

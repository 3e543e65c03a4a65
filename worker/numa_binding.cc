#include "worker/numa_binding.h"

#include <dirent.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/error.h"

namespace ctorchrun::worker {

namespace {

std::optional<std::string> read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  for (dirent* e = ::readdir(d); e != nullptr && out.size() < 100'000; e = ::readdir(d)) {
    out.emplace_back(e->d_name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 9 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int int_of(const std::optional<std::string>& text, int fallback) {
  if (!text) return fallback;
  std::string t = *text;
  const bool negative = !t.empty() && t[0] == '-';
  if (negative) t = t.substr(1);
  if (!all_digits(t)) return fallback;
  return negative ? -std::stoi(t) : std::stoi(t);
}

}  // namespace

std::optional<NumaBinding> parse_numa_binding(const std::string& text) {
  if (text == "node") return NumaBinding::kNode;
  if (text == "socket") return NumaBinding::kSocket;
  if (text == "exclusive") return NumaBinding::kExclusive;
  if (text == "core-complex") return NumaBinding::kCoreComplex;
  return std::nullopt;
}

std::vector<int> parse_cpu_list(const std::string& text) {
  std::set<int> cpus;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (part.empty()) continue;
    const auto dash = part.find('-');
    const std::string lo = part.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    if (!all_digits(lo) || !all_digits(hi) || std::stoi(hi) < std::stoi(lo) ||
        std::stoi(hi) - std::stoi(lo) > 65536) {
      throw IoError("unreadable CPU list '" + text + "'");
    }
    for (int c = std::stoi(lo); c <= std::stoi(hi); ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

CpuTopology read_cpu_topology(const std::string& sysfs_root) {
  CpuTopology t;
  const std::string node_dir = sysfs_root + "/devices/system/node";
  for (const auto& name : entries(node_dir)) {
    if (name.rfind("node", 0) != 0 || !all_digits(name.substr(4))) continue;
    auto list = read_line(node_dir + "/" + name + "/cpulist");
    if (!list) continue;
    CpuTopology::Node n;
    n.id = std::stoi(name.substr(4));
    n.cpus = parse_cpu_list(*list);
    if (n.cpus.empty()) continue;  // a memory-only node
    n.socket = int_of(read_line(sysfs_root + "/devices/system/cpu/cpu" +
                                std::to_string(n.cpus.front()) + "/topology/physical_package_id"),
                      0);
    t.nodes.push_back(std::move(n));
  }
  if (t.nodes.empty()) {
    throw IoError("--numa-binding: no NUMA node with CPUs under " + node_dir);
  }
  std::sort(t.nodes.begin(), t.nodes.end(),
            [](const auto& a, const auto& b) { return a.id < b.id; });
  std::set<std::vector<int>> groups;
  for (const auto& n : t.nodes) {
    for (int c : n.cpus) {
      auto shared = read_line(sysfs_root + "/devices/system/cpu/cpu" + std::to_string(c) +
                              "/cache/index3/shared_cpu_list");
      if (!shared) continue;
      try {
        groups.insert(parse_cpu_list(*shared));
      } catch (const IoError&) {
      }
    }
  }
  t.core_complex.assign(groups.begin(), groups.end());
  const std::string pci = sysfs_root + "/bus/pci/devices";
  for (const auto& dev : entries(pci)) {  // names are bus addresses: sorted is bus order
    if (dev == "." || dev == "..") continue;
    const auto vendor = read_line(pci + "/" + dev + "/vendor");
    const auto klass = read_line(pci + "/" + dev + "/class");
    if (!vendor || !klass || *vendor != "0x10de" || klass->rfind("0x03", 0) != 0) continue;
    t.gpu_nodes.push_back(std::max(int_of(read_line(pci + "/" + dev + "/numa_node"), 0), 0));
  }
  return t;
}

namespace {

// Each local rank's NUMA node, as an index into topology.nodes.
std::vector<size_t> rank_nodes(const CpuTopology& topology, int nproc,
                               const std::optional<std::string>& cuda_visible_devices) {
  std::vector<size_t> node_of(static_cast<size_t>(nproc), 0);
  std::vector<int> visible;
  if (cuda_visible_devices) {
    std::stringstream in(*cuda_visible_devices);
    std::string item;
    while (std::getline(in, item, ',')) {
      if (!all_digits(item)) {
        throw ConfigError("--numa-binding: CUDA_VISIBLE_DEVICES='" + *cuda_visible_devices +
                          "' is not a list of GPU indexes");
      }
      visible.push_back(std::stoi(item));
    }
  }
  for (int r = 0; r < nproc; ++r) {
    const auto i = static_cast<size_t>(r);
    if (topology.gpu_nodes.empty()) {
      node_of[i] = i % topology.nodes.size();
      continue;
    }
    int gpu = r;
    if (cuda_visible_devices) {
      if (i >= visible.size()) {
        throw ConfigError("--numa-binding: local rank " + std::to_string(r) +
                          " has no GPU in CUDA_VISIBLE_DEVICES='" + *cuda_visible_devices + "'");
      }
      gpu = visible[i];
    }
    if (gpu < 0 || gpu >= static_cast<int>(topology.gpu_nodes.size())) {
      throw ConfigError("--numa-binding: local rank " + std::to_string(r) + " would use GPU " +
                        std::to_string(gpu) + ", but this host has " +
                        std::to_string(topology.gpu_nodes.size()));
    }
    const int node = topology.gpu_nodes[static_cast<size_t>(gpu)];
    auto it = std::find_if(topology.nodes.begin(), topology.nodes.end(),
                           [&](const auto& n) { return n.id == node; });
    node_of[i] = it == topology.nodes.end() ? 0 : static_cast<size_t>(it - topology.nodes.begin());
  }
  return node_of;
}

}  // namespace

std::vector<std::vector<int>> numa_cpus(NumaBinding mode, const CpuTopology& topology, int nproc,
                                        const std::optional<std::string>& cuda_visible_devices) {
  const std::vector<size_t> node_of = rank_nodes(topology, nproc, cuda_visible_devices);
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    const auto i = static_cast<size_t>(r);
    const auto& node = topology.nodes[node_of[i]];
    // This rank's place among the ranks on its node.
    size_t k = 0, m = 0;
    for (size_t j = 0; j < out.size(); ++j) {
      if (node_of[j] != node_of[i]) continue;
      if (j < i) ++k;
      ++m;
    }
    switch (mode) {
      case NumaBinding::kNode:
        out[i] = node.cpus;
        break;
      case NumaBinding::kSocket:
        for (const auto& n : topology.nodes) {
          if (n.socket == node.socket) out[i].insert(out[i].end(), n.cpus.begin(), n.cpus.end());
        }
        std::sort(out[i].begin(), out[i].end());
        break;
      case NumaBinding::kExclusive: {
        const size_t len = node.cpus.size();
        if (m > len) {
          out[i] = {node.cpus[k % len]};  // more ranks than CPUs: one each, in turn
        } else {
          out[i].assign(node.cpus.begin() + static_cast<long>(k * len / m),
                        node.cpus.begin() + static_cast<long>((k + 1) * len / m));
        }
        break;
      }
      case NumaBinding::kCoreComplex: {
        std::vector<std::vector<int>> local;
        for (const auto& g : topology.core_complex) {
          if (std::includes(node.cpus.begin(), node.cpus.end(), g.begin(), g.end())) {
            local.push_back(g);
          }
        }
        out[i] = local.empty() ? node.cpus : local[k % local.size()];
        break;
      }
    }
  }
  return out;
}

std::vector<std::vector<int>> numa_memory_nodes(
    NumaBinding mode, const CpuTopology& topology, int nproc,
    const std::optional<std::string>& cuda_visible_devices) {
  const std::vector<size_t> node_of = rank_nodes(topology, nproc, cuda_visible_devices);
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  for (size_t i = 0; i < out.size(); ++i) {
    const auto& node = topology.nodes[node_of[i]];
    if (mode != NumaBinding::kSocket) {
      out[i] = {node.id};
      continue;
    }
    out[i] = {node.id};
    for (const auto& n : topology.nodes) {
      if (n.socket == node.socket && n.id != node.id) out[i].push_back(n.id);
    }
  }
  return out;
}

std::string memory_policy_unavailable() {
  int mode = 0;
  if (::syscall(SYS_get_mempolicy, &mode, nullptr, 0UL, nullptr, 0UL) == 0) return "";
  return std::string("get_mempolicy: ") + std::strerror(errno);
}

}  // namespace ctorchrun::worker

#include "worker/numa_binding.h"

#include <dirent.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
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
  // A CPU's group from a list file of it, or nullopt when unreadable.
  auto group = [&](int cpu, const char* file) -> std::optional<std::vector<int>> {
    auto text = read_line(sysfs_root + "/devices/system/cpu/cpu" + std::to_string(cpu) + file);
    if (!text) return std::nullopt;
    try {
      auto cpus = parse_cpu_list(*text);
      if (std::find(cpus.begin(), cpus.end(), cpu) == cpus.end()) return std::nullopt;
      return cpus;
    } catch (const IoError&) {
      return std::nullopt;
    }
  };
  std::set<std::vector<int>> complexes, cores;
  for (const auto& n : t.nodes) {
    for (int c : n.cpus) {
      if (auto g = group(c, "/cache/index3/shared_cpu_list")) complexes.insert(*g);
      cores.insert(group(c, "/topology/thread_siblings_list").value_or(std::vector<int>{c}));
    }
  }
  t.core_complex.assign(complexes.begin(), complexes.end());
  t.cores.assign(cores.begin(), cores.end());
  return t;
}

void restrict_cpus(CpuTopology* topology, const std::vector<int>& allowed) {
  auto cut = [&](std::vector<int>* cpus) {
    std::vector<int> kept;
    std::set_intersection(cpus->begin(), cpus->end(), allowed.begin(), allowed.end(),
                          std::back_inserter(kept));
    *cpus = std::move(kept);
  };
  auto cut_groups = [&](std::vector<std::vector<int>>* groups) {
    for (auto& g : *groups) cut(&g);
    groups->erase(
        std::remove_if(groups->begin(), groups->end(), [](const auto& g) { return g.empty(); }),
        groups->end());
  };
  for (auto& n : topology->nodes) cut(&n.cpus);
  cut_groups(&topology->core_complex);
  cut_groups(&topology->cores);
}

namespace {

const CpuTopology::Node* find_node(const CpuTopology& topology, const std::optional<int>& id) {
  if (!id) return nullptr;
  for (const auto& n : topology.nodes) {
    if (n.id == *id) return &n;
  }
  return nullptr;
}

bool contains(const std::vector<int>& outer, const std::vector<int>& inner) {
  return std::includes(outer.begin(), outer.end(), inner.begin(), inner.end());
}

}  // namespace

std::vector<std::vector<int>> numa_cpus(NumaBinding mode, const CpuTopology& topology,
                                        const RankNodes& ranks) {
  std::vector<std::vector<int>> out(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    const CpuTopology::Node* node = find_node(topology, ranks[i]);
    if (node == nullptr || node->cpus.empty()) continue;
    // This rank's place among the ranks on its node.
    size_t k = 0, m = 0;
    for (size_t j = 0; j < ranks.size(); ++j) {
      if (ranks[j] != ranks[i]) continue;
      if (j < i) ++k;
      ++m;
    }
    switch (mode) {
      case NumaBinding::kNode:
        out[i] = node->cpus;
        break;
      case NumaBinding::kSocket:
        for (const auto& n : topology.nodes) {
          if (n.socket == node->socket) out[i].insert(out[i].end(), n.cpus.begin(), n.cpus.end());
        }
        std::sort(out[i].begin(), out[i].end());
        break;
      case NumaBinding::kExclusive: {
        // Whole physical cores: two ranks never share a core's hyperthreads.
        std::vector<std::vector<int>> cores;
        std::set<int> covered;
        for (const auto& core : topology.cores) {
          if (contains(node->cpus, core)) {
            cores.push_back(core);
            covered.insert(core.begin(), core.end());
          }
        }
        for (int c : node->cpus) {  // a CPU no core lists: a core of its own
          if (covered.count(c) == 0) cores.push_back({c});
        }
        std::sort(cores.begin(), cores.end());
        const size_t n = cores.size();
        size_t first = k % n, last = first + 1;  // more ranks than cores: one each, in turn
        if (m <= n) {
          const size_t per = n / m, extra = n % m;  // the lowest ranks get one more
          first = k * per + std::min(k, extra);
          last = first + per + (k < extra ? 1 : 0);
        }
        for (size_t c = first; c < last; ++c) {
          out[i].insert(out[i].end(), cores[c].begin(), cores[c].end());
        }
        std::sort(out[i].begin(), out[i].end());
        break;
      }
      case NumaBinding::kCoreComplex: {
        std::vector<std::vector<int>> local;
        for (const auto& g : topology.core_complex) {
          if (contains(node->cpus, g)) local.push_back(g);
        }
        out[i] = local.empty() ? node->cpus : local[k % local.size()];
        break;
      }
    }
  }
  return out;
}

std::vector<std::vector<int>> numa_memory_nodes(NumaBinding mode, const CpuTopology& topology,
                                                const RankNodes& ranks) {
  std::vector<std::vector<int>> out(ranks.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const CpuTopology::Node* node = find_node(topology, ranks[i]);
    if (node == nullptr) continue;
    out[i] = {node->id};
    if (mode != NumaBinding::kSocket) continue;
    for (const auto& n : topology.nodes) {
      if (n.socket == node->socket && n.id != node->id) out[i].push_back(n.id);
    }
  }
  return out;
}

namespace {

std::string text_of(const std::vector<int>& v) {
  std::string list;
  for (int x : v) list += (list.empty() ? "" : ",") + std::to_string(x);
  return list;
}

// Each local rank's NUMA node, by its GPU (or spread without GPUs).
RankNodes rank_nodes(const CpuTopology& topology, int nproc, const NumaHost& host,
                     std::vector<std::string>* warnings) {
  RankNodes ranks(static_cast<size_t>(std::max(nproc, 0)));
  const auto gpus =
      gpus_cuda_sees(read_nvidia_gpus(host.proc_root), host.slurm_gpus, host.cuda_visible_devices);
  if (gpus.empty()) {
    std::vector<int> with_cpus;
    for (const auto& n : topology.nodes) {
      if (!n.cpus.empty()) with_cpus.push_back(n.id);
    }
    for (size_t i = 0; i < ranks.size() && !with_cpus.empty(); ++i) {
      ranks[i] = with_cpus[i % with_cpus.size()];
    }
    return ranks;
  }
  auto map = map_cuda_devices(nproc, gpus, host.cuda_visible_devices, host.cuda_device_order,
                              host.mig_parent);
  warnings->insert(warnings->end(), map.warnings.begin(), map.warnings.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!map.bus_ids[i]) continue;
    const auto node =
        read_line(host.sysfs_root + "/bus/pci/devices/" + *map.bus_ids[i] + "/numa_node");
    if (!node) {
      warnings->push_back("--numa-binding: local rank " + std::to_string(i) + ": GPU " +
                          *map.bus_ids[i] + " has no NUMA node in sysfs: left unbound");
      continue;
    }
    // -1: the machine does not say (one node); a node without CPUs: the first.
    const int id = int_of(node, -1);
    const auto* n = find_node(topology, id);
    ranks[i] = n != nullptr ? id : topology.nodes.front().id;
  }
  return ranks;
}

}  // namespace

NumaPlan plan_numa_binding(NumaBinding mode, int nproc, const NumaHost& host) {
  NumaPlan plan;
  const CpuTopology whole = read_cpu_topology(host.sysfs_root);
  CpuTopology topology = whole;
  const std::vector<int> cpus_allowed = host.allowed_cpus ? *host.allowed_cpus : allowed_cpus();
  if (!cpus_allowed.empty()) restrict_cpus(&topology, cpus_allowed);
  const RankNodes ranks = rank_nodes(topology, nproc, host, &plan.warnings);
  plan.cpus = numa_cpus(mode, topology, ranks);
  plan.memory = numa_memory_nodes(mode, topology, ranks);
  const std::vector<int> mems_allowed =
      host.allowed_memory_nodes ? *host.allowed_memory_nodes : allowed_memory_nodes();
  for (size_t i = 0; i < plan.cpus.size(); ++i) {
    const std::string rank = "--numa-binding: local rank " + std::to_string(i);
    if (plan.cpus[i].empty()) {
      if (const auto* n = find_node(whole, ranks[i])) {
        plan.warnings.push_back(rank + ": none of the CPUs " + text_of(n->cpus) + " of NUMA node " +
                                std::to_string(n->id) + " is allowed to this launcher (CPUs " +
                                text_of(cpus_allowed) + "): left unbound");
      }
      plan.memory[i].clear();
      continue;
    }
    if (mems_allowed.empty()) continue;
    auto& mem = plan.memory[i];
    const std::vector<int> wanted = mem;
    mem.erase(std::remove_if(mem.begin(), mem.end(),
                             [&](int n) {
                               return std::find(mems_allowed.begin(), mems_allowed.end(), n) ==
                                      mems_allowed.end();
                             }),
              mem.end());
    if (mem.empty() && !wanted.empty()) {
      plan.warnings.push_back(rank + ": the memory of NUMA node " + text_of(wanted) +
                              " is not allowed to this launcher (nodes " + text_of(mems_allowed) +
                              "): no memory policy");
    }
  }
  return plan;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

std::vector<int> allowed_memory_nodes() {
  constexpr size_t kWords = 1024 / (8 * sizeof(unsigned long));
  constexpr unsigned long kBits = 8 * sizeof(unsigned long);
  constexpr unsigned long kMemsAllowed = 4;  // MPOL_F_MEMS_ALLOWED
  unsigned long mask[kWords] = {};
  int mode = 0;
  std::vector<int> out;
  if (::syscall(SYS_get_mempolicy, &mode, mask, kWords * kBits, nullptr, kMemsAllowed) != 0) {
    return out;
  }
  for (size_t n = 0; n < kWords * kBits; ++n) {
    if (mask[n / kBits] & (1UL << (n % kBits))) out.push_back(static_cast<int>(n));
  }
  return out;
}

std::string memory_policy_unavailable() {
  int mode = 0;
  if (::syscall(SYS_get_mempolicy, &mode, nullptr, 0UL, nullptr, 0UL) == 0) return "";
  return std::string("get_mempolicy: ") + std::strerror(errno);
}

}  // namespace ctorchrun::worker

#pragma once

// --numa-binding (torchrun 2.9+): each local rank runs on CPUs near its GPU.
// The topology is read from sysfs (no CUDA in the launcher):
//  - NUMA nodes: <sysfs>/devices/system/node/node<N>/cpulist;
//  - a node's socket: physical_package_id of its first CPU
//    (<sysfs>/devices/system/cpu/cpu<C>/topology/physical_package_id);
//  - core complexes: CPUs sharing a last-level (L3) cache
//    (<sysfs>/devices/system/cpu/cpu<C>/cache/index3/shared_cpu_list);
//  - GPUs: PCI display devices of NVIDIA's vendor id (0x10de, class 0x03xxxx)
//    under <sysfs>/bus/pci/devices, in PCI bus order, each with its numa_node.
// Local rank i has the i-th GPU of CUDA_VISIBLE_DEVICES (a list of indexes
// into that bus order) when it is set, else the i-th GPU; its NUMA node is
// that GPU's. Without GPUs (ours, documented), local ranks are spread over
// the NUMA nodes in order (rank i on node i mod N).
// Modes: node (every CPU of the rank's node), socket (every CPU of the
// node's socket), exclusive (the node's CPUs split into disjoint runs among
// the ranks on that node), core-complex (one L3 group of the node per rank,
// in turn). The CPU affinity is set with sched_setaffinity in the worker
// before exec, and the memory policy prefers the rank's node (set_mempolicy
// MPOL_PREFERRED, numactl's --preferred, as torchrun does); in socket mode it
// prefers every node of the socket (MPOL_PREFERRED_MANY, --preferred-many,
// falling back to the rank's node on kernels before 5.15). A preference, not
// a bind: allocations spill to other nodes when the preferred ones are full.

#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::worker {

enum class NumaBinding { kNode, kSocket, kExclusive, kCoreComplex };

// "node", "socket", "exclusive", "core-complex"; nullopt otherwise.
std::optional<NumaBinding> parse_numa_binding(const std::string& text);

struct CpuTopology {
  struct Node {
    int id = 0;
    std::vector<int> cpus;  // ascending
    int socket = 0;
  };
  std::vector<Node> nodes;                     // ascending id
  std::vector<std::vector<int>> core_complex;  // L3 groups, each ascending
  std::vector<int> gpu_nodes;                  // NUMA node of each GPU, PCI bus order
};

// Reads the topology under `sysfs_root` ("/sys"). Throws IoError when no
// NUMA node with CPUs is found. Unreadable details degrade: a node's socket
// 0, no core complexes, a GPU whose node is unknown on node 0.
CpuTopology read_cpu_topology(const std::string& sysfs_root);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}. Throws IoError on malformed text.
std::vector<int> parse_cpu_list(const std::string& text);

// The CPUs of each of `nproc` local ranks. `cuda_visible_devices`: the
// variable's value when set. Throws ConfigError when a rank's GPU index is
// not a GPU of the topology.
std::vector<std::vector<int>> numa_cpus(NumaBinding mode, const CpuTopology& topology, int nproc,
                                        const std::optional<std::string>& cuda_visible_devices);

// The NUMA node ids whose memory each of `nproc` local ranks prefers: its
// node, or in socket mode every node of its socket (its own first). Same
// arguments and errors as numa_cpus.
std::vector<std::vector<int>> numa_memory_nodes(
    NumaBinding mode, const CpuTopology& topology, int nproc,
    const std::optional<std::string>& cuda_visible_devices);

// Whether this process may set a memory policy (get_mempolicy answers;
// seccomp profiles without CAP_SYS_NICE refuse it): empty when it may, else
// the reason.
std::string memory_policy_unavailable();

}  // namespace ctorchrun::worker

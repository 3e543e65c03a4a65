#pragma once

// --numa-binding (torchrun 2.9+): each local rank runs on CPUs near its GPU.
// The topology is read from sysfs (no CUDA in the launcher):
//  - NUMA nodes: <sysfs>/devices/system/node/node<N>/cpulist;
//  - a node's socket: physical_package_id of its first CPU
//    (<sysfs>/devices/system/cpu/cpu<C>/topology/physical_package_id);
//  - physical cores: CPUs that are hyperthreads of one core
//    (<sysfs>/devices/system/cpu/cpu<C>/topology/thread_siblings_list);
//  - core complexes: CPUs sharing a last-level (L3) cache
//    (<sysfs>/devices/system/cpu/cpu<C>/cache/index3/shared_cpu_list);
//  - a GPU's node: <sysfs>/bus/pci/devices/<bus id>/numa_node.
// Local rank i uses CUDA device i; which GPU that is comes from
// worker/cuda_devices.h (the GPUs the driver shows this process, and
// CUDA_VISIBLE_DEVICES by index, UUID or MIG instance); its NUMA node is
// that GPU's. Without GPUs (ours, documented), local ranks are spread over
// the NUMA nodes in order (rank i on node i mod N).
// Only the CPUs the launcher itself may run on count (its sched_getaffinity:
// taskset, Slurm's --cpu-bind, a container's cpuset): each node's CPUs are
// cut to those first. A rank left with no CPU, or whose GPU cannot be told,
// runs unbound (a warning), never fails to start.
// Modes: node (every allowed CPU of the rank's node), socket (of every node
// of the node's socket), exclusive (the node's physical cores split into
// disjoint runs among the ranks on that node, whole cores each, the lowest
// ranks one more when they do not divide evenly, as torch does), core-complex
// (one L3 group of the node per rank, in turn). The CPU affinity is set with
// sched_setaffinity in the worker before exec, and the memory policy prefers
// the rank's node (set_mempolicy MPOL_PREFERRED, numactl's --preferred, as
// torchrun does); in socket mode it prefers every node of the socket
// (MPOL_PREFERRED_MANY, --preferred-many, falling back to the rank's node on
// kernels before 5.15). A preference, not a bind: allocations spill to other
// nodes when the preferred ones are full. Only nodes whose memory the
// launcher may use (its cpuset's mems) are preferred; with none, no policy.

#include <optional>
#include <string>
#include <vector>

#include "worker/cuda_devices.h"

namespace ctorchrun::worker {

enum class NumaBinding { kNode, kSocket, kExclusive, kCoreComplex };

// "node", "socket", "exclusive", "core-complex"; nullopt otherwise.
std::optional<NumaBinding> parse_numa_binding(const std::string& text);

struct CpuTopology {
  struct Node {
    int id = 0;
    std::vector<int> cpus;  // ascending; may be empty once restricted
    int socket = 0;
  };
  std::vector<Node> nodes;                     // ascending id, each with CPUs when read
  std::vector<std::vector<int>> core_complex;  // L3 groups, each ascending
  std::vector<std::vector<int>> cores;         // physical cores (thread siblings), each ascending
};

// Reads the topology under `sysfs_root` ("/sys"). Throws IoError when no
// NUMA node with CPUs is found. Unreadable details degrade: a node's socket
// 0, no core complexes, each CPU a core of its own.
CpuTopology read_cpu_topology(const std::string& sysfs_root);

// Cuts every CPU list of `topology` to `allowed` (ascending); nodes stay,
// possibly without CPUs; empty cores and core complexes go.
void restrict_cpus(CpuTopology* topology, const std::vector<int>& allowed);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11}. Throws IoError on malformed text.
std::vector<int> parse_cpu_list(const std::string& text);

// Each local rank's NUMA node id; nullopt: none (the rank runs unbound).
using RankNodes = std::vector<std::optional<int>>;

// The CPUs of each local rank of `ranks`; empty for a rank without a node
// or whose node has no CPU left.
std::vector<std::vector<int>> numa_cpus(NumaBinding mode, const CpuTopology& topology,
                                        const RankNodes& ranks);

// The NUMA node ids whose memory each local rank prefers: its node, or in
// socket mode every node of its socket (its own first); empty without a node.
std::vector<std::vector<int>> numa_memory_nodes(NumaBinding mode, const CpuTopology& topology,
                                                const RankNodes& ranks);

// What a plan is made from; tests replace any of it.
struct NumaHost {
  std::string sysfs_root = "/sys";
  std::string proc_root = "/proc";  // for <proc>/driver/nvidia/gpus
  std::optional<std::string> cuda_visible_devices;
  std::optional<std::string> cuda_device_order;
  // SLURM_STEP_GPUS, else SLURM_JOB_GPUS (gpus_cuda_sees).
  std::optional<std::string> slurm_gpus;
  // The CPUs and memory nodes the launcher may use; nullopt: this process's
  // (allowed_cpus(), allowed_memory_nodes()).
  std::optional<std::vector<int>> allowed_cpus;
  std::optional<std::vector<int>> allowed_memory_nodes;
  MigParentLookup mig_parent = nvml_mig_parent_bus_id;
};

struct NumaPlan {
  std::vector<std::vector<int>> cpus;    // per local rank; empty: unbound
  std::vector<std::vector<int>> memory;  // per local rank; empty: no memory policy
  std::vector<std::string> warnings;     // each worth logging once
};

// The binding of each of `nproc` local ranks. Throws IoError when sysfs
// shows no NUMA node, ConfigError when a rank has no GPU
// (cuda_devices.h's map_cuda_devices).
NumaPlan plan_numa_binding(NumaBinding mode, int nproc, const NumaHost& host);

// This process's CPU affinity (sched_getaffinity); empty when unknown.
std::vector<int> allowed_cpus();
// The memory nodes this process may use (get_mempolicy
// MPOL_F_MEMS_ALLOWED: its cpuset's mems); empty when unknown.
std::vector<int> allowed_memory_nodes();

// Whether this process may set a memory policy (get_mempolicy answers;
// seccomp profiles without CAP_SYS_NICE refuse it): empty when it may, else
// the reason.
std::string memory_policy_unavailable();

}  // namespace ctorchrun::worker

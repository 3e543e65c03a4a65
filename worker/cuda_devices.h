#pragma once

// Which NVIDIA GPU each local rank's CUDA device 0 is, found without CUDA in
// the launcher: a CUDA_VISIBLE_DEVICES entry (as CUDA reads it) -> the PCI
// bus id of its GPU. Used by --numa-binding to find a rank's NUMA node, and
// meant for anything else that maps a rank to its device.
//
// The GPUs this process can see are the ones the NVIDIA driver lists under
// <proc>/driver/nvidia/gpus/<bus id>/information ("Model:", "GPU UUID:" and
// "Bus Location:" lines); a container shows only its own there, so a
// device index means the same as it does to CUDA in that container, unlike
// the machine's PCI list in sysfs.
//
// CUDA_VISIBLE_DEVICES entries, as CUDA takes them:
//  - an index into CUDA's order of the visible GPUs. CUDA's default order is
//    fastest first, which is PCI bus order when every GPU is the same model;
//    with CUDA_DEVICE_ORDER=PCI_BUS_ID it is bus order always. With mixed
//    models and no PCI_BUS_ID the order is unknown: such ranks get no GPU;
//  - GPU-<uuid> (or a unique prefix of one): that GPU, in any order;
//  - MIG-GPU-<uuid>/<gi>/<ci> (drivers before 470): an instance of that GPU;
//  - MIG-<uuid>: a MIG instance, whose parent GPU only NVML knows
//    (libnvidia-ml.so.1, opened at run time when present); unknown without.
// A GPU or MIG instance that cannot be told leaves its rank without a GPU
// (a warning), never an error: the worker's CUDA may still know it.

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::worker {

// One GPU of <proc>/driver/nvidia/gpus.
struct NvidiaGpu {
  std::string bus_id;  // "0000:3b:00.0", as in sysfs
  std::string uuid;    // "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"; empty if unreadable
  std::string model;   // "NVIDIA H100 80GB HBM3"
  int minor = -1;      // "Device Minor:", /dev/nvidia<minor>; -1 if unreadable
};

// The GPUs the driver shows this process, in PCI bus order; empty without
// the driver (or without GPUs).
std::vector<NvidiaGpu> read_nvidia_gpus(const std::string& proc_root);

// The GPUs CUDA can open, when a device cgroup hides some that the driver's
// list still shows: Slurm's ConstrainDevices (and `--gpus` under it) lets a
// step open only its GPUs, /dev/nvidia<minor> for each minor of
// SLURM_STEP_GPUS (else SLURM_JOB_GPUS), and then numbers them for CUDA
// from 0 (CUDA_VISIBLE_DEVICES=0,1 for GPUs 2 and 3). Told apart from a step
// without the constraint, where CUDA_VISIBLE_DEVICES repeats the step's own
// indices (2,3), by CUDA_VISIBLE_DEVICES being every index from 0 below the
// step's count and differing from the step's list. Otherwise, or when a
// listed minor is not among `gpus`: `gpus` unchanged.
std::vector<NvidiaGpu> gpus_cuda_sees(const std::vector<NvidiaGpu>& gpus,
                                      const std::optional<std::string>& slurm_gpus,
                                      const std::optional<std::string>& visible_devices);

// "00000000:3B:00.0" (NVML) or "0000:3b:00.0" -> "0000:3b:00.0".
std::string normalize_pci_bus_id(const std::string& bus_id);

// CUDA_VISIBLE_DEVICES's entries as written, whitespace trimmed; an empty
// value has none.
std::vector<std::string> cuda_visible_entries(const std::string& value);

// The entry of the parent's CUDA_VISIBLE_DEVICES that is local rank
// `local_rank`'s device, as written ("3", "GPU-…", "MIG-…"): the
// `local_rank`-th entry, or the index itself when the variable is unset;
// nullopt when the list has fewer entries.
std::optional<std::string> cuda_visible_entry(const std::optional<std::string>& visible_devices,
                                              int local_rank);

// The PCI bus id of a MIG instance's parent GPU ("MIG-<uuid>"), nullopt
// when it cannot be told.
using MigParentLookup = std::function<std::optional<std::string>(const std::string& mig_uuid)>;

// Asks NVML (dlopen'd libnvidia-ml.so.1); nullopt when NVML is missing or
// does not know the instance.
std::optional<std::string> nvml_mig_parent_bus_id(const std::string& mig_uuid);

struct CudaDeviceMap {
  // Each local rank's GPU (PCI bus id); nullopt: not known (see warnings).
  std::vector<std::optional<std::string>> bus_ids;
  // Things worth one warning each: an order or a MIG instance not known.
  std::vector<std::string> warnings;
};

// The GPU of each of `nproc` local ranks (local rank i uses CUDA device i
// of its visible devices). Throws ConfigError when a rank has no entry in
// CUDA_VISIBLE_DEVICES, its entry is an index past the GPUs this process
// sees, or it is none of the forms above: the worker could not use it either.
// `gpus` must not be empty.
CudaDeviceMap map_cuda_devices(int nproc, const std::vector<NvidiaGpu>& gpus,
                               const std::optional<std::string>& visible_devices,
                               const std::optional<std::string>& device_order,
                               const MigParentLookup& mig_parent);

}  // namespace ctorchrun::worker

#pragma once

// The environment torchrun gives each worker, built from the agent's own.

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ctorchrun::agent {

struct WorkerPlacement {
  int local_rank = 0;
  int global_rank = 0;
  int local_world_size = 1;
  int world_size = 1;
  int group_rank = 0;
  int group_world_size = 1;
  std::string role = "default";
  std::string master_addr;
  int master_port = 0;
  // TORCHELASTIC_RESTART_COUNT: every restart of the job's worker group,
  // failures and re-formations alike (as torchrun 2.x counts a membership
  // change), so it can exceed max_restarts: failed_restarts + round.
  int restart_count = 0;
  // CTORCHRUN_FAILED_RESTARTS: the restarts charged to --max_restarts (worker
  // failures, job-wide), and CTORCHRUN_ROUND: the elastic round (each
  // re-formation is one; 0 for the static backend).
  int failed_restarts = 0;
  int round = 0;
  int max_restarts = 0;
  std::string run_id = "none";
  std::string error_file;
  // {major, minor} of the torch the workers' Python imports, when known
  // (worker/torch_probe.h); unknown for --no_python.
  std::optional<std::pair<int, int>> torch_version;
  // The folder holding the ctorch package (torch_backend/), put last on the
  // workers' PYTHONPATH so that `import ctorch` works; empty for none
  // (--no_python, or no build of it next to the launcher).
  std::string ctorch_package_dir;
  // --virtual_local_rank (torch main): LOCAL_RANK is 0 and CUDA_VISIBLE_DEVICES
  // is the worker's own device alone, the local_rank-th entry of the parent's
  // (worker/cuda_devices.h), so that each worker sees its GPU as device 0.
  bool virtual_local_rank = false;
  // --cpu_backend ctorch: the folder of its start-up hook
  // (torch_backend/site/sitecustomize.py), put first on PYTHONPATH, with
  // CTORCHRUN_CPU_BACKEND=ctorch; empty for gloo.
  std::string ctorch_site_dir;
};

// `base` plus torchrun's variables, formatted as torchrun formats them
// (decimal integers, "True" for TORCHELASTIC_USE_AGENT_STORE), and ours
// (CTORCHRUN_FAILED_RESTARTS, CTORCHRUN_ROUND). TORCH_NCCL_ASYNC_ERROR_HANDLING
// is "1", and so is NCCL_ASYNC_ERROR_HANDLING, the name torch read before 2.2
// (2.2 deprecated it and warns on every NCCL rank that sees it), unless the
// workers' torch is known to be 2.2 or later; a value in `base` (the user's)
// is kept as it is. PYTHONPATH gains ctorch_package_dir after the user's
// own entries, which keep their order and win over it.
std::map<std::string, std::string> build_worker_env(const std::map<std::string, std::string>& base,
                                                    const WorkerPlacement& p);

// Global rank of local rank 0 of `group_rank`: the sum of the local world
// sizes of the lower group ranks (torchrun's formula when nodes are alike).
int base_global_rank(const std::vector<int>& local_world_sizes, int group_rank);

// torchrun's legacy "${local_rank}" macro, replaced in every argument.
std::vector<std::string> substitute_local_rank(const std::vector<std::string>& argv,
                                               int local_rank);

// This host's name as gethostname() gives it, not the fully qualified one
// (torch main's socket.gethostname() for ${hostname}: "r12i0n8").
std::string short_hostname();

// The console prefix of a worker's teed lines. An empty `tmpl` gives
// torchrun's "[<role><local_rank>]:". Otherwise `tmpl` is
// TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, expanded as torch 2.x expands it
// (Python's string.Template.safe_substitute): ${role_name} or $role_name,
// ${rank} (global), ${local_rank} and torch main's ${hostname} (`hostname`:
// gethostname(), not the fully qualified name) are replaced, "$$" is one '$', any other '$' text
// stays as written, and nothing (no ':') is appended.
std::string log_line_prefix(const std::string& tmpl, const std::string& role, int rank,
                            int local_rank, const std::string& hostname = short_hostname());

}  // namespace ctorchrun::agent

#include "agent/worker_env.h"

namespace ctorchrun::agent {

std::map<std::string, std::string> build_worker_env(const std::map<std::string, std::string>& base,
                                                    const WorkerPlacement& p) {
  std::map<std::string, std::string> env = base;
  env["LOCAL_RANK"] = std::to_string(p.local_rank);
  env["RANK"] = std::to_string(p.global_rank);
  env["GROUP_RANK"] = std::to_string(p.group_rank);
  env["ROLE_RANK"] = std::to_string(p.global_rank);  // one role: role rank == global rank
  env["ROLE_NAME"] = p.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(p.local_world_size);
  env["WORLD_SIZE"] = std::to_string(p.world_size);
  env["GROUP_WORLD_SIZE"] = std::to_string(p.group_world_size);
  env["ROLE_WORLD_SIZE"] = std::to_string(p.world_size);
  env["MASTER_ADDR"] = p.master_addr;
  env["MASTER_PORT"] = std::to_string(p.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(p.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(p.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = p.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_ERROR_FILE"] = p.error_file;
  env.emplace("NCCL_ASYNC_ERROR_HANDLING", "1");
  env.emplace("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  return env;
}

int base_global_rank(const std::vector<int>& local_world_sizes, int group_rank) {
  int base = 0;
  for (int r = 0; r < group_rank && r < static_cast<int>(local_world_sizes.size()); ++r) {
    base += local_world_sizes[static_cast<size_t>(r)];
  }
  return base;
}

std::vector<std::string> substitute_local_rank(const std::vector<std::string>& argv,
                                               int local_rank) {
  static const std::string kMacro = "${local_rank}";
  std::vector<std::string> out = argv;
  for (auto& a : out) {
    for (size_t pos = a.find(kMacro); pos != std::string::npos; pos = a.find(kMacro, pos)) {
      std::string r = std::to_string(local_rank);
      a.replace(pos, kMacro.size(), r);
      pos += r.size();
    }
  }
  return out;
}

}  // namespace ctorchrun::agent

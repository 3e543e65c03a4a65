#include "agent/worker_env.h"

#include <unistd.h>

#include <cctype>

#include "common/error.h"
#include "worker/cuda_devices.h"

namespace ctorchrun::agent {

std::map<std::string, std::string> build_worker_env(const std::map<std::string, std::string>& base,
                                                    const WorkerPlacement& p) {
  std::map<std::string, std::string> env = base;
  env["LOCAL_RANK"] = std::to_string(p.local_rank);
  if (p.virtual_local_rank) {
    env["LOCAL_RANK"] = "0";
    auto parent = base.find("CUDA_VISIBLE_DEVICES");
    const auto entry = worker::cuda_visible_entry(
        parent == base.end() ? std::nullopt : std::optional<std::string>(parent->second),
        p.local_rank);
    if (!entry) {  // the command line checks this first
      throw ConfigError("local_rank " + std::to_string(p.local_rank) +
                        " exceeds available GPUs in CUDA_VISIBLE_DEVICES=" + parent->second);
    }
    env["CUDA_VISIBLE_DEVICES"] = *entry;
  }
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
  env["CTORCHRUN_FAILED_RESTARTS"] = std::to_string(p.failed_restarts);
  env["CTORCHRUN_ROUND"] = std::to_string(p.round);
  env["TORCHELASTIC_RUN_ID"] = p.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_ERROR_FILE"] = p.error_file;
  if (!p.torch_version || *p.torch_version < std::pair{2, 2}) {
    env.emplace("NCCL_ASYNC_ERROR_HANDLING", "1");
  }
  env.emplace("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  if (!p.ctorch_site_dir.empty()) {
    // First, so that its sitecustomize runs (and then runs the next one).
    auto [path, added] = env.emplace("PYTHONPATH", p.ctorch_site_dir);
    if (!added) path->second = p.ctorch_site_dir + (path->second.empty() ? "" : ":") + path->second;
    env["CTORCHRUN_CPU_BACKEND"] = "ctorch";
  }
  if (!p.ctorch_package_dir.empty()) {
    auto [path, added] = env.emplace("PYTHONPATH", p.ctorch_package_dir);
    // An empty PYTHONPATH adds nothing to sys.path; a set one keeps its entries first.
    if (!added) path->second += (path->second.empty() ? "" : ":") + p.ctorch_package_dir;
  }
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

std::string short_hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

std::string log_line_prefix(const std::string& tmpl, const std::string& role, int rank,
                            int local_rank, const std::string& hostname) {
  if (tmpl.empty()) return "[" + role + std::to_string(local_rank) + "]:";
  const std::map<std::string, std::string> values = {{"role_name", role},
                                                     {"rank", std::to_string(rank)},
                                                     {"local_rank", std::to_string(local_rank)},
                                                     {"hostname", hostname}};
  // Python's identifier pattern for Template: [_a-z][_a-z0-9]*, any case
  // (re.IGNORECASE), looked up case-sensitively.
  auto id_start = [](char c) { return c == '_' || std::isalpha(static_cast<unsigned char>(c)); };
  auto id_char = [](char c) { return c == '_' || std::isalnum(static_cast<unsigned char>(c)); };
  std::string out;
  size_t i = 0;
  while (i < tmpl.size()) {
    if (tmpl[i] != '$') {
      out += tmpl[i++];
      continue;
    }
    if (i + 1 < tmpl.size() && tmpl[i + 1] == '$') {  // "$$"
      out += '$';
      i += 2;
      continue;
    }
    size_t start = i + 1;
    bool braced = start < tmpl.size() && tmpl[start] == '{';
    if (braced) ++start;
    size_t end = start;
    if (end < tmpl.size() && id_start(tmpl[end])) {
      ++end;
      while (end < tmpl.size() && id_char(tmpl[end])) ++end;
    }
    const bool closed = !braced || (end < tmpl.size() && tmpl[end] == '}');
    if (end == start || !closed) {  // not a placeholder: the '$' stays
      out += '$';
      ++i;
      continue;
    }
    const size_t after = braced ? end + 1 : end;
    auto v = values.find(tmpl.substr(start, end - start));
    out += v == values.end() ? tmpl.substr(i, after - i) : v->second;
    i = after;
  }
  return out;
}

}  // namespace ctorchrun::agent

#pragma once

// LaunchConfig: everything the agent needs to run one node of a job, as plain
// data. The command line (cli/) fills it in and validates it; the agent reads
// it and never looks at argv or the environment for its settings.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "worker/numa_binding.h"

namespace ctorchrun::agent {

struct LaunchConfig {
  // Membership. Static rendezvous: min_nodes == max_nodes == nnodes.
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  int node_rank = 0;

  // Rendezvous.
  std::string rdzv_backend = "static";
  // The static rendezvous' store (node 0 hosts it); empty/0 under c10d and
  // etcd-v3, whose workers' store the rendezvous chooses each round.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0 only with --standalone: a free port
  // --rdzv_backend=c10d: the endpoint's store (the host without brackets).
  std::string rdzv_endpoint_host;
  int rdzv_endpoint_port = 0;
  std::string run_id = "none";
  // --rdzv_backend=etcd-v3: the etcd members ("host:port", at least one) and
  // the key prefix (--rdzv_conf etcd_prefix).
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/ctorchrun";
  // etcd over TLS (https:// endpoints or --rdzv_conf protocol=https): the CA
  // that signed the members' certificates (empty: the system's trust store)
  // and the client certificate and key for mutual TLS (both or neither).
  bool etcd_tls = false;
  std::string etcd_cacert;
  std::string etcd_cert;
  std::string etcd_key;
  // --rdzv_conf protocol as given ("" when not), for the command line's checks.
  std::string etcd_protocol;
  std::map<std::string, std::string> rdzv_conf;
  std::chrono::milliseconds rdzv_timeout{900'000};  // rdzv_conf timeout, torchrun's 900 s
  // The other --rdzv_conf keys, validated and typed (cli/rdzv_conf.cc holds
  // the table of keys, ranges and defaults; rdzv_conf above keeps the text).
  std::chrono::milliseconds join_timeout{600'000};
  std::chrono::milliseconds last_call_timeout{30'000};
  std::chrono::milliseconds close_timeout{30'000};
  std::chrono::milliseconds read_timeout{60'000};
  std::optional<bool> is_host;  // unset: decided from the endpoint
  std::chrono::milliseconds keep_alive_interval{5'000};
  int keep_alive_max_attempt = 3;
  // A node silent this long is lost: keep_alive_interval * keep_alive_max_attempt
  // unless rdzv_conf gives node_timeout.
  std::chrono::milliseconds node_timeout{15'000};
  // Limits of the store this node hosts; unset: the store's own defaults.
  std::optional<uint64_t> store_max_key_bytes;
  std::optional<uint64_t> store_max_value_bytes;
  std::optional<uint64_t> store_max_request_bytes;
  std::optional<uint64_t> store_max_keys_per_op;
  std::optional<uint64_t> store_max_connections;
  std::string local_addr;  // this node's address for others; empty: its hostname

  // Restarts and stopping.
  int max_restarts = 0;
  std::chrono::milliseconds shutdown_timeout{30'000};
  std::chrono::milliseconds exit_barrier_timeout{300'000};
  std::vector<int> signals_to_handle;  // SIGTERM, SIGINT, SIGHUP, SIGQUIT by default
  // --hang_timeout: a job none of whose workers progressed this long is hung
  // (agent/hang_detector.h); 0: off.
  std::chrono::milliseconds hang_timeout{0};
  // The scheduler the launcher runs under ("slurm": a task of a Slurm job
  // step), empty for none. `scheduler_signals` are the signals that scheduler
  // delivers to every process of the job itself, workers included: the agent
  // does not forward them (a worker gets each signal once), waits up to
  // shutdown_timeout for the workers, SIGKILLs what is left and exits with
  // kExitSchedulerStop; a worker that dies by one of them is the scheduler's
  // doing, not a failure worth a restart.
  std::string scheduler;
  std::vector<int> scheduler_signals;
  // Whether the scheduler's signals reach the workers, which run in sessions
  // of their own: Slurm's proctrack/cgroup and proctrack/linuxproc do,
  // proctrack/pgid signals the task's process group alone. When false the
  // agent forwards each scheduler signal itself (once).
  bool scheduler_reaches_workers = true;

  // The environment workers inherit (the launcher's, plus what the command
  // line decided, such as OMP_NUM_THREADS=1); the agent adds torchrun's
  // variables on top.
  std::map<std::string, std::string> environment;

  // What each worker runs: the full argv (interpreter and flags included);
  // "${local_rank}" in an argument is replaced per worker, as torchrun does.
  std::vector<std::string> entrypoint;
  // The interpreter entrypoint[0] names when the script runs under Python;
  // empty with --no_python.
  std::string python;
  std::string role = "default";
  // --numa-binding: each local rank's CPUs near its GPU (worker/numa_binding.h),
  // read from sysfs at `sysfs_root` ($CTORCHRUN_SYSFS_ROOT, for tests; /sys),
  // the GPUs this process sees from `proc_root`/driver/nvidia/gpus.
  std::optional<worker::NumaBinding> numa_binding;
  std::string sysfs_root = "/sys";
  std::string proc_root = "/proc";
  // Name shown in the failure summary: the script, module or binary.
  std::string entrypoint_name;

  // Output and logs.
  std::string log_dir;                // empty: a temporary directory
  unsigned redirects_default = 0;     // bit 1 stdout, bit 2 stderr
  std::map<int, unsigned> redirects;  // per local rank
  unsigned tee_default = 0;
  std::map<int, unsigned> tee;
  std::optional<std::vector<int>>
      local_ranks_filter;  // ranks whose teed output reaches the console
  std::string events_file;
  // --event_log_handler=console: every event record on stderr too.
  bool events_to_console = false;
  // --duplicate_stdout_filters / --duplicate_stderr_filters (torch main):
  // teed lines holding any of these go to the attempt's filtered_stdout.log /
  // filtered_stderr.log too (worker::WorkerSpec).
  std::vector<std::string> duplicate_stdout_filters;
  std::vector<std::string> duplicate_stderr_filters;
  // TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT (torch main): a worker in
  // uninterruptible sleep (D state, /proc/<pid>/stat) this long fails the job
  // with no restart; 0 (unset, not positive, unreadable) is off.
  std::chrono::milliseconds uninterruptible_state_timeout{0};
  // --status_host: the address the agent's HTTP endpoints bind
  // (TORCHELASTIC_HEALTH_CHECK_PORT's server); 0.0.0.0 so that a Kubernetes
  // probe reaches the pod's address.
  std::string status_host = "0.0.0.0";
  // --status_port: the agent's HTTP endpoint (/metrics, /status, /, and the
  // health check's); 0 picks a free port; unset: off (agent/job_status.h).
  std::optional<int> status_port;
  // --virtual_local_rank: see WorkerPlacement::virtual_local_rank (agent/worker_env.h).
  bool virtual_local_rank = false;
  // --cpu_backend: "gloo" (the script's gloo groups as they are) or "ctorch"
  // (they run on the bundled runtime: WorkerPlacement::ctorch_site_dir).
  std::string cpu_backend = "gloo";
  // --log_line_prefix_template, else TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE from the launcher's
  // environment (see log_line_prefix in agent/worker_env.h); empty: "[<role><local_rank>]:".
  std::string log_line_prefix_template;

  unsigned redirects_for(int local_rank) const {
    auto it = redirects.find(local_rank);
    return it == redirects.end() ? redirects_default : it->second;
  }
  unsigned tee_for(int local_rank) const {
    auto it = tee.find(local_rank);
    return it == tee.end() ? tee_default : it->second;
  }
  int nnodes() const { return max_nodes; }
};

}  // namespace ctorchrun::agent

#include "cli/command_line.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstring>
#include <random>
#include <sstream>
#include <tuple>

#include "common/config.h"

namespace ctorchrun::cli {

namespace {

constexpr const char* kOmpNotice =
    "*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************";

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

int parse_int(const std::string& flag, const std::string& v, int lo, int hi) {
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size()) {
    throw UsageError(flag + ": '" + v + "' is not an integer");
  }
  if (n < lo || n > hi) {
    throw UsageError(flag + ": " + v + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  return static_cast<int>(n);
}

double parse_seconds(const std::string& flag, const std::string& v) {
  size_t used = 0;
  double d = -1;
  try {
    d = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || !(d >= 0) || d > 1e9) {
    throw UsageError(flag + ": '" + v + "' is not a number of seconds >= 0");
  }
  return d;
}

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

// torchrun's --redirects/--tee syntax: "3" for every local rank, or
// "0:1,1:2" per local rank (values 0..3).
void parse_std_map(const std::string& flag, const std::string& v, unsigned* all,
                   std::map<int, unsigned>* per_rank) {
  auto value = [&](const std::string& s) {
    if (s.size() != 1 || s[0] < '0' || s[0] > '3') {
      throw UsageError(flag + ": '" + s +
                       "' is not one of 0 (none), 1 (stdout), 2 (stderr), 3 (both)");
    }
    return static_cast<unsigned>(s[0] - '0');
  };
  if (v.find(':') == std::string::npos) {
    *all = value(v);
    return;
  }
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw UsageError(flag + ": '" + item + "' is not LOCAL_RANK:VALUE (as in 0:1,1:2)");
    }
    int rank = parse_int(flag, item.substr(0, colon), 0, 1 << 20);
    (*per_rank)[rank] = value(item.substr(colon + 1));
  }
}

std::vector<int> parse_int_list(const std::string& flag, const std::string& v) {
  std::vector<int> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_int(flag, item, 0, 1 << 20));
  if (out.empty()) throw UsageError(flag + ": empty list");
  return out;
}

int signal_number(const std::string& name) {
  static const std::pair<const char*, int> kSignals[] = {
      {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},   {"SIGQUIT", SIGQUIT},
      {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}, {"SIGXCPU", SIGXCPU}, {"SIGXFSZ", SIGXFSZ},
      {"SIGCONT", SIGCONT}, {"SIGALRM", SIGALRM}};
  std::string n = name;
  if (n.rfind("SIG", 0) != 0) n = "SIG" + n;
  for (auto& [s, num] : kSignals) {
    if (n == s) return num;
  }
  throw UsageError("--signals_to_handle: unknown or unsupported signal '" + name + "'");
}

std::string random_suffix() {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device rd;
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(kChars[rd() % (sizeof kChars - 1)]);
  return s;
}

// "host:port", "[v6]:port" or "host" (port stays as given).
void split_endpoint(const std::string& ep, std::string* host, int* port) {
  if (ep.empty()) return;
  if (ep[0] == '[') {
    auto close = ep.find(']');
    if (close == std::string::npos) throw UsageError("--rdzv_endpoint: '" + ep + "' lacks a ']'");
    *host = ep.substr(1, close - 1);
    if (close + 1 < ep.size()) {
      if (ep[close + 1] != ':')
        throw UsageError("--rdzv_endpoint: '" + ep + "' is not [HOST]:PORT");
      *port = parse_int("--rdzv_endpoint port", ep.substr(close + 2), 1, 65535);
    }
    return;
  }
  auto colon = ep.rfind(':');
  if (colon == std::string::npos) {
    *host = ep;
    return;
  }
  *host = ep.substr(0, colon);
  *port = parse_int("--rdzv_endpoint port", ep.substr(colon + 1), 1, 65535);
}

std::string getenv_or(const std::map<std::string, std::string>& env, const std::string& k,
                      const std::string& fallback) {
  auto it = env.find(k);
  return it == env.end() || it->second.empty() ? fallback : it->second;
}

constexpr const char* kFooter = R"(
The training script and its arguments come last and are passed through untouched;
an option before the script that ctorchrun does not know is an error.
The script runs as `$PYTHON -u script args...` (`-m module` with --module), where
$PYTHON is $CTORCHRUN_PYTHON, else $PYTHON_EXEC, else python3 from PATH.

Every option can also be set as PET_<NAME> in the environment (PET_NPROC_PER_NODE=4),
as with torchrun; the command line wins. Other variables read: LOGLEVEL (DEBUG, INFO,
WARNING, ERROR), TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT,
OMP_NUM_THREADS (set to 1 for the workers when unset and nproc_per_node > 1).

Workers get torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, NCCL_ASYNC_ERROR_HANDLING,
TORCH_NCCL_ASYNC_ERROR_HANDLING.

Exit codes:
  0        all local workers succeeded
  1        workers failed and the restarts are exhausted (the summary names the rank)
  2        usage or configuration error
  3        rendezvous failed, timed out or was closed, or its store was lost mid-run
  4        store or network set-up failed (bind, connect)
  70       internal error (please report)
  128+N    stopped by signal N (forwarded to the workers first; SIGTERM gives 143)
)";

// CLI11 prints "Usage: ctorchrun [OPTIONS]"; the script and its arguments
// belong there too.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] SCRIPT [SCRIPT ARGS...]\n";
  }
};

}  // namespace

int count_gpus(const std::map<std::string, std::string>& env) {
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
  }
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it != env.end() && n > 0) {
    if (it->second.empty()) return 0;
    int listed = static_cast<int>(std::count(it->second.begin(), it->second.end(), ',')) + 1;
    n = std::min(n, listed);
  }
  return n;
}

ParseOutcome parse_command_line(int argc, const char* const* argv,
                                const std::map<std::string, std::string>& env) {
  ParseOutcome out;
  agent::LaunchConfig& c = out.config;

  std::string nnodes = "1:1", nproc = "1", rdzv_backend = "static", rdzv_endpoint, rdzv_id = "none",
              rdzv_conf, start_method = "spawn", role = "default", log_dir, redirects = "0",
              tee = "0", local_ranks_filter, master_addr = "127.0.0.1", local_addr,
              signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT", events_file, event_log_handler = "null",
              logs_specs, numa_binding;
  std::string node_rank = "0", master_port = "29500", max_restarts = "0", monitor_interval = "0.1",
              shutdown_timeout = getenv_or(env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"),
              exit_barrier_timeout = getenv_or(env, "TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", "300");
  bool standalone = false, module = false, no_python = false, run_path = false;

  CLI::App app{
      "ctorchrun: launch a distributed PyTorch (or C++) job, one agent per node; a drop-in "
      "for torchrun.\n\n"
      "  ctorchrun --nproc_per_node=4 train.py --epochs 10\n"
      "  ctorchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 "
      "--master_port=29500 train.py\n"
      "  ctorchrun --nproc_per_node=4 --max_restarts=3 train.py\n"
      "  ctorchrun --nproc_per_node=4 --no_python ./my_trainer --steps 1000",
      "ctorchrun"};
  app.prefix_command();  // the first positional argument starts the script's argv
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto formatter = std::make_shared<UsageFormatter>();
  formatter->column_width(40);
  app.formatter(formatter);
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("ctorchrun ") + CTORCHRUN_VERSION);

  // PET_<NAME> fallbacks come from `env` (not getenv), applied after parsing
  // to the options the command line did not give.
  std::vector<std::tuple<CLI::Option*, std::string*, std::string>> pet_options;
  std::vector<std::tuple<CLI::Option*, bool*, std::string>> pet_flags;
  auto opt = [&](const std::string& names, std::string& target, const std::string& env_name,
                 const std::string& help) {
    CLI::Option* o = app.add_option(names, target, help)->capture_default_str()->type_name("");
    o->description(help + " [env: " + env_name + "]");
    pet_options.emplace_back(o, &target, env_name);
    return o;
  };
  auto flag = [&](const std::string& names, bool& target, const std::string& env_name,
                  const std::string& help) {
    CLI::Option* o = app.add_flag(names, target, help + " [env: " + env_name + "]");
    pet_flags.emplace_back(o, &target, env_name);
    return o;
  };
  opt("--nnodes", nnodes, "PET_NNODES",
      "number of nodes, N or MIN:MAX (MIN:MAX needs the c10d backend)");
  opt("--nproc-per-node,--nproc_per_node", nproc, "PET_NPROC_PER_NODE",
      "workers per node: N, cpu (one per CPU), gpu (one per GPU), auto (gpu if any, else cpu)");
  opt("--node-rank,--node_rank", node_rank, "PET_NODE_RANK", "rank of this node, 0..nnodes-1");
  opt("--master-addr,--master_addr", master_addr, "PET_MASTER_ADDR",
      "address of node 0, which hosts the store");
  opt("--master-port,--master_port", master_port, "PET_MASTER_PORT", "port of the store on node 0");
  opt("--max-restarts,--max_restarts", max_restarts, "PET_MAX_RESTARTS",
      "job-wide restarts of every worker after a failure (nodes must agree)");
  opt("--monitor-interval,--monitor_interval", monitor_interval, "PET_MONITOR_INTERVAL",
      "accepted for torchrun compatibility; exits are noticed as they happen");
  opt("--rdzv-backend,--rdzv_backend", rdzv_backend, "PET_RDZV_BACKEND",
      "rendezvous backend: static");
  opt("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint, "PET_RDZV_ENDPOINT",
      "HOST[:PORT] of the rendezvous store (static: defaults to master_addr:master_port)");
  opt("--rdzv-id,--rdzv_id", rdzv_id, "PET_RDZV_ID", "job id shared by all nodes");
  opt("--rdzv-conf,--rdzv_conf", rdzv_conf, "PET_RDZV_CONF",
      "KEY=VALUE,...: timeout=SECONDS bounds the rendezvous (default 900); node_timeout=SECONDS "
      "declares a node lost when its agent has been silent that long (default 15)");
  flag("--standalone", standalone, "PET_STANDALONE",
       "single node on a free local port (no master_addr/port needed)");
  opt("--start-method,--start_method", start_method, "PET_START_METHOD",
      "accepted for torchrun compatibility (spawn, fork, forkserver)");
  opt("--role", role, "PET_ROLE", "role name of the workers (ROLE_NAME, log prefix)");
  flag("-m,--module", module, "PET_MODULE", "run the script as a Python module (python -m)");
  flag("--no-python,--no_python", no_python, "PET_NO_PYTHON",
       "run the script directly as an executable, not through Python");
  flag("--run-path,--run_path", run_path, "PET_RUN_PATH",
       "accepted for torchrun compatibility: the script runs as with Python");
  opt("--log-dir,--log_dir", log_dir, "PET_LOG_DIR",
      "directory for the workers' logs and error files (default: a temporary one, removed "
      "after success)");
  opt("-r,--redirects", redirects, "PET_REDIRECTS",
      "send worker output to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank "
      "as 0:1,1:2");
  opt("-t,--tee", tee, "PET_TEE",
      "copy worker output to log files and the console, lines prefixed [<role><local_rank>]:; "
      "same syntax as --redirects");
  opt("--local-ranks-filter,--local_ranks_filter", local_ranks_filter, "PET_LOCAL_RANKS_FILTER",
      "comma-separated local ranks whose teed output reaches the console");
  opt("--local-addr,--local_addr", local_addr, "PET_LOCAL_ADDR",
      "this node's address as others should reach it");
  opt("--signals-to-handle,--signals_to_handle", signals, "PET_SIGNALS_TO_HANDLE",
      "signals forwarded to the workers before the launcher exits with 128+N");
  opt("--event-log-handler,--event_log_handler", event_log_handler, "PET_EVENT_LOG_HANDLER",
      "accepted for torchrun compatibility; see --events_file");
  opt("--logs-specs,--logs_specs", logs_specs, "PET_LOGS_SPECS",
      "torchrun's plug-in log layouts are not supported; giving one is an error");
  opt("--numa-binding,--numa_binding", numa_binding, "PET_NUMA_BINDING",
      "not supported yet; giving it is an error");
  opt("--shutdown-timeout,--shutdown_timeout", shutdown_timeout, "PET_SHUTDOWN_TIMEOUT",
      "seconds between SIGTERM and SIGKILL when stopping workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)");
  opt("--exit-barrier-timeout,--exit_barrier_timeout", exit_barrier_timeout,
      "PET_EXIT_BARRIER_TIMEOUT",
      "seconds a finished node waits for nodes whose liveness is unknown; live nodes still "
      "running workers are waited for without limit (TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT)");
  opt("--events-file,--events_file", events_file, "PET_EVENTS_FILE",
      "append one JSON object per lifecycle event to this file");

  std::vector<std::string> args;
  for (int i = argc - 1; i > 0; --i) args.emplace_back(argv[i]);  // CLI11 takes them reversed
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    out.kind = ParseOutcome::Kind::kExit;
    out.message = app.help();
    return out;
  } catch (const CLI::CallForVersion&) {
    out.kind = ParseOutcome::Kind::kExit;
    out.message = std::string("ctorchrun ") + CTORCHRUN_VERSION + "\n";
    return out;
  } catch (const CLI::ParseError& e) {
    out.kind = ParseOutcome::Kind::kExit;
    out.exit_code = 2;
    out.message = std::string("ctorchrun: ") + e.what() + " (see ctorchrun --help)";
    return out;
  }

  try {
    for (auto& [o, target, name] : pet_options) {
      auto it = env.find(name);
      if (o->count() == 0 && it != env.end()) *target = it->second;
    }
    for (auto& [o, target, name] : pet_flags) {
      auto it = env.find(name);
      if (o->count() == 0 && it != env.end()) {
        const std::string& v = it->second;
        if (v == "1" || v == "true" || v == "True" || v == "TRUE" || v == "yes") {
          *target = true;
        } else if (v == "0" || v == "false" || v == "False" || v == "FALSE" || v == "no" ||
                   v.empty()) {
          *target = false;
        } else {
          throw UsageError(name + "='" + v + "' is not a boolean (1 or 0)");
        }
      }
    }
    std::vector<std::string> rest = app.remaining();
    if (rest.empty())
      throw UsageError("no training script given (ctorchrun [options] SCRIPT [args...])");
    if (rest[0].size() > 1 && rest[0][0] == '-') {
      throw UsageError("unknown option '" + rest[0] + "' before the training script");
    }
    // Membership.
    auto colon = nnodes.find(':');
    if (colon == std::string::npos) {
      c.min_nodes = c.max_nodes = parse_int("--nnodes", nnodes, 1, 1 << 20);
    } else {
      c.min_nodes = parse_int("--nnodes", nnodes.substr(0, colon), 1, 1 << 20);
      c.max_nodes = parse_int("--nnodes", nnodes.substr(colon + 1), 1, 1 << 20);
      if (c.min_nodes > c.max_nodes) {
        throw UsageError("--nnodes=" + nnodes + ": MIN is greater than MAX");
      }
    }
    int cpus = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    if (nproc == "cpu") {
      c.nproc_per_node = cpus;
    } else if (nproc == "gpu" || nproc == "cuda") {
      c.nproc_per_node = count_gpus(env);
      if (c.nproc_per_node == 0) {
        throw UsageError("--nproc_per_node=gpu: no GPU found on this machine");
      }
    } else if (nproc == "auto") {
      int gpus = count_gpus(env);
      c.nproc_per_node = gpus > 0 ? gpus : cpus;
    } else {
      c.nproc_per_node = parse_int("--nproc_per_node", nproc, 1, 1 << 16);
    }
    c.node_rank = parse_int("--node_rank", node_rank, 0, 1 << 20);
    c.master_addr = master_addr;
    c.master_port = parse_int("--master_port", master_port, 1, 65535);
    c.max_restarts = parse_int("--max_restarts", max_restarts, 0, 1 << 30);
    parse_seconds("--monitor_interval", monitor_interval);
    if (start_method != "spawn" && start_method != "fork" && start_method != "forkserver") {
      throw UsageError("--start_method: '" + start_method + "' is not spawn, fork or forkserver");
    }
    if (!logs_specs.empty())
      throw UsageError("--logs_specs: plug-in log layouts are not supported");
    if (!numa_binding.empty()) throw UsageError("--numa_binding is not supported yet");

    // Rendezvous.
    c.run_id = rdzv_id;
    c.rdzv_backend = rdzv_backend;
    if (!rdzv_conf.empty()) {
      std::stringstream ss(rdzv_conf);
      std::string item;
      while (std::getline(ss, item, ',')) {
        auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0) {
          throw UsageError("--rdzv_conf: '" + item + "' is not KEY=VALUE");
        }
        c.rdzv_conf[item.substr(0, eq)] = item.substr(eq + 1);
      }
    }
    if (auto it = c.rdzv_conf.find("timeout"); it != c.rdzv_conf.end()) {
      c.rdzv_timeout = to_ms(parse_seconds("--rdzv_conf timeout", it->second));
    }
    if (standalone) {
      // One node on a free local port until dynamic rendezvous lands.
      c.rdzv_backend = "static";
      c.min_nodes = c.max_nodes = 1;
      c.node_rank = 0;
      c.master_addr = "127.0.0.1";
      c.master_port = 0;
      c.run_id = "standalone_" + random_suffix();
    } else {
      if (c.rdzv_backend == "c10d" || c.rdzv_backend == "etcd" || c.rdzv_backend == "etcd-v2") {
        throw UsageError("--rdzv_backend=" + c.rdzv_backend +
                         " is not supported yet; use the static backend (--nnodes=N "
                         "--node_rank=R --master_addr=HOST --master_port=PORT)");
      }
      if (c.rdzv_backend != "static") {
        throw UsageError("--rdzv_backend: unknown backend '" + c.rdzv_backend + "'");
      }
      if (c.min_nodes != c.max_nodes) {
        throw UsageError("--nnodes=" + nnodes +
                         ": a range of nodes needs dynamic rendezvous (c10d), which is not "
                         "supported yet; give a fixed --nnodes=N");
      }
      split_endpoint(rdzv_endpoint, &c.master_addr, &c.master_port);
      if (c.node_rank >= c.max_nodes) {
        throw UsageError("--node_rank=" + std::to_string(c.node_rank) +
                         " must be below --nnodes=" + std::to_string(c.max_nodes));
      }
    }
    c.local_addr = local_addr;

    // Stopping.
    c.shutdown_timeout = to_ms(parse_seconds("--shutdown_timeout", shutdown_timeout));
    c.exit_barrier_timeout = to_ms(parse_seconds("--exit_barrier_timeout", exit_barrier_timeout));
    c.signals_to_handle.clear();
    {
      std::stringstream ss(signals);
      std::string item;
      while (std::getline(ss, item, ',')) {
        item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
        if (!item.empty()) c.signals_to_handle.push_back(signal_number(item));
      }
    }

    // Output.
    c.log_dir = log_dir;
    parse_std_map("--redirects", redirects, &c.redirects_default, &c.redirects);
    parse_std_map("--tee", tee, &c.tee_default, &c.tee);
    if (!local_ranks_filter.empty()) {
      c.local_ranks_filter = parse_int_list("--local_ranks_filter", local_ranks_filter);
    }
    c.events_file = events_file;
    c.role = role;

    // What to run.
    if (module && no_python) {
      throw UsageError("--module and --no_python cannot be used together");
    }
    c.entrypoint_name = rest[0];
    if (no_python && !run_path) {
      c.entrypoint = rest;
    } else {
      std::string python =
          getenv_or(env, "CTORCHRUN_PYTHON", getenv_or(env, "PYTHON_EXEC", "python3"));
      c.entrypoint = {python, "-u"};
      if (module) c.entrypoint.push_back("-m");
      c.entrypoint.insert(c.entrypoint.end(), rest.begin(), rest.end());
    }

    // The workers' environment: ours, with torchrun's OMP_NUM_THREADS rule.
    c.environment = env;
    if (c.nproc_per_node > 1 && env.find("OMP_NUM_THREADS") == env.end()) {
      c.environment["OMP_NUM_THREADS"] = "1";
      out.notices.push_back(kOmpNotice);
    }
  } catch (const UsageError& e) {
    out.kind = ParseOutcome::Kind::kExit;
    out.exit_code = 2;
    out.message = std::string("ctorchrun: ") + e.what();
  }
  return out;
}

}  // namespace ctorchrun::cli

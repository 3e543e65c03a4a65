#include "cli/command_line.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <random>
#include <set>
#include <sstream>

#include "cli/rdzv_conf.h"
#include "cli/slurm.h"
#include "common/config.h"
#include "common/error.h"
#include "rendezvous/endpoint.h"
#include "worker/numa_binding.h"

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

// A whole decimal integer in [lo, hi], for the parts of values CLI11 cannot
// type on its own (MIN:MAX, LOCAL_RANK:VALUE, HOST:PORT).
int parse_int(const std::string& what, const std::string& v, int lo, int hi) {
  long long n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
    throw UsageError(what + ": '" + v + "' is not an integer");
  }
  if (n < lo || n > hi) {
    throw UsageError(what + ": " + v + " is out of range [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  return static_cast<int>(n);
}

std::vector<std::string> split(const std::string& v, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

// Durations on the command line: decimal seconds in [0, one year].
CLI::Validator seconds_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        double d = 0;
        if (parse_seconds(s, 0, false, kMaxSeconds, &d)) return "";
        return "'" + s + "' is not decimal seconds in [0, 31536000]";
      },
      "SECONDS");
}

// --nproc_per_node: a count, or cpu, gpu (cuda) or auto.
CLI::Validator nproc_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s == "cpu" || s == "gpu" || s == "cuda" || s == "auto") return "";
        int n = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
        if (ec == std::errc() && end == s.data() + s.size() && n >= 1 && n <= (1 << 16)) return "";
        return "'" + s + "' is not a number of workers in [1, 65536], cpu, gpu or auto";
      },
      "N|cpu|gpu|auto");
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
  for (const std::string& item : split(v, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) {
      throw UsageError(flag + ": '" + item + "' is not LOCAL_RANK:VALUE (as in 0:1,1:2)");
    }
    int rank = parse_int(flag, item.substr(0, colon), 0, 1 << 20);
    (*per_rank)[rank] = value(item.substr(colon + 1));
  }
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

// etcd over TLS or not, from the endpoints' scheme ("https", "http" or ""
// when none was written) and the --rdzv_conf keys protocol, cacert, cert and
// key, which apply_rdzv_conf stored in `c`. Conflicts are usage errors.
void resolve_etcd_tls(const std::string& endpoint_scheme, agent::LaunchConfig* c) {
  const std::string& protocol = c->etcd_protocol;
  if (!endpoint_scheme.empty() && !protocol.empty() && protocol != endpoint_scheme) {
    throw UsageError("--rdzv_conf protocol=" + protocol + " contradicts the " + endpoint_scheme +
                     ":// endpoints of --rdzv_endpoint");
  }
  c->etcd_tls = protocol == "https" || endpoint_scheme == "https";
  const bool files = !c->etcd_cacert.empty() || !c->etcd_cert.empty() || !c->etcd_key.empty();
  if (!c->etcd_tls && files) {
    throw UsageError(
        "--rdzv_conf cacert, cert and key are for etcd over TLS, but the members are reached "
        "over http; add protocol=https or write the endpoints as https://HOST:PORT");
  }
  if (c->etcd_cert.empty() != c->etcd_key.empty()) {
    throw UsageError(c->etcd_cert.empty()
                         ? "--rdzv_conf key='" + c->etcd_key +
                               "' without cert: a client key needs its certificate"
                         : "--rdzv_conf cert='" + c->etcd_cert +
                               "' without key: a client certificate needs its key");
  }
}

// An item of --rdzv_endpoint (rendezvous::parse_endpoint), `default_port`
// when it names none.
rendezvous::Endpoint endpoint_of(const std::string& ep, int default_port) {
  try {
    return rendezvous::parse_endpoint(ep, default_port);
  } catch (const ConfigError& e) {
    throw UsageError(std::string("--rdzv_endpoint: ") + e.what());
  }
}

std::string getenv_or(const std::map<std::string, std::string>& env, const std::string& k,
                      const std::string& fallback) {
  auto it = env.find(k);
  return it == env.end() || it->second.empty() ? fallback : it->second;
}

// argv split the way torchrun's argparse splits it, before CLI11 sees it.
// CLI11 2.1.2 reads "--opt=" as "--opt" and then takes the next argument as
// the value, and it refuses "--"; so the options are rewritten here, each
// value-taking one as a single "--long-name=VALUE".
struct SplitArgs {
  std::vector<std::string> options;            // for CLI11, in order
  std::set<const CLI::Option*> given;          // what the command line set (to an empty value too)
  std::map<std::string, std::string> spelled;  // CLI11's name of an option -> the user's
  std::vector<std::string> script;             // the script and its arguments, untouched
};

// CLI11 names an option by its first name (--nproc-per-node); say it as the
// user wrote it (--nproc_per_node).
std::string as_spelled(std::string message, const std::map<std::string, std::string>& spelled) {
  for (const auto& [canonical, name] : spelled) {
    for (size_t at = message.find(canonical); at != std::string::npos;
         at = message.find(canonical, at)) {
      size_t end = at + canonical.size();
      if (end < message.size() && (std::isalnum(static_cast<unsigned char>(message[end])) ||
                                   message[end] == '-' || message[end] == '_')) {
        at = end;  // a longer name that starts the same way
        continue;
      }
      message.replace(at, canonical.size(), name);
      at += name.size();
    }
  }
  const std::string missing = ": 1 required  missing";  // type names are hidden in --help
  if (auto at = message.find(missing); at != std::string::npos) {
    message.replace(at, missing.size(), ": a value is required");
  }
  return message;
}

// As argparse decides: a separate argument is an option's value unless it
// looks like an option itself (a negative number does not).
bool looks_like_value(const std::string& a) {
  if (a.size() < 2 || a[0] != '-') return true;
  double d = 0;
  auto [end, ec] = std::from_chars(a.data(), a.data() + a.size(), d);
  return ec == std::errc() && end == a.data() + a.size();
}

// Every long option string ("--nproc-per-node", "--nproc_per_node", ...), in
// the order the options were added, each option's spellings in their order.
std::vector<std::string> long_option_strings(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& l : o->get_lnames()) out.push_back("--" + l);
  }
  return out;
}

// torchrun's argparse (allow_abbrev=True, CPython 3.11's _parse_optional and
// _get_option_tuples): a long option that is not an option string is taken
// as a prefix (of the part before '=') of the option strings. One match is
// that option; several are an error listing them, even when they are the two
// spellings of one option (argparse counts option strings, not options, so
// "--nproc" could be --nproc-per-node or --nproc_per_node); none leaves
// `name` unknown. `arg` is the whole argument, as argparse quotes it.
std::string resolve_abbreviation(const CLI::App& app, const std::string& arg,
                                 const std::string& name) {
  std::vector<std::string> matches;
  for (const std::string& s : long_option_strings(app)) {
    if (s.compare(0, name.size(), name) == 0) matches.push_back(s);
  }
  if (matches.size() == 1) return matches.front();
  if (matches.size() > 1) {
    std::string list;
    for (const std::string& m : matches) list += (list.empty() ? "" : ", ") + m;
    throw UsageError("ambiguous option: " + arg + " could match " + list);
  }
  return name;
}

// Options before the script; the first argument that is not one (or the one
// after a first "--") starts the script. A long option may be abbreviated
// (resolve_abbreviation); after the script nothing is. An empty value unsets
// the options in `empty_is_unset` and is an error for the others. The last
// occurrence of an option wins.
SplitArgs split_argv(CLI::App& app, int argc, const char* const* argv,
                     const std::set<const CLI::Option*>& empty_is_unset) {
  SplitArgs out;
  std::vector<std::pair<const CLI::Option*, std::string>> emitted;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.size() < 2 || a[0] != '-') break;
    const bool is_long = a[1] == '-';
    const auto eq = is_long ? a.find('=') : std::string::npos;
    std::string name = is_long ? a.substr(0, eq) : a.substr(0, 2);
    const CLI::Option* o = app.get_option_no_throw(name);
    std::string as_given = a;  // with an abbreviation written out in full
    if (o == nullptr && is_long) {
      name = resolve_abbreviation(app, a, name);
      o = app.get_option_no_throw(name);
      if (o != nullptr) as_given = name + (eq == std::string::npos ? "" : a.substr(eq));
    }
    if (o != nullptr) out.spelled[o->get_name()] = name;
    if (o == nullptr || o->get_expected_min() == 0) {
      // An unknown option (CLI11 names it) or a flag: CLI11 takes it as is.
      if (o != nullptr) out.given.insert(o);
      emitted.emplace_back(o, as_given);
      continue;
    }
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else if (!is_long && a.size() > 2) {
      value = a.substr(a[2] == '=' ? 3 : 2);  // -r3, -r=3 (as argparse reads them)
    } else if (i + 1 < argc && looks_like_value(argv[i + 1])) {
      value = argv[++i];
    } else {
      emitted.emplace_back(o, a);  // CLI11 reports the missing value
      continue;
    }
    out.given.insert(o);
    emitted.erase(
        std::remove_if(emitted.begin(), emitted.end(), [o](const auto& e) { return e.first == o; }),
        emitted.end());
    if (value.empty()) {
      if (empty_is_unset.count(o)) continue;
      throw UsageError(name + ": the value is empty; give a value or leave the option out");
    }
    emitted.emplace_back(o, "--" + o->get_lnames().front() + "=" + value);
  }
  out.script.assign(argv + i, argv + argc);
  for (auto& e : emitted) out.options.push_back(e.second);
  return out;
}

constexpr const char* kFooter = R"(
The training script and its arguments come last and are passed through untouched.
Before the script, as torchrun's argparse allows, a long option may be shortened to a
prefix of exactly one option string (--nproc_per=4, --max-restart=3, --no-py); a prefix
of several, even of one option's two spellings (--nproc), is an "ambiguous option"
error, and an option ctorchrun does not know is an error too. A first `--`
before the script is dropped and the next argument is the script, even if it starts
with '-'. An empty value (--log_dir= or --log_dir '') unsets --log_dir, --local_addr,
--rdzv_endpoint, --rdzv_conf and --local_ranks_filter; for the others it is an error.
The script runs as `$PYTHON -u script args...` (`-m module` with --module), where
$PYTHON is $CTORCHRUN_PYTHON, else $PYTHON_EXEC, else python3 from PATH.

Every option can also be set as PET_<NAME> in the environment (PET_NPROC_PER_NODE=4),
as with torchrun; the command line wins, an empty variable counts as unset. Other
variables read: LOGLEVEL (DEBUG, INFO, WARNING, ERROR), TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (the teed
lines' prefix: ${role_name}, ${rank}, ${local_rank}), OMP_NUM_THREADS (set to 1 for
the workers when unset and nproc_per_node > 1).

Workers get torchrun's variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, TORCH_NCCL_ASYNC_ERROR_HANDLING,
and NCCL_ASYNC_ERROR_HANDLING when the workers' torch is older than 2.2 or unknown
(--no_python). TORCHELASTIC_RESTART_COUNT counts every restart of
the workers, failures and elastic re-formations alike, so it can exceed
TORCHELASTIC_MAX_RESTARTS; ours tell them apart: CTORCHRUN_FAILED_RESTARTS (charged
to --max_restarts) and CTORCHRUN_ROUND (the elastic round); the count is their sum.

Read by the agent itself, as torch's agent reads them:
  TORCHELASTIC_ENABLE_FILE_TIMER=1  serve torch's file timer (expires()) on the pipe
                                    TORCHELASTIC_TIMER_FILE (a fresh one when unset)
  TORCHELASTIC_HEALTH_CHECK_PORT=P  answer GET /healthz on port P (JSON, 200 while running)

Exit codes:
  0        all local workers succeeded
  1        workers failed and the restarts are exhausted (the summary names the rank)
  2        usage or configuration error
  3        rendezvous failed, timed out or was closed, or its store was lost mid-run
  4        store or network set-up failed (bind, connect)
  70       internal error (please report)
  75       stopped by the scheduler (under Slurm: scancel, preemption, a --signal
           warning); not a failure, a job script may requeue on it
  128+N    stopped by signal N (forwarded to the workers first; SIGTERM gives 143)
)";

// CLI11 prints "Usage: ctorchrun [OPTIONS]"; the script and its arguments
// belong there too.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] [--] SCRIPT [SCRIPT ARGS...]\n";
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
              tee = "0", master_addr = "127.0.0.1", local_addr,
              signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT", events_file, event_log_handler = "null",
              logs_specs, numa_binding, slurm = "auto";
  int node_rank = 0, master_port = 29500, max_restarts = 0;
  double monitor_interval = 0.1, shutdown_timeout = 30, exit_barrier_timeout = 300,
         hang_timeout = 0;
  std::vector<int> local_ranks_filter;
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
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto formatter = std::make_shared<UsageFormatter>();
  formatter->column_width(40);
  app.formatter(formatter);
  app.footer(std::string(kFooter) + "\n" + rdzv_conf_help());
  app.set_version_flag("--version", std::string("ctorchrun ") + CTORCHRUN_VERSION);

  // Environment fallbacks, read from `env` (CLI11's envname would read the
  // real environment): the first non-empty variable of the list applies to
  // an option the command line did not give.
  std::vector<std::pair<CLI::Option*, std::vector<std::string>>> fallbacks;
  auto with_env = [&](CLI::Option* o, const std::string& help, std::vector<std::string> env_names) {
    o->description(help + " [env: " + env_names.front() + "]");
    fallbacks.emplace_back(o, std::move(env_names));
    return o;
  };
  auto opt = [&](const std::string& names, auto& target, const std::string& env_name,
                 const std::string& help) {
    return with_env(app.add_option(names, target)->capture_default_str()->type_name(""), help,
                    {env_name});
  };
  auto flag = [&](const std::string& names, bool& target, const std::string& env_name,
                  const std::string& help) {
    return with_env(app.add_flag(names, target), help, {env_name});
  };
  CLI::Option* nnodes_opt = opt("--nnodes", nnodes, "PET_NNODES",
                                "number of nodes, N or MIN:MAX (MIN:MAX needs the c10d backend)");
  CLI::Option* nproc_opt =
      opt("--nproc-per-node,--nproc_per_node", nproc, "PET_NPROC_PER_NODE",
          "workers per node: N, cpu (one per CPU), gpu (one per GPU), auto (gpu if any, else cpu)")
          ->check(nproc_validator());
  CLI::Option* node_rank_opt =
      opt("--node-rank,--node_rank", node_rank, "PET_NODE_RANK", "rank of this node, 0..nnodes-1")
          ->check(CLI::Range(0, 1 << 20));
  CLI::Option* master_addr_opt = opt("--master-addr,--master_addr", master_addr, "PET_MASTER_ADDR",
                                     "address of node 0, which hosts the store");
  CLI::Option* master_port_opt = opt("--master-port,--master_port", master_port, "PET_MASTER_PORT",
                                     "port of the store on node 0")
                                     ->check(CLI::Range(1, 65535));
  opt("--max-restarts,--max_restarts", max_restarts, "PET_MAX_RESTARTS",
      "job-wide restarts of every worker after a failure (nodes must agree)")
      ->check(CLI::Range(0, 1 << 30));
  opt("--monitor-interval,--monitor_interval", monitor_interval, "PET_MONITOR_INTERVAL",
      "accepted for torchrun compatibility; exits are noticed as they happen")
      ->check(seconds_validator());
  opt("--rdzv-backend,--rdzv_backend", rdzv_backend, "PET_RDZV_BACKEND",
      "rendezvous backend: static; c10d (--rdzv_endpoint's store assigns the node ranks); "
      "etcd-v3 (the same, with the agents' state in an etcd cluster; etcd and etcd-v2 are "
      "taken as etcd-v3)");
  CLI::Option* endpoint_opt =
      opt("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint, "PET_RDZV_ENDPOINT",
          "HOST[:PORT] of the rendezvous store (static: defaults to master_addr:master_port)");
  CLI::Option* rdzv_id_opt =
      opt("--rdzv-id,--rdzv_id", rdzv_id, "PET_RDZV_ID", "job id shared by all nodes");
  CLI::Option* conf_opt = opt("--rdzv-conf,--rdzv_conf", rdzv_conf, "PET_RDZV_CONF",
                              "KEY=VALUE,... rendezvous and hosted-store settings (keys below)");
  CLI::Option* standalone_opt =
      flag("--standalone", standalone, "PET_STANDALONE",
           "single node on a free local port (no master_addr/port needed); --nnodes other than 1 "
           "is an error");
  opt("--start-method,--start_method", start_method, "PET_START_METHOD",
      "accepted for torchrun compatibility (spawn, fork, forkserver)")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  opt("--role", role, "PET_ROLE", "role name of the workers (ROLE_NAME, log prefix)");
  flag("-m,--module", module, "PET_MODULE", "run the script as a Python module (python -m)");
  flag("--no-python,--no_python", no_python, "PET_NO_PYTHON",
       "run the script directly as an executable, not through Python");
  flag("--run-path,--run_path", run_path, "PET_RUN_PATH",
       "accepted for torchrun compatibility: the script runs as with Python");
  CLI::Option* log_dir_opt =
      opt("--log-dir,--log_dir", log_dir, "PET_LOG_DIR",
          "directory for the workers' logs and error files (default: a temporary one, removed "
          "after success)");
  opt("-r,--redirects", redirects, "PET_REDIRECTS",
      "send worker output to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per local rank "
      "as 0:1,1:2");
  opt("-t,--tee", tee, "PET_TEE",
      "copy worker output to log files and the console, lines prefixed [<role><local_rank>]:; "
      "same syntax as --redirects");
  CLI::Option* filter_opt =
      opt("--local-ranks-filter,--local_ranks_filter", local_ranks_filter, "PET_LOCAL_RANKS_FILTER",
          "comma-separated local ranks whose output reaches the console; the others print "
          "nothing (teed streams go to their files only, the rest to /dev/null)")
          ->delimiter(',')
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
          ->check(CLI::Range(0, 1 << 20))
          ->default_str("");
  CLI::Option* local_addr_opt = opt("--local-addr,--local_addr", local_addr, "PET_LOCAL_ADDR",
                                    "this node's address as others should reach it");
  opt("--signals-to-handle,--signals_to_handle", signals, "PET_SIGNALS_TO_HANDLE",
      "signals forwarded to the workers before the launcher exits with 128+N");
  CLI::Option* event_log_handler_opt =
      opt("--event-log-handler,--event_log_handler", event_log_handler, "PET_EVENT_LOG_HANDLER",
          "null (default) or console: console prints every event record (the --events_file "
          "lines) on stderr, one JSON object per line");
  CLI::Option* logs_specs_opt =
      opt("--logs-specs,--logs_specs", logs_specs, "PET_LOGS_SPECS",
          "'default' (torchrun's own log layout) is accepted; other names are torchrun's Python "
          "plugins, which ctorchrun cannot load (exit 2)");
  CLI::Option* numa_opt =
      opt("--numa-binding,--numa_binding", numa_binding, "PET_NUMA_BINDING",
          "node, socket, exclusive or core-complex: each local rank runs on CPUs near its GPU (the "
          "i-th of CUDA_VISIBLE_DEVICES, GPUs in PCI bus order; without GPUs ranks are spread over "
          "the NUMA nodes in order) and prefers that node's memory, from sysfs");
  opt("--hang-timeout,--hang_timeout", hang_timeout, "PET_HANG_TIMEOUT",
      "seconds without progress from every worker of the job (CPU of the main thread, the "
      "process tree's CPU and I/O, output) before it is a hang: stacks to hang.txt, then a "
      "restart (0: off; README \"Hangs\")")
      ->check(seconds_validator());
  opt("--shutdown-timeout,--shutdown_timeout", shutdown_timeout, "PET_SHUTDOWN_TIMEOUT",
      "seconds between SIGTERM and SIGKILL when stopping workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
      ->check(seconds_validator());
  fallbacks.back().second.push_back("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
  opt("--exit-barrier-timeout,--exit_barrier_timeout", exit_barrier_timeout,
      "PET_EXIT_BARRIER_TIMEOUT",
      "seconds a finished node waits for nodes whose liveness is unknown; live nodes still "
      "running workers are waited for without limit (TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT)")
      ->check(seconds_validator());
  fallbacks.back().second.push_back("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT");
  opt("--events-file,--events_file", events_file, "PET_EVENTS_FILE",
      "append one JSON object per lifecycle event to this file");
  opt("--slurm", slurm, "PET_SLURM",
      "auto: as a task of a Slurm job step (srun), the values not given take the step's topology "
      "(nnodes, node_rank, master, port, rdzv_id, nproc_per_node); on: the same, and an error "
      "outside a step; off: ignore Slurm")
      ->check(CLI::IsMember({"auto", "on", "off"}));

  SplitArgs args;
  try {
    args = split_argv(app, argc, argv,
                      {log_dir_opt, local_addr_opt, endpoint_opt, conf_opt, filter_opt});
    std::vector<std::string> reversed(args.options.rbegin(), args.options.rend());
    app.parse(reversed);  // CLI11 takes them reversed

    std::set<const CLI::Option*> decided = args.given;  // by a flag or its PET_ variable
    for (auto& [o, names] : fallbacks) {
      if (args.given.count(o)) continue;
      for (const std::string& name : names) {
        auto it = env.find(name);
        if (it == env.end() || it->second.empty()) continue;
        try {
          o->add_result(it->second);
          o->run_callback();
        } catch (const CLI::Error& e) {
          throw UsageError(name + "='" + it->second + "': " + e.what());
        }
        decided.insert(o);
        break;
      }
    }
    // Where an option's value came from, as the user wrote it: its spelling
    // on the command line, else its environment variable.
    auto source = [&](const CLI::Option* o, const std::string& env_name) -> std::string {
      if (args.given.count(o) == 0) return env_name;
      auto spelled = args.spelled.find(o->get_name());
      return spelled == args.spelled.end() ? o->get_name() : spelled->second;
    };
    // Under Slurm (cli/slurm.h): what the step gives fills each value left open.
    SlurmGiven given;
    given.nnodes = decided.count(nnodes_opt) > 0;
    given.node_rank = decided.count(node_rank_opt) > 0;
    given.nproc_per_node = decided.count(nproc_opt) > 0;
    given.master_addr = decided.count(master_addr_opt) > 0;
    given.master_port = decided.count(master_port_opt) > 0;
    given.rdzv_id = decided.count(rdzv_id_opt) > 0;
    given.rdzv_endpoint = decided.count(endpoint_opt) > 0;
    given.standalone = standalone;
    SlurmTopology slurm_topology;
    bool slurm_endpoint = false;  // the c10d endpoint is the step's first host
    try {
      slurm_topology = resolve_slurm(slurm == "on"    ? SlurmMode::kOn
                                     : slurm == "off" ? SlurmMode::kOff
                                                      : SlurmMode::kAuto,
                                     given, env);
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
    if (!slurm_topology.warning.empty()) out.warnings.push_back(slurm_topology.warning);
    if (slurm_topology.active) {
      const SlurmTopology& st = slurm_topology;
      if (st.nnodes) nnodes = std::to_string(*st.nnodes);
      if (st.node_rank) node_rank = *st.node_rank;
      if (st.nproc_per_node) nproc = std::to_string(*st.nproc_per_node);
      if (st.master_addr) master_addr = *st.master_addr;
      if (st.port) master_port = *st.port;
      if (st.rdzv_id) rdzv_id = *st.rdzv_id;
      // c10d: the endpoint is the step's first host too.
      if (rdzv_backend == "c10d" && rdzv_endpoint.empty()) {
        rdzv_endpoint = rendezvous::format_endpoint(master_addr, master_port);
        slurm_endpoint = true;
      }
      out.infos.push_back(st.summary);
      c.scheduler = "slurm";
    }
    const std::vector<std::string>& rest = args.script;
    if (rest.empty())
      throw UsageError("no training script given (ctorchrun [options] [--] SCRIPT [args...])");

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
      c.nproc_per_node = std::stoi(nproc);  // the validator accepted a count
    }
    c.node_rank = node_rank;
    c.master_addr = master_addr;
    c.master_port = master_port;
    c.max_restarts = max_restarts;
    // torchrun loads --logs_specs NAME from the Python entry points of group
    // torchrun.logs_specs; torch itself registers only "default", which is
    // the layout ctorchrun writes.
    if (!logs_specs.empty() && logs_specs != "default") {
      throw UsageError(source(logs_specs_opt, "PET_LOGS_SPECS") + "=" + logs_specs +
                       ": log-spec plugins are Python entry points (group torchrun.logs_specs) "
                       "that ctorchrun cannot load; only 'default' is accepted");
    }
    if (!numa_binding.empty()) {
      c.numa_binding = worker::parse_numa_binding(numa_binding);
      if (!c.numa_binding) {
        throw UsageError(source(numa_opt, "PET_NUMA_BINDING") + "=" + numa_binding +
                         ": expected node, socket, exclusive or core-complex");
      }
      c.sysfs_root = getenv_or(env, "CTORCHRUN_SYSFS_ROOT", "/sys");
    }
    if (event_log_handler != "null" && event_log_handler != "console") {
      throw UsageError(source(event_log_handler_opt, "PET_EVENT_LOG_HANDLER") + "=" +
                       event_log_handler + ": expected null or console (torchrun's choices)");
    }
    c.events_to_console = event_log_handler == "console";

    // Rendezvous.
    c.run_id = rdzv_id;
    c.rdzv_backend = rdzv_backend;
    std::string etcd_scheme;  // of the etcd endpoints: "https", "http" or "" (none written)
    if (standalone && (c.min_nodes != 1 || c.max_nodes != 1)) {
      // torchrun would quietly run one node of a job that waits for more.
      throw UsageError(source(standalone_opt, "PET_STANDALONE") + " runs exactly one node, but " +
                       source(nnodes_opt, "PET_NNODES") + "=" + nnodes +
                       " asks for more; leave it out (or give 1), or join the nodes with "
                       "--rdzv_backend=c10d --rdzv_endpoint=HOST[:PORT]");
    }
    if (standalone) {
      // One node on a free local port until dynamic rendezvous lands.
      c.rdzv_backend = "static";
      c.min_nodes = c.max_nodes = 1;
      c.node_rank = 0;
      c.master_addr = "127.0.0.1";
      c.master_port = 0;
      c.run_id = "standalone_" + random_suffix();
    } else if (c.rdzv_backend == "etcd" || c.rdzv_backend == "etcd-v2" ||
               c.rdzv_backend == "etcd-v3") {
      // The c10d state machine, with everything the agents share in etcd.
      if (c.rdzv_backend != "etcd-v3") {
        out.notices.push_back("--rdzv_backend=" + c.rdzv_backend +
                              ": ctorchrun speaks etcd's v3 API (etcd 3.4 disables the v2 API "
                              "and 3.6 removed it); same as --rdzv_backend=etcd-v3");
        c.rdzv_backend = "etcd-v3";
      }
      if (rdzv_endpoint.empty()) {
        throw UsageError(
            "--rdzv_backend=etcd-v3 needs --rdzv_endpoint=HOST[:PORT][,HOST[:PORT]...]: the "
            "etcd members (default port 2379)");
      }
      for (CLI::Option* o : {node_rank_opt, master_addr_opt, master_port_opt}) {
        if (o->count() > 0) {
          auto spelled = args.spelled.find(o->get_name());
          out.notices.push_back((spelled == args.spelled.end() ? o->get_name() : spelled->second) +
                                " is ignored under --rdzv_backend=etcd-v3: the rendezvous in "
                                "etcd assigns node ranks and the workers' store");
        }
      }
      c.node_rank = 0;
      // Every endpoint's scheme ("" when none is written) must agree.
      std::string& scheme = etcd_scheme;
      for (std::string item : split(rdzv_endpoint, ',')) {
        if (item.empty()) continue;
        std::string this_scheme;
        if (item.rfind("https://", 0) == 0) {
          this_scheme = "https";
          item = item.substr(8);
        } else if (item.rfind("http://", 0) == 0) {
          this_scheme = "http";
          item = item.substr(7);
        } else if (item.find("://") != std::string::npos) {
          throw UsageError("--rdzv_endpoint: '" + item +
                           "': etcd is reached over http:// or https:// only");
        }
        if (!this_scheme.empty()) {
          if (!scheme.empty() && scheme != this_scheme) {
            throw UsageError("--rdzv_endpoint: '" + rdzv_endpoint + "' mixes " + scheme +
                             ":// and " + this_scheme +
                             ":// endpoints; every etcd member is reached the same way");
          }
          scheme = this_scheme;
        }
        const rendezvous::Endpoint e = endpoint_of(item, 2379);
        c.etcd_endpoints.push_back(rendezvous::format_endpoint(e.host, e.port));
      }
      if (c.etcd_endpoints.empty()) {
        throw UsageError("--rdzv_endpoint: '" + rdzv_endpoint + "' names no etcd member");
      }
      c.master_addr.clear();
      c.master_port = 0;
    } else if (c.rdzv_backend == "c10d") {
      // torchrun's dynamic rendezvous: the endpoint's store assigns the ranks.
      if (rdzv_endpoint.empty()) {
        throw UsageError(
            "--rdzv_backend=c10d needs --rdzv_endpoint=HOST[:PORT] (the same on "
            "every node), or --standalone for one node");
      }
      for (CLI::Option* o : {node_rank_opt, master_addr_opt, master_port_opt}) {
        if (o->count() > 0) {
          auto spelled = args.spelled.find(o->get_name());
          out.notices.push_back((spelled == args.spelled.end() ? o->get_name() : spelled->second) +
                                " is ignored under --rdzv_backend=c10d: the rendezvous at "
                                "--rdzv_endpoint assigns node ranks and the store");
        }
      }
      c.node_rank = 0;
      // torchrun's default port of a c10d endpoint: 29400.
      const rendezvous::Endpoint e = endpoint_of(rdzv_endpoint, 29400);
      c.rdzv_endpoint_host = e.host;
      c.rdzv_endpoint_port = e.port;
      c.master_addr.clear();
      c.master_port = 0;
    } else {
      if (c.rdzv_backend != "static") {
        throw UsageError("--rdzv_backend: unknown backend '" + c.rdzv_backend + "'");
      }
      if (c.min_nodes != c.max_nodes) {
        throw UsageError("--nnodes=" + nnodes +
                         ": a range of nodes needs dynamic rendezvous: --rdzv_backend=c10d "
                         "--rdzv_endpoint=HOST[:PORT]");
      }
      if (!rdzv_endpoint.empty()) {
        const rendezvous::Endpoint e = endpoint_of(rdzv_endpoint, c.master_port);
        c.master_addr = e.host;
        c.master_port = e.port;
      }
      if (c.node_rank >= c.max_nodes) {
        throw UsageError("--node_rank=" + std::to_string(c.node_rank) +
                         " must be below --nnodes=" + std::to_string(c.max_nodes));
      }
    }
    try {
      apply_rdzv_conf(rdzv_conf, c.rdzv_backend, &c, &out.warnings);
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
    if (slurm_endpoint && !c.is_host) c.is_host = slurm_topology.first_host;
    if (c.rdzv_backend == "etcd-v3") {
      resolve_etcd_tls(etcd_scheme, &c);
    } else {
      c.etcd_protocol.clear();
      c.etcd_cacert.clear();
      c.etcd_cert.clear();
      c.etcd_key.clear();
    }
    c.local_addr = local_addr;

    // Stopping.
    c.shutdown_timeout = seconds_to_ms(shutdown_timeout);
    c.exit_barrier_timeout = seconds_to_ms(exit_barrier_timeout);
    c.hang_timeout = seconds_to_ms(hang_timeout);
    c.signals_to_handle.clear();
    for (std::string item : split(signals, ',')) {
      item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
      if (!item.empty()) c.signals_to_handle.push_back(signal_number(item));
    }
    if (c.scheduler == "slurm") {
      // Slurm signals every process of the step itself (scancel, preemption,
      // --signal=SIG@T, srun's Ctrl-C): the workers have their copy already.
      c.scheduler_signals = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};
      for (int s : {SIGUSR1, SIGUSR2}) {
        if (std::find(c.signals_to_handle.begin(), c.signals_to_handle.end(), s) ==
            c.signals_to_handle.end()) {
          c.signals_to_handle.push_back(s);
        }
      }
    }

    // Output.
    c.log_dir = log_dir;
    parse_std_map("--redirects", redirects, &c.redirects_default, &c.redirects);
    parse_std_map("--tee", tee, &c.tee_default, &c.tee);
    if (!local_ranks_filter.empty()) c.local_ranks_filter = local_ranks_filter;
    c.events_file = events_file;
    c.log_line_prefix_template = getenv_or(env, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "");
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
      c.python = python;
      if (module) c.entrypoint.push_back("-m");
      c.entrypoint.insert(c.entrypoint.end(), rest.begin(), rest.end());
    }

    // The workers' environment: ours, with torchrun's OMP_NUM_THREADS rule.
    c.environment = env;
    if (c.nproc_per_node > 1 && env.find("OMP_NUM_THREADS") == env.end()) {
      c.environment["OMP_NUM_THREADS"] = "1";
      out.notices.push_back(kOmpNotice);
    }
  } catch (const CLI::CallForHelp&) {
    out = ParseOutcome{};
    out.kind = ParseOutcome::Kind::kExit;
    out.message = app.help();
  } catch (const CLI::CallForVersion&) {
    out = ParseOutcome{};
    out.kind = ParseOutcome::Kind::kExit;
    out.message = std::string("ctorchrun ") + CTORCHRUN_VERSION + "\n";
  } catch (const CLI::ParseError& e) {
    out = ParseOutcome{};
    out.kind = ParseOutcome::Kind::kExit;
    out.exit_code = 2;
    out.message = "ctorchrun: " + as_spelled(e.what(), args.spelled) + " (see ctorchrun --help)";
  } catch (const UsageError& e) {
    out = ParseOutcome{};
    out.kind = ParseOutcome::Kind::kExit;
    out.exit_code = 2;
    out.message = std::string("ctorchrun: ") + e.what();
  }
  return out;
}

}  // namespace ctorchrun::cli

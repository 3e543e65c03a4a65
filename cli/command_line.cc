#include "cli/command_line.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <random>
#include <set>
#include <sstream>

#include "cli/option_parser.h"
#include "cli/rdzv_conf.h"
#include "cli/slurm.h"
#include "common/error.h"
#include "rendezvous/endpoint.h"
#include "worker/cuda_devices.h"
#include "worker/numa_binding.h"

namespace ctorchrun::cli {

namespace {

constexpr const char* kOmpNotice =
    "*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
    "your system being overloaded, please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************";

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

// A random (version 4) UUID, as torchrun's uuid.uuid4() run ids.
std::string random_uuid() {
  std::random_device rd;
  unsigned char b[16];
  for (unsigned char& x : b) x = static_cast<unsigned char>(rd());
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += kHex[b[i] >> 4];
    s += kHex[b[i] & 15];
  }
  return s;
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

namespace {

// What a Slurm step filled in (cli/slurm.h).
struct SlurmFill {
  bool endpoint = false;    // the c10d endpoint is the step's first host
  bool first_host = false;  // and this node is that host
  bool port = false;        // the step gave the master port
};

// Under Slurm: what the step gives fills each value the command line and the
// environment left open.
SlurmFill apply_slurm(const std::map<std::string, std::string>& env, ParsedOptions* o,
                      ParseOutcome* out) {
  SlurmGiven given;
  given.nnodes = o->at("nnodes").given;
  given.node_rank = o->at("node_rank").given;
  given.nproc_per_node = o->at("nproc_per_node").given;
  given.master_addr = o->at("master_addr").given;
  given.master_port = o->at("master_port").given;
  given.rdzv_id = o->at("rdzv_id").given;
  given.rdzv_endpoint = o->at("rdzv_endpoint").given;
  given.standalone = o->at("standalone").flag;
  const std::string& mode = o->at("slurm").text;
  SlurmTopology st;
  try {
    st = resolve_slurm(mode == "on"    ? SlurmMode::kOn
                       : mode == "off" ? SlurmMode::kOff
                                       : SlurmMode::kAuto,
                       given, env);
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }
  if (!st.warning.empty()) out->warnings.push_back(st.warning);
  SlurmFill fill;
  if (!st.active) return fill;
  if (st.nnodes) o->at("nnodes").text = std::to_string(*st.nnodes);
  if (st.node_rank) o->at("node_rank").integer = *st.node_rank;
  if (st.nproc_per_node) o->at("nproc_per_node").text = std::to_string(*st.nproc_per_node);
  if (st.master_addr) o->at("master_addr").text = *st.master_addr;
  if (st.port) {
    o->at("master_port").integer = *st.port;
    fill.port = true;
  }
  if (st.rdzv_id) o->at("rdzv_id").text = *st.rdzv_id;
  // c10d: the endpoint is the step's first host too.
  if (o->at("rdzv_backend").text == "c10d" && o->at("rdzv_endpoint").text.empty()) {
    o->at("rdzv_endpoint").text =
        rendezvous::format_endpoint(o->at("master_addr").text, o->at("master_port").integer);
    fill.endpoint = true;
    fill.first_host = st.first_host;
  }
  out->infos.push_back(st.summary);
  out->config.scheduler = "slurm";
  return fill;
}

// --nnodes: N or MIN:MAX; a message names the whole value and the form.
void set_nnodes(const ParsedOptions& o, agent::LaunchConfig* c) {
  const std::string& nnodes = o.at("nnodes").text;
  const std::string what = o.source("nnodes") + "=" + nnodes;
  const std::vector<std::string> parts = split(nnodes, ':');
  const bool two = parts.size() == 2;
  if (parts.empty() || parts.size() > 2 || nnodes.back() == ':') {
    throw UsageError(what + ": expected N or MIN:MAX, whole numbers in [1, 1048576]");
  }
  try {
    c->min_nodes = parse_int(what, parts.front(), 1, 1 << 20);
    c->max_nodes = two ? parse_int(what, parts.back(), 1, 1 << 20) : c->min_nodes;
  } catch (const UsageError& e) {
    throw UsageError(std::string(e.what()) + "; expected N or MIN:MAX");
  }
  if (c->min_nodes > c->max_nodes) throw UsageError(what + ": MIN is greater than MAX");
}

// --nnodes (N or MIN:MAX), --nproc_per_node, the node's rank and the master.
void set_membership(const ParsedOptions& o, const std::map<std::string, std::string>& env,
                    const SlurmFill& slurm, agent::LaunchConfig* c) {
  set_nnodes(o, c);
  const std::string& nproc = o.at("nproc_per_node").text;
  int cpus = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  if (nproc == "cpu") {
    c->nproc_per_node = cpus;
  } else if (nproc == "gpu" || nproc == "cuda") {
    c->nproc_per_node = count_gpus(env);
    if (c->nproc_per_node == 0) {
      throw UsageError("--nproc_per_node=gpu: no GPU found on this machine");
    }
  } else if (nproc == "auto") {
    int gpus = count_gpus(env);
    c->nproc_per_node = gpus > 0 ? gpus : cpus;
  } else {
    c->nproc_per_node = std::stoi(nproc);  // the validator accepted a count
  }
  c->node_rank = o.at("node_rank").integer;
  c->master_addr = o.at("master_addr").text;
  // torchrun's 29500 when no port is given (set_static may take a free one).
  c->master_port = o.at("master_port").given || slurm.port ? o.at("master_port").integer : 29500;
  c->max_restarts = o.at("max_restarts").integer;
}

// --logs_specs, --numa_binding and --event_log_handler: names checked here,
// where the message can say what they mean.
void set_node_features(const ParsedOptions& o, const std::map<std::string, std::string>& env,
                       agent::LaunchConfig* c) {
  // torchrun loads --logs_specs NAME from the Python entry points of group
  // torchrun.logs_specs; torch itself registers only "default", which is
  // the layout ctorchrun writes.
  const std::string& logs_specs = o.at("logs_specs").text;
  if (!logs_specs.empty() && logs_specs != "default") {
    throw UsageError(o.source("logs_specs") + "=" + logs_specs +
                     ": log-spec plugins are Python entry points (group torchrun.logs_specs) "
                     "that ctorchrun cannot load; only 'default' is accepted");
  }
  const std::string& numa = o.at("numa_binding").text;
  if (!numa.empty()) {
    c->numa_binding = worker::parse_numa_binding(numa);
    if (!c->numa_binding) {
      throw UsageError(o.source("numa_binding") + "=" + numa +
                       ": expected node, socket, exclusive or core-complex");
    }
    c->sysfs_root = getenv_or(env, "CTORCHRUN_SYSFS_ROOT", "/sys");
    c->proc_root = getenv_or(env, "CTORCHRUN_PROC_ROOT", "/proc");
  }
  const std::string& handler = o.at("event_log_handler").text;
  if (handler != "null" && handler != "console") {
    throw UsageError(o.source("event_log_handler") + "=" + handler +
                     ": expected null or console (torchrun's choices)");
  }
  c->events_to_console = handler == "console";
}

// node_rank, master_addr and master_port given to a backend that assigns
// them: a notice each.
void notice_ignored(const ParsedOptions& o, const std::string& backend, const std::string& why,
                    ParseOutcome* out) {
  for (const char* key : {"node_rank", "master_addr", "master_port"}) {
    if (o.at(key).given) {
      out->notices.push_back(o.name(key) + " is ignored under --rdzv_backend=" + backend + ": " +
                             why);
    }
  }
}

// The etcd members of --rdzv_endpoint; returns their scheme ("https",
// "http" or "" when none is written), which every member shares.
std::string set_etcd_endpoints(const std::string& rdzv_endpoint, agent::LaunchConfig* c) {
  std::string scheme;
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
        throw UsageError("--rdzv_endpoint: '" + rdzv_endpoint + "' mixes " + scheme + ":// and " +
                         this_scheme + ":// endpoints; every etcd member is reached the same way");
      }
      scheme = this_scheme;
    }
    const rendezvous::Endpoint e = endpoint_of(item, 2379);
    c->etcd_endpoints.push_back(rendezvous::format_endpoint(e.host, e.port));
  }
  if (c->etcd_endpoints.empty()) {
    throw UsageError("--rdzv_endpoint: '" + rdzv_endpoint + "' names no etcd member");
  }
  return scheme;
}

// --rdzv_backend=etcd-v3 (etcd and etcd-v2 too): the c10d state machine, with
// everything the agents share in etcd. Returns the endpoints' scheme.
std::string set_etcd(const ParsedOptions& o, ParseOutcome* out) {
  agent::LaunchConfig& c = out->config;
  if (c.rdzv_backend != "etcd-v3") {
    out->notices.push_back("--rdzv_backend=" + c.rdzv_backend +
                           ": ctorchrun speaks etcd's v3 API (etcd 3.4 disables the v2 API "
                           "and 3.6 removed it); same as --rdzv_backend=etcd-v3");
    c.rdzv_backend = "etcd-v3";
  }
  const std::string& endpoint = o.at("rdzv_endpoint").text;
  if (endpoint.empty()) {
    throw UsageError(
        "--rdzv_backend=etcd-v3 needs --rdzv_endpoint=HOST[:PORT][,HOST[:PORT]...]: the "
        "etcd members (default port 2379)");
  }
  notice_ignored(o, "etcd-v3", "the rendezvous in etcd assigns node ranks and the workers' store",
                 out);
  c.node_rank = 0;
  std::string scheme = set_etcd_endpoints(endpoint, &c);
  c.master_addr.clear();
  c.master_port = 0;
  return scheme;
}

// --rdzv_backend=c10d: torchrun's dynamic rendezvous, the endpoint's store
// assigns the ranks.
void set_c10d(const ParsedOptions& o, ParseOutcome* out) {
  agent::LaunchConfig& c = out->config;
  const std::string& endpoint = o.at("rdzv_endpoint").text;
  if (endpoint.empty()) {
    throw UsageError(
        "--rdzv_backend=c10d needs --rdzv_endpoint=HOST[:PORT] (the same on "
        "every node), or --standalone for one node");
  }
  notice_ignored(o, "c10d", "the rendezvous at --rdzv_endpoint assigns node ranks and the store",
                 out);
  c.node_rank = 0;
  // torchrun's default port of a c10d endpoint: 29400.
  const rendezvous::Endpoint e = endpoint_of(endpoint, 29400);
  c.rdzv_endpoint_host = e.host;
  c.rdzv_endpoint_port = e.port;
  c.master_addr.clear();
  c.master_port = 0;
}

// --rdzv_backend=static: node 0 hosts the store at the master's address.
void set_static(const ParsedOptions& o, const SlurmFill& slurm, agent::LaunchConfig* c) {
  if (c->rdzv_backend != "static") {
    throw UsageError("--rdzv_backend: unknown backend '" + c->rdzv_backend + "'");
  }
  if (c->min_nodes != c->max_nodes) {
    throw UsageError("--nnodes=" + o.at("nnodes").text +
                     ": a range of nodes needs dynamic rendezvous: --rdzv_backend=c10d "
                     "--rdzv_endpoint=HOST[:PORT]");
  }
  const std::string& endpoint = o.at("rdzv_endpoint").text;
  if (!endpoint.empty()) {
    const rendezvous::Endpoint e = endpoint_of(endpoint, c->master_port);
    c->master_addr = e.host;
    c->master_port = e.port;
  }
  if (c->node_rank >= c->max_nodes) {
    throw UsageError("--node_rank=" + std::to_string(c->node_rank) +
                     " must be below --nnodes=" + std::to_string(c->max_nodes));
  }
  // torch main's torchrun: a single-node job given no port (no --master_port,
  // PET_MASTER_PORT or endpoint) takes a free one, so that any number of them
  // share a machine, and a fresh run id unless one is given.
  if (endpoint.empty() && !o.at("master_port").given && !slurm.port && c->max_nodes == 1) {
    c->master_port = 0;
    if (!o.at("rdzv_id").given) c->run_id = random_uuid();
  }
}

// --standalone: one node on a free local port.
void set_standalone(const ParsedOptions& o, agent::LaunchConfig* c) {
  if (c->min_nodes != 1 || c->max_nodes != 1) {
    // torchrun would quietly run one node of a job that waits for more.
    throw UsageError(o.source("standalone") + " runs exactly one node, but " + o.source("nnodes") +
                     "=" + o.at("nnodes").text +
                     " asks for more; leave it out (or give 1), or join the nodes with "
                     "--rdzv_backend=c10d --rdzv_endpoint=HOST[:PORT]");
  }
  c->rdzv_backend = "static";
  c->min_nodes = c->max_nodes = 1;
  c->node_rank = 0;
  c->master_addr = "127.0.0.1";
  c->master_port = 0;
  c->run_id = "standalone_" + random_suffix();
}

// The backend, its endpoint and --rdzv_conf.
// --status_host and --status_port: the agent's HTTP endpoints bind an IP
// address, which is checked here so that a typo is a usage error, not a
// warning once the job runs.
void set_status(const ParsedOptions& o, agent::LaunchConfig* c) {
  c->status_host = o.at("status_host").text;
  const std::string host = rendezvous::strip_brackets(c->status_host);
  in6_addr any{};
  if (::inet_pton(AF_INET, host.c_str(), &any) != 1 &&
      ::inet_pton(AF_INET6, host.c_str(), &any) != 1) {
    throw UsageError(o.name("status_host") + ": '" + c->status_host +
                     "' is no IP address (0.0.0.0, ::, 127.0.0.1 or one of this host's)");
  }
  c->status_host = host;
  if (o.at("status_port").given) c->status_port = o.at("status_port").integer;
}

void set_rendezvous(const ParsedOptions& o, const SlurmFill& slurm, ParseOutcome* out) {
  agent::LaunchConfig& c = out->config;
  c.run_id = o.at("rdzv_id").text;
  c.rdzv_backend = o.at("rdzv_backend").text;
  std::string etcd_scheme;  // of the etcd endpoints: "https", "http" or "" (none written)
  if (o.at("standalone").flag) {
    set_standalone(o, &c);
  } else if (c.rdzv_backend == "etcd" || c.rdzv_backend == "etcd-v2" ||
             c.rdzv_backend == "etcd-v3") {
    etcd_scheme = set_etcd(o, out);
  } else if (c.rdzv_backend == "c10d") {
    set_c10d(o, out);
  } else {
    set_static(o, slurm, &c);
  }
  try {
    apply_rdzv_conf(o.at("rdzv_conf").text, c.rdzv_backend, &c, &out->warnings);
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }
  if (slurm.endpoint && !c.is_host) c.is_host = slurm.first_host;
  if (c.rdzv_backend == "etcd-v3") {
    resolve_etcd_tls(etcd_scheme, &c);
  } else {
    c.etcd_protocol.clear();
    c.etcd_cacert.clear();
    c.etcd_cert.clear();
    c.etcd_key.clear();
  }
  c.local_addr = o.at("local_addr").text;
  set_status(o, &c);
}

// TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT, read as torch main reads it:
// seconds; unset, not positive or not a number is off (the last with a
// warning, where torch is silent).
std::chrono::milliseconds uninterruptible_state_timeout(
    const std::map<std::string, std::string>& env, std::vector<std::string>* warnings) {
  const std::string text = getenv_or(env, "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "");
  if (text.empty()) return std::chrono::milliseconds(0);
  double seconds = 0;
  if (parse_seconds(text, 0, false, kMaxSeconds, &seconds)) return seconds_to_ms(seconds);
  double negative = 0;
  if (!parse_seconds(text.substr(text[0] == '-' ? 1 : 0), 0, false, kMaxSeconds, &negative)) {
    warnings->push_back("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT='" + text +
                        "' is not seconds; the uninterruptible-state check is off");
  }
  return std::chrono::milliseconds(0);
}

// Timeouts and the signals forwarded to the workers.
void set_stopping(const ParsedOptions& o, const std::map<std::string, std::string>& env,
                  std::vector<std::string>* warnings, agent::LaunchConfig* c) {
  c->shutdown_timeout = seconds_to_ms(o.at("shutdown_timeout").seconds);
  c->exit_barrier_timeout = seconds_to_ms(o.at("exit_barrier_timeout").seconds);
  c->hang_timeout = seconds_to_ms(o.at("hang_timeout").seconds);
  c->uninterruptible_state_timeout = uninterruptible_state_timeout(env, warnings);
  c->signals_to_handle.clear();
  for (std::string item : split(o.at("signals_to_handle").text, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    if (!item.empty()) c->signals_to_handle.push_back(signal_number(item));
  }
  if (c->scheduler == "slurm") {
    // Slurm signals every process of the step itself (scancel, preemption,
    // --signal=SIG@T, srun's Ctrl-C): the workers have their copy already.
    c->scheduler_signals = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};
    // Unless Slurm tracks the task by its process group alone.
    c->scheduler_reaches_workers = slurm_signals_reach_workers(read_slurm_conf(env));
    for (int s : {SIGUSR1, SIGUSR2}) {
      if (std::find(c->signals_to_handle.begin(), c->signals_to_handle.end(), s) ==
          c->signals_to_handle.end()) {
        c->signals_to_handle.push_back(s);
      }
    }
  }
}

// torch main's comma_separated_list: items split at ',', ",," a comma in one.
std::vector<std::string> filter_list(const std::string& text) {
  if (text.empty()) return {};
  std::vector<std::string> items(1);
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != ',') {
      items.back() += text[i];
    } else if (i + 1 < text.size() && text[i + 1] == ',') {
      items.back() += ',';
      ++i;
    } else {
      items.emplace_back();
    }
  }
  return items;
}

// Logs, redirects, tee and the console filter.
void set_output(const ParsedOptions& o, const std::map<std::string, std::string>& env,
                agent::LaunchConfig* c) {
  c->log_dir = o.at("log_dir").text;
  parse_std_map("--redirects", o.at("redirects").text, &c->redirects_default, &c->redirects);
  parse_std_map("--tee", o.at("tee").text, &c->tee_default, &c->tee);
  const std::vector<int>& filter = o.at("local_ranks_filter").list;
  if (!filter.empty()) c->local_ranks_filter = filter;
  c->events_file = o.at("events_file").text;
  c->duplicate_stdout_filters = filter_list(o.at("duplicate_stdout_filters").text);
  c->duplicate_stderr_filters = filter_list(o.at("duplicate_stderr_filters").text);
  // torch main: the option, else TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE.
  const std::string& prefix = o.at("log_line_prefix_template").text;
  c->log_line_prefix_template =
      prefix.empty() ? getenv_or(env, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "") : prefix;
  c->role = o.at("role").text;
}

// --virtual_local_rank needs a device of CUDA_VISIBLE_DEVICES (when set) for
// every local rank; torchrun fails the same way when it starts the workers.
void check_virtual_local_rank(const std::map<std::string, std::string>& env,
                              const agent::LaunchConfig& c) {
  auto cvd = env.find("CUDA_VISIBLE_DEVICES");
  if (!c.virtual_local_rank || cvd == env.end()) return;
  const size_t devices = worker::cuda_visible_entries(cvd->second).size();
  if (static_cast<size_t>(c.nproc_per_node) > devices) {
    throw UsageError("--virtual_local_rank: local_rank " + std::to_string(devices) +
                     " exceeds available GPUs in CUDA_VISIBLE_DEVICES=" + cvd->second + " (" +
                     std::to_string(c.nproc_per_node) + " workers per node)");
  }
}

// --run_path: the script runs in this interpreter with runpy.run_path, as
// torchrun's run_script_path does, wrapped in torch's @record when torch is
// there (an uncaught exception's traceback reaches the error file and the
// summary), and the worker ends as torchrun's multiprocessing child does:
// non-daemon threads joined, atexit handlers run, the streams flushed, then
// os._exit, so that no interpreter finalization (where torch 2.x's gloo
// threads can race Python's shutdown and abort) follows. SystemExit is
// taken as Python takes it.
constexpr const char* kRunPathBootstrap = R"(import os, runpy, sys, threading
sys.argv = sys.argv[1:]
code = 0
try:
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except Exception:
        record = lambda f: f
    record(lambda: runpy.run_path(sys.argv[0], run_name="__main__"))()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if not isinstance(e.code, int) and e.code is not None:
        print(e.code, file=sys.stderr)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 1
try:
    threading._shutdown()
except Exception:
    pass
import atexit
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except Exception:
        pass
os._exit(code & 0xFF)
)";

// What each worker runs, and its environment.
void set_program(const ParsedOptions& o, const std::map<std::string, std::string>& env,
                 ParseOutcome* out) {
  agent::LaunchConfig& c = out->config;
  const std::vector<std::string>& rest = o.script;
  const bool module = o.at("module").flag, no_python = o.at("no_python").flag;
  if (module && no_python) {
    throw UsageError("--module and --no_python cannot be used together");
  }
  c.entrypoint_name = rest[0];
  if (no_python && !o.at("run_path").flag) {
    c.entrypoint = rest;
  } else {
    std::string python =
        getenv_or(env, "CTORCHRUN_PYTHON", getenv_or(env, "PYTHON_EXEC", "python3"));
    c.entrypoint = {python, "-u"};
    c.python = python;
    if (o.at("run_path").flag) {
      c.entrypoint.insert(c.entrypoint.end(), {"-c", kRunPathBootstrap});
    } else if (module) {
      c.entrypoint.push_back("-m");
    }
    c.entrypoint.insert(c.entrypoint.end(), rest.begin(), rest.end());
  }
  c.virtual_local_rank = o.at("virtual_local_rank").flag;
  c.cpu_backend = o.at("cpu_backend").text;
  if (c.cpu_backend != "gloo" && c.python.empty()) {
    out->notices.push_back(o.source("cpu_backend") + "=" + c.cpu_backend +
                           " is for Python workers; with --no_python the program chooses its own "
                           "collectives (libctorch_dist for C++ workers)");
  }
  check_virtual_local_rank(env, c);
  // The workers' environment: ours, with torchrun's OMP_NUM_THREADS rule.
  c.environment = env;
  if (c.nproc_per_node > 1 && env.find("OMP_NUM_THREADS") == env.end()) {
    c.environment["OMP_NUM_THREADS"] = "1";
    out->notices.push_back(kOmpNotice);
  }
}

ParseOutcome exit_with(int code, std::string message) {
  ParseOutcome out;
  out.kind = ParseOutcome::Kind::kExit;
  out.exit_code = code;
  out.message = std::move(message);
  return out;
}

}  // namespace

ParseOutcome parse_command_line(int argc, const char* const* argv,
                                const std::map<std::string, std::string>& env) {
  ParseOutcome out;
  try {
    ParsedOptions o = parse_options(argc, argv, env);
    if (o.exit_now) return exit_with(0, o.exit_message);
    const SlurmFill slurm = apply_slurm(env, &o, &out);
    if (o.script.empty()) {
      throw UsageError("no training script given (ctorchrun [options] [--] SCRIPT [args...])");
    }
    set_membership(o, env, slurm, &out.config);
    set_node_features(o, env, &out.config);
    set_rendezvous(o, slurm, &out);
    set_stopping(o, env, &out.warnings, &out.config);
    set_output(o, env, &out.config);
    set_program(o, env, &out);
  } catch (const UsageError& e) {
    return exit_with(2, std::string("ctorchrun: ") + e.what());
  }
  return out;
}

}  // namespace ctorchrun::cli

#include "cli/option_table.h"

#include <algorithm>
#include <cctype>

#include "common/error.h"

namespace ctorchrun::cli {

namespace {

using V = ValueType;

// A row with torchrun's environment fallback PET_<KEY>.
OptionRow row(std::string key, std::string names, ValueType type, std::string default_text,
              std::string help) {
  OptionRow r;
  std::string pet = "PET_" + key;
  std::transform(pet.begin(), pet.end(), pet.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  r.key = std::move(key);
  r.names = std::move(names);
  r.type = type;
  r.default_text = std::move(default_text);
  r.help = std::move(help);
  r.env.push_back(std::move(pet));
  return r;
}

std::vector<OptionRow> membership_rows() {
  return {
      row("nnodes", "--nnodes", V::kText, "1:1",
          "number of nodes, N or MIN:MAX (MIN:MAX needs the c10d backend)")
          .since("1.13"),
      row("nproc_per_node", "--nproc-per-node,--nproc_per_node", V::kText, "1",
          "workers per node: N, cpu (one per CPU), gpu (one per GPU), auto (gpu if any, else cpu)")
          .with_choices({"auto", "cpu", "gpu"}, false)
          .counting_workers()
          .since("1.13"),
      row("node_rank", "--node-rank,--node_rank", V::kInteger, "0",
          "rank of this node, 0..nnodes-1")
          .with_range(0, 1 << 20)
          .since("1.13"),
      row("master_addr", "--master-addr,--master_addr", V::kText, "127.0.0.1",
          "address of node 0, which hosts the store")
          .since("1.13"),
      row("master_port", "--master-port,--master_port", V::kInteger, "",
          "port of the store on node 0; without one a single-node job (static, no "
          "--rdzv_endpoint) takes a free port, as torch main's torchrun does, and others 29500")
          .with_range(1, 65535)
          .since("1.13"),
      row("max_restarts", "--max-restarts,--max_restarts", V::kInteger, "0",
          "job-wide restarts of every worker after a failure (nodes must agree)")
          .with_range(0, 1 << 30)
          .since("1.13"),
      row("monitor_interval", "--monitor-interval,--monitor_interval", V::kSeconds, "0.1",
          "accepted for torchrun compatibility; exits are noticed as they happen")
          .since("1.13"),
  };
}

std::vector<OptionRow> rendezvous_rows() {
  return {
      row("rdzv_backend", "--rdzv-backend,--rdzv_backend", V::kText, "static",
          "rendezvous backend: static; c10d (--rdzv_endpoint's store assigns the node ranks); "
          "etcd-v3 (the same, with the agents' state in an etcd cluster; etcd and etcd-v2 are "
          "taken as etcd-v3)")
          .with_choices({"static", "c10d", "etcd-v3"}, false)
          .since("1.13"),
      row("rdzv_endpoint", "--rdzv-endpoint,--rdzv_endpoint", V::kText, "",
          "HOST[:PORT] of the rendezvous store (static: defaults to master_addr:master_port)")
          .unset_by_empty()
          .since("1.13"),
      row("rdzv_id", "--rdzv-id,--rdzv_id", V::kText, "none", "job id shared by all nodes")
          .since("1.13"),
      row("rdzv_conf", "--rdzv-conf,--rdzv_conf", V::kText, "",
          "KEY=VALUE,... rendezvous and hosted-store settings (keys below)")
          .unset_by_empty()
          .since("1.13"),
      row("standalone", "--standalone", V::kFlag, "",
          "single node on a free local port (no master_addr/port needed); --nnodes other than 1 "
          "is an error")
          .since("1.13"),
  };
}

std::vector<OptionRow> program_rows() {
  return {
      row("start_method", "--start-method,--start_method", V::kText, "spawn",
          "accepted for torchrun compatibility (spawn, fork, forkserver)")
          .with_choices({"spawn", "fork", "forkserver"}, true)
          .since("1.13"),
      row("role", "--role", V::kText, "default", "role name of the workers (ROLE_NAME, log prefix)")
          .since("1.13"),
      row("module", "-m,--module", V::kFlag, "", "run the script as a Python module (python -m)")
          .since("1.13"),
      row("no_python", "--no-python,--no_python", V::kFlag, "",
          "run the script directly as an executable, not through Python")
          .since("1.13"),
      row("virtual_local_rank", "--virtual-local-rank,--virtual_local_rank", V::kFlag, "",
          "every worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES narrowed to its own device "
          "(the local_rank-th entry of the launcher's, UUID and MIG entries too), so that it "
          "sees its GPU as device 0; --numa_binding still binds by the real device")
          .since("main"),
      row("run_path", "--run-path,--run_path", V::kFlag, "",
          "run the script with runpy.run_path as torchrun does (before --no_python and "
          "--module): its traceback reaches the summary through torch's @record, and the worker "
          "ends with os._exit once its threads and atexit handlers are done")
          .since("1.13"),
  };
}

std::vector<OptionRow> output_rows() {
  return {
      row("log_dir", "--log-dir,--log_dir", V::kText, "",
          "directory for the workers' logs and error files (default: a temporary one, removed "
          "after success)")
          .unset_by_empty()
          .completing(Completion::kDirectory)
          .since("1.13"),
      row("redirects", "-r,--redirects", V::kText, "0",
          "send worker output to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
          "rank as 0:1,1:2")
          .with_choices({"0", "1", "2", "3"}, false)
          .since("1.13"),
      row("tee", "-t,--tee", V::kText, "0",
          "copy worker output to log files and the console, lines prefixed "
          "[<role><local_rank>]:; same syntax as --redirects")
          .with_choices({"0", "1", "2", "3"}, false)
          .since("1.13"),
      row("duplicate_stdout_filters", "--duplicate-stdout-filters,--duplicate_stdout_filters",
          V::kText, "",
          "comma-separated substrings (,, is a comma): a teed stdout line holding any of them "
          "also goes to filtered_stdout.log in the attempt's log directory")
          .unset_by_empty()
          .since("main"),
      row("duplicate_stderr_filters", "--duplicate-stderr-filters,--duplicate_stderr_filters",
          V::kText, "", "the same for teed stderr lines, to filtered_stderr.log")
          .unset_by_empty()
          .since("main"),
      row("log_line_prefix_template", "--log-line-prefix-template,--log_line_prefix_template",
          V::kText, "",
          "prefix of each teed console line: ${role_name}, ${rank}, ${local_rank}, ${hostname} "
          "(gethostname(), not the fully qualified name) are replaced (default "
          "[${role_name}${local_rank}]:; beats "
          "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)")
          .unset_by_empty()
          .since("main"),
      row("local_ranks_filter", "--local-ranks-filter,--local_ranks_filter", V::kIntegerList, "",
          "comma-separated local ranks whose output reaches the console; the others print "
          "nothing (teed streams go to their files only, the rest to /dev/null)")
          .with_range(0, 1 << 20)
          .unset_by_empty()
          .since("2.6"),
  };
}

std::vector<OptionRow> node_rows() {
  return {
      row("local_addr", "--local-addr,--local_addr", V::kText, "",
          "this node's address as others should reach it")
          .unset_by_empty()
          .since("2.6"),
      row("signals_to_handle", "--signals-to-handle,--signals_to_handle", V::kText,
          "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
          "signals forwarded to the workers before the launcher exits with 128+N")
          .since("main"),
      row("event_log_handler", "--event-log-handler,--event_log_handler", V::kText, "null",
          "null (default) or console: console prints every event record (the --events_file "
          "lines) on stderr, one JSON object per line")
          .with_choices({"null", "console"}, false)
          .since("main"),
      row("logs_specs", "--logs-specs,--logs_specs", V::kText, "",
          "'default' (torchrun's own log layout) is accepted; other names are torchrun's Python "
          "plugins, which ctorchrun cannot load (exit 2)")
          .with_choices({"default"}, false)
          .since("2.6"),
      row("numa_binding", "--numa-binding,--numa_binding", V::kText, "",
          "node, socket, exclusive or core-complex: each local rank runs on CPUs near its GPU (the "
          "i-th entry of CUDA_VISIBLE_DEVICES, an index, GPU UUID or MIG instance, among the GPUs "
          "this process sees; without GPUs ranks are spread over the NUMA nodes in order), within "
          "the launcher's own CPUs, and prefers that node's memory, from sysfs")
          .with_choices({"node", "socket", "exclusive", "core-complex"}, false)
          .since("main"),
  };
}

std::vector<OptionRow> own_rows() {
  std::vector<OptionRow> rows = {
      row("hang_timeout", "--hang-timeout,--hang_timeout", V::kSeconds, "0",
          "seconds without progress from every worker of the job (CPU of the main thread, the "
          "process tree's CPU and I/O, output) before it is a hang: stacks to hang.txt, then a "
          "restart (0: off; README \"Hangs\")"),
      row("shutdown_timeout", "--shutdown-timeout,--shutdown_timeout", V::kSeconds, "30",
          "seconds between SIGTERM and SIGKILL when stopping workers "
          "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
          .with_env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
          .since("main"),
      row("exit_barrier_timeout", "--exit-barrier-timeout,--exit_barrier_timeout", V::kSeconds,
          "300",
          "seconds a finished node waits for nodes whose liveness is unknown; live nodes still "
          "running workers are waited for without limit (TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT)")
          .with_env("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT"),
      row("events_file", "--events-file,--events_file", V::kText, "",
          "append one JSON object per lifecycle event to this file")
          .completing(Completion::kFile),
      row("cpu_backend", "--cpu-backend,--cpu_backend", V::kText, "gloo",
          "gloo, or ctorch: an unmodified script's gloo process groups "
          "(init_process_group(\"gloo\"), "
          "new_group, torch 2.x's default CPU backend) run on the bundled runtime (shared memory "
          "on a host) for CPU tensors, while dist.get_backend() still answers gloo; a start-up "
          "hook first on the workers' PYTHONPATH does it and then runs any other sitecustomize "
          "(README \"Unmodified scripts on ctorch\")")
          .with_choices({"gloo", "ctorch"}, true),
      row("status_port", "--status-port,--status_port", V::kInteger, "",
          "serve the agent's view of the job on this port: GET /metrics (Prometheus), /status "
          "(JSON), / (a live page), /healthz and /readyz; 0 picks a free port (logged); off "
          "when not given (README \"Observability\")")
          .with_range(0, 65535),
      row("status_host", "--status-host,--status_host", V::kText, "0.0.0.0",
          "address the agent's HTTP endpoints bind (--status_port's, and "
          "TORCHELASTIC_HEALTH_CHECK_PORT's /healthz, the agent alive, and /readyz, the workers "
          "running); 127.0.0.1 keeps them to this host"),
      row("slurm", "--slurm", V::kText, "auto",
          "auto: as a task of a Slurm job step (srun), the values not given take the step's "
          "topology (nnodes, node_rank, master, port, rdzv_id, nproc_per_node); on: the same, "
          "and an error outside a step; off: ignore Slurm")
          .with_choices({"auto", "on", "off"}, true),
      row("print_completion", "--print-completion,--print_completion", V::kText, "",
          "print a completion script for bash, zsh or tcsh (every option of this list) and "
          "exit; README \"Shell completion\" says where to put it")
          .with_choices({"bash", "zsh", "tcsh"}, true)
          .without_env()
          .since("main"),
  };
  return rows;
}

std::vector<OptionRow> make_table() {
  std::vector<OptionRow> table;
  for (auto part :
       {membership_rows, rendezvous_rows, program_rows, output_rows, node_rows, own_rows}) {
    for (OptionRow& r : part()) table.push_back(std::move(r));
  }
  for (OptionRow& r : table) {
    if (!r.choices.empty() && r.completion == Completion::kNothing) {
      r.completion = Completion::kChoices;
    }
  }
  return table;
}

// A table cell: '|' would end it, a newline the row.
std::string cell(std::string s) {
  std::string out;
  for (char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n')
      out += ' ';
    else
      out += c;
  }
  return out;
}

}  // namespace

OptionRow& OptionRow::with_env(std::string name) {
  env.push_back(std::move(name));
  return *this;
}

OptionRow& OptionRow::with_choices(std::vector<std::string> values, bool checked) {
  choices = std::move(values);
  check_choices = checked;
  return *this;
}

OptionRow& OptionRow::counting_workers() {
  nproc_check = true;
  return *this;
}

OptionRow& OptionRow::with_range(int lo, int hi) {
  min = lo;
  max = hi;
  return *this;
}

OptionRow& OptionRow::completing(Completion c) {
  completion = c;
  return *this;
}

OptionRow& OptionRow::without_env() {
  env.clear();
  return *this;
}

OptionRow& OptionRow::unset_by_empty() {
  empty_unsets = true;
  return *this;
}

OptionRow& OptionRow::since(std::string torchrun_version) {
  torchrun = std::move(torchrun_version);
  return *this;
}

std::vector<std::string> OptionRow::long_names() const {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= names.size()) {
    size_t comma = names.find(',', start);
    if (comma == std::string::npos) comma = names.size();
    std::string name = names.substr(start, comma - start);
    if (name.rfind("--", 0) == 0) out.push_back(name);
    start = comma + 1;
  }
  return out;
}

std::string OptionRow::short_name() const {
  if (names.size() >= 2 && names[0] == '-' && names[1] != '-') return names.substr(0, 2);
  return "";
}

const std::vector<OptionRow>& option_table() {
  static const std::vector<OptionRow> table = make_table();
  return table;
}

const OptionRow& option_row(std::string_view key) {
  for (const OptionRow& r : option_table()) {
    if (r.key == key) return r;
  }
  throw InternalError("no command-line option '" + std::string(key) + "' in cli/option_table");
}

std::string options_markdown() {
  std::string out =
      "| option | environment | default | torchrun | meaning |\n"
      "| --- | --- | --- | --- | --- |\n";
  for (const OptionRow& r : option_table()) {
    std::string spellings;
    if (!r.short_name().empty()) spellings = "`" + r.short_name() + "`";
    for (const std::string& n : r.long_names()) {
      spellings += (spellings.empty() ? "`" : ", `") + n + "`";
    }
    std::string env;
    for (const std::string& e : r.env) env += (env.empty() ? "`" : ", `") + e + "`";
    const std::string dflt = r.default_text.empty() ? "" : "`" + r.default_text + "`";
    const std::string since = r.torchrun.empty() ? "ctorchrun only" : r.torchrun;
    out += "| " + spellings + " | " + env + " | " + cell(dflt) + " | " + since + " | " +
           cell(r.help) + " |\n";
  }
  return out;
}

}  // namespace ctorchrun::cli

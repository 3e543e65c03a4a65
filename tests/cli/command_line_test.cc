// The command line: torchrun's options in both spellings, PET_ fallbacks,
// the script passed through untouched, and one clear line for bad input.

#include "cli/command_line.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>

#include "cli/rdzv_conf.h"
#include "tests/cli/parse_support.h"
#include "tests/support/process.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using cli::ParseOutcome;

namespace {

void require_usage_error(const std::vector<std::string>& args, const std::string& fragment) {
  auto r = parse(args);
  INFO("args: " << Catch::Detail::stringify(args) << " message: " << r.message);
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find(fragment) != std::string::npos);
  CHECK(r.message.find('\n') == std::string::npos);  // one line
}

}  // namespace

TEST_CASE("command line: torchrun's options in both spellings, script args untouched", "[unit]") {
  for (const char* spelling : {"--nproc_per_node=4", "--nproc-per-node=4"}) {
    auto r = parse({spelling, "--max_restarts", "2", "--master-port=1234", "train.py", "--epochs",
                    "10", "--nproc_per_node=9"});
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    CHECK(r.config.nproc_per_node == 4);
    CHECK(r.config.max_restarts == 2);
    CHECK(r.config.master_port == 1234);
    CHECK(r.config.entrypoint == std::vector<std::string>{"/usr/bin/python3", "-u", "train.py",
                                                          "--epochs", "10", "--nproc_per_node=9"});
    CHECK(r.config.entrypoint_name == "train.py");
  }
}

TEST_CASE("command line: --no_python, -m and the interpreter choice", "[unit]") {
  auto r = parse({"--no_python", "./trainer", "-x"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.entrypoint == std::vector<std::string>{"./trainer", "-x"});
  r = parse({"-m", "pkg.mod", "a"});
  CHECK(r.config.entrypoint ==
        std::vector<std::string>{"/usr/bin/python3", "-u", "-m", "pkg.mod", "a"});
  r = parse({"s.py"}, {{"PYTHON_EXEC", "/opt/py"}, {"CTORCHRUN_PYTHON", ""}});
  CHECK(r.config.entrypoint.front() == "/opt/py");
  r = parse({"s.py"}, {{"PYTHON_EXEC", "/opt/py"}, {"CTORCHRUN_PYTHON", "/my/py"}});
  CHECK(r.config.entrypoint.front() == "/my/py");
  r = parse({"s.py"}, {{"CTORCHRUN_PYTHON", ""}});
  CHECK(r.config.entrypoint.front() == "python3");
}

TEST_CASE("command line: PET_ variables are fallbacks, the command line wins", "[unit]") {
  auto r = parse({"s.py"}, {{"PET_NPROC_PER_NODE", "3"}, {"PET_MASTER_PORT", "4321"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.nproc_per_node == 3);
  CHECK(r.config.master_port == 4321);
  r = parse({"--nproc_per_node=2", "s.py"}, {{"PET_NPROC_PER_NODE", "3"}});
  CHECK(r.config.nproc_per_node == 2);
}

TEST_CASE("command line: nodes, endpoint, rdzv_conf, redirects, tee, filter", "[unit]") {
  auto r = parse({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=10.0.0.5:29400", "--rdzv_id=job7",
                  "--rdzv_conf=timeout=5,read_timeout=60", "--redirects=0:1,1:2", "-t", "3",
                  "--local_ranks_filter=0,2", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  const auto& c = r.config;
  CHECK(c.nnodes() == 2);
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "10.0.0.5");
  CHECK(c.master_port == 29400);
  CHECK(c.run_id == "job7");
  CHECK(c.rdzv_timeout == std::chrono::milliseconds(5000));
  CHECK(c.redirects_for(0) == 1);
  CHECK(c.redirects_for(1) == 2);
  CHECK(c.redirects_for(5) == 0);
  CHECK(c.tee_for(7) == 3);
  REQUIRE(c.local_ranks_filter);
  CHECK(*c.local_ranks_filter == std::vector<int>{0, 2});
}

TEST_CASE("command line: OMP_NUM_THREADS=1 with torchrun's notice when nproc > 1 and unset",
          "[unit]") {
  auto r = parse({"--nproc_per_node=2", "s.py"});
  CHECK(r.config.environment.at("OMP_NUM_THREADS") == "1");
  CHECK(r.notices.size() == 1);
  r = parse({"--nproc_per_node=2", "s.py"}, {{"OMP_NUM_THREADS", "4"}});
  CHECK(r.config.environment.at("OMP_NUM_THREADS") == "4");
  CHECK(r.notices.empty());
  r = parse({"s.py"});
  CHECK(r.config.environment.count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("command line: --standalone is one node on a free local port", "[unit]") {
  auto r = parse({"--standalone", "--nproc_per_node=2", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.master_port == 0);
  CHECK(r.config.master_addr == "127.0.0.1");
  CHECK(r.config.nnodes() == 1);
  CHECK(r.config.run_id.rfind("standalone_", 0) == 0);
}

TEST_CASE("command line: bad input is one clear line and exit code 2", "[unit]") {
  require_usage_error({"--nproc_per_node=abc", "s.py"}, "'abc' is not a number of workers");
  require_usage_error({"--nproc_per_node=0", "s.py"}, "'0' is not a number of workers");
  require_usage_error({"--nnodes=x", "s.py"}, "--nnodes=x: 'x' is not an integer");
  // The whole value is named, with the form expected.
  require_usage_error({"--nnodes=2:20:30", "s.py"},
                      "--nnodes=2:20:30: expected N or MIN:MAX, whole numbers in [1, 1048576]");
  require_usage_error({"--nnodes=2:", "s.py"}, "--nnodes=2:: expected N or MIN:MAX");
  require_usage_error({"--nnodes=1:x", "s.py"},
                      "--nnodes=1:x: 'x' is not an integer; expected N or MIN:MAX");
  auto from_env = parse({"s.py"}, {{"PET_NNODES", "0:2"}});
  CHECK(from_env.exit_code == 2);
  CHECK(from_env.message.find("PET_NNODES=0:2: 0 is out of range") != std::string::npos);
  // The option is named as written.
  require_usage_error({"--node_rank=x", "s.py"}, "--node_rank: ");
  require_usage_error({"--node-rank=x", "s.py"}, "--node-rank: ");
  require_usage_error({"--rdzv_id"}, "--rdzv_id: a value is required");
  require_usage_error({"--nnodes=3:2", "s.py"}, "MIN is greater than MAX");
  require_usage_error({"--nnodes=2", "--node_rank=2", "s.py"}, "must be below --nnodes=2");
  require_usage_error({"--master_port=70000", "s.py"}, "--master_port: Value 70000 not in range");
  require_usage_error({"--bogus", "s.py"}, "--bogus");
  require_usage_error({"--nproc", "2", "s.py"}, "--nproc");  // ambiguous: both spellings
  require_usage_error({"--nproc_per_node=2"}, "no training script");
  require_usage_error({"-m", "--no_python", "x"}, "cannot be used together");
  require_usage_error({"--redirects=4", "s.py"}, "--redirects");
  require_usage_error({"--rdzv_backend=c10d", "--nnodes=1:2", "s.py"}, "needs --rdzv_endpoint");
  require_usage_error({"--nnodes=1:2", "s.py"}, "dynamic rendezvous");
  require_usage_error({"--rdzv_conf=oops", "s.py"}, "KEY=VALUE");
  require_usage_error({"--signals_to_handle=SIGNOPE", "s.py"}, "SIGNOPE");
  require_usage_error({"--max_restarts=-1", "s.py"}, "--max_restarts: Value -1 not in range");
}

TEST_CASE("command line: --help documents every option, the variables and the exit codes",
          "[unit]") {
  auto r = parse({"--help"});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 0);
  for (const char* s : {"--nnodes",
                        "--nproc-per-node",
                        "--node-rank",
                        "--master-addr",
                        "--master-port",
                        "--max-restarts",
                        "--rdzv-backend",
                        "--rdzv-endpoint",
                        "--rdzv-id",
                        "--rdzv-conf",
                        "--standalone",
                        "--no-python",
                        "--module",
                        "--log-dir",
                        "--redirects",
                        "--tee",
                        "--local-ranks-filter",
                        "--shutdown-timeout",
                        "--exit-barrier-timeout",
                        "--events-file",
                        "PET_",
                        "CTORCHRUN_PYTHON",
                        "LOGLEVEL",
                        "--hang-timeout",
                        "--slurm",
                        "TORCHELASTIC_ENABLE_FILE_TIMER",
                        "TORCHELASTIC_HEALTH_CHECK_PORT",
                        "75",
                        "128+N",
                        "Exit codes"}) {
    INFO(s);
    CHECK(r.message.find(s) != std::string::npos);
  }
}

TEST_CASE("command line: --logs_specs default is accepted, a plugin name is exit 2 in one line",
          "[unit]") {
  for (const char* spelling : {"--logs_specs=default", "--logs-specs=default"}) {
    auto r = parse({spelling, "s.py"});
    INFO(spelling << ": " << r.message);
    CHECK(r.kind == ParseOutcome::Kind::kRun);
  }
  auto r = parse({"s.py"}, {{"PET_LOGS_SPECS", "default"}});
  CHECK(r.kind == ParseOutcome::Kind::kRun);

  require_usage_error({"--logs_specs=my_layout", "s.py"},
                      "--logs_specs=my_layout: log-spec plugins are Python entry points");
  require_usage_error({"--logs-specs", "my_layout", "s.py"}, "--logs-specs=my_layout: ");
  r = parse({"s.py"}, {{"PET_LOGS_SPECS", "my_layout"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find("PET_LOGS_SPECS=my_layout: ") != std::string::npos);
  CHECK(r.message.find("cannot load") != std::string::npos);
  CHECK(r.message.find('\n') == std::string::npos);
}

TEST_CASE(
    "command line: --event_log_handler takes torchrun's null or console, anything else is exit 2",
    "[unit]") {
  auto console = [](const std::vector<std::string>& args) {
    auto r = parse(args);
    INFO(r.message);
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    return r.config.events_to_console;
  };
  CHECK_FALSE(console({"s.py"}));
  CHECK_FALSE(console({"--event_log_handler=null", "s.py"}));
  CHECK(console({"--event-log-handler", "console", "s.py"}));
  auto r = parse({"s.py"}, {{"PET_EVENT_LOG_HANDLER", "console"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.events_to_console);
  require_usage_error({"--event_log_handler=syslog", "s.py"},
                      "--event_log_handler=syslog: expected null or console");
}

TEST_CASE("command line: a unique prefix of a long option before the script is that option",
          "[unit]") {
  auto r = parse({"--nproc-per=3", "--max-restart", "2", "--no-py", "--stan", "--rdzv_c=timeout=5",
                  "./w", "--nproc", "--max"});
  INFO(r.message);
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.nproc_per_node == 3);
  CHECK(r.config.max_restarts == 2);
  CHECK(r.config.master_port == 0);  // standalone
  CHECK(r.config.rdzv_timeout == std::chrono::milliseconds(5000));
  // After the script nothing is expanded or refused.
  CHECK(r.config.entrypoint == std::vector<std::string>{"./w", "--nproc", "--max"});
  // Our own options take part, in both spellings.
  r = parse({"--shutdown_t=4", "--exit-barrier=7", "--events_f=/tmp/e.json", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.shutdown_timeout == std::chrono::milliseconds(4000));
  CHECK(r.config.exit_barrier_timeout == std::chrono::milliseconds(7000));
  CHECK(r.config.events_file == "/tmp/e.json");
  // An empty value names the option in full.
  require_usage_error({"--rdzv_i=", "s.py"}, "--rdzv_id: the value is empty");
}

TEST_CASE("command line: a prefix of several option strings is ambiguous, as argparse says",
          "[unit]") {
  // argparse counts option strings, not options: the two spellings of one
  // option make a prefix of both ambiguous.
  require_usage_error({"--nproc=2", "s.py"},
                      "ambiguous option: --nproc=2 could match --nproc-per-node, --nproc_per_node");
  require_usage_error({"--ma", "1", "s.py"},
                      "ambiguous option: --ma could match --master-addr, --master_addr, "
                      "--master-port, --master_port, --max-restarts, --max_restarts");
  require_usage_error({"--shut=3", "s.py"}, "could match --shutdown-timeout, --shutdown_timeout");
  require_usage_error({"--event=x", "s.py"},
                      "could match --event-log-handler, --event_log_handler, --events-file, "
                      "--events_file");
  require_usage_error({"--nopython", "s.py"}, "--nopython");  // no prefix of anything: unknown
}

namespace {

// What a parser made of one command line, comparable between argparse and
// ours: "ok", "ambiguous: <matching option strings, sorted>", or "error".
std::string verdict_of_message(bool ok, const std::string& message) {
  if (ok) return "ok";
  const std::string marker = " could match ";
  auto at = message.find(marker);
  if (message.find("ambiguous option: ") == std::string::npos || at == std::string::npos)
    return "error";
  std::vector<std::string> names;
  std::stringstream ss(message.substr(at + marker.size()));
  std::string n;
  while (std::getline(ss, n, ',')) {
    n.erase(0, n.find_first_not_of(' '));
    names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  std::string out = "ambiguous:";
  for (const auto& name : names) out += " " + name;
  return out;
}

std::vector<std::string> split_words(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string w;
  while (ss >> w) out.push_back(w);
  return out;
}

}  // namespace

TEST_CASE("command line: long-option prefixes are accepted and refused as torchrun's argparse does",
          "[torch]") {
  // Our option strings, in order: "--=" is a prefix of every long option
  // string, so argparse (and we) list them all as its matches.
  auto all = parse({"--=1", "s.py"});
  REQUIRE(all.kind == ParseOutcome::Kind::kExit);
  const std::string marker = " could match ";
  REQUIRE(all.message.find(marker) != std::string::npos);
  std::string ours = all.message.substr(all.message.find(marker) + marker.size());
  ours.erase(std::remove(ours.begin(), ours.end(), ','), ours.end());

  // Torchrun 1.13's own parser (get_args_parser(), argparse with
  // allow_abbrev) has the underscore spellings only, and none of our own
  // options, and an option string it lacks changes which prefixes are
  // ambiguous. So its parser is extended first with the option strings only
  // ctorchrun has: a hyphen spelling shares its underscore twin's action, as
  // torch 2.x registers both spellings of one option; our own options
  // (--shutdown_timeout, --events_file, torch 2.x's --local_ranks_filter...)
  // are added as options taking a value, --version as a flag. The same
  // strings then meet the same prefixes, and argparse decides.
  const char* kScript = R"PY(
import sys
from torch.distributed.run import get_args_parser
p = get_args_parser()
acts = p._option_string_actions
for s in sys.argv[1].split():
    if s in acts:
        continue
    twin = '--' + s[2:].replace('-', '_')
    if twin in acts:
        acts[s] = acts[twin]
    else:
        p.add_argument(s, action='store_true' if s == '--version' else 'store')
class Refused(Exception):
    pass
def error(message):
    raise Refused(message)
p.error = error
for case in sys.argv[2:]:
    try:
        p.parse_args(case.split() + ['s.py'])
        print('ok')
    except Refused as e:
        print('refused ' + str(e))
)PY";
  // Each case is the options before the script, split at blanks. Prefixes
  // of --help (argparse prints help and exits 0) are left out.
  const std::vector<std::string> cases = {"--nproc-per=2",
                                          "--nproc_per=2",
                                          "--nproc-per 2",
                                          "--nproc=2",
                                          "--nproc 2",
                                          "--nn=1",
                                          "--n=1",
                                          "--max-restart=1",
                                          "--max_r=1",
                                          "--max=1",
                                          "--ma=1",
                                          "--mast=x",
                                          "--master-a=127.0.0.1",
                                          "--master_p=29500",
                                          "--no-py",
                                          "--no_p",
                                          "--no",
                                          "--node=0",
                                          "--node-r=0",
                                          "--stand",
                                          "--s",
                                          "--st",
                                          "--stan",
                                          "--start=spawn",
                                          "--start-m=spawn",
                                          "--rdzv-b=static",
                                          "--rdzv_e=127.0.0.1:29500",
                                          "--rdzv=x",
                                          "--rdzv_i=x",
                                          "--rdzv-c=timeout=5",
                                          "--mon=1",
                                          "--monitor_=1",
                                          "--mo",
                                          "--mod",
                                          "--ro=x",
                                          "--ru",
                                          "--run_",
                                          "--log_d=/tmp/x",
                                          "--log=/tmp/x",
                                          "--logs=default",
                                          "--red=0",
                                          "--te=0",
                                          "--local_r=0",
                                          "--local=x",
                                          "--shut=5",
                                          "--shutdown_=5",
                                          "--events=f",
                                          "--event=x",
                                          "--exit=5",
                                          "--exit_b=5",
                                          "--exit-barrier=5",
                                          "--sig=SIGTERM",
                                          "--=1",
                                          "--nproc-per=2 --max_r=1 --stan"};
  std::vector<std::string> argv = {CTORCHRUN_TEST_PYTHON, "-c", kScript, ours};
  argv.insert(argv.end(), cases.begin(), cases.end());
  ctorchrun::testing::Process py(argv);
  std::vector<std::string> lines;
  while (auto line = py.read_line(std::chrono::seconds(60))) lines.push_back(*line);
  REQUIRE(py.exit_code(std::chrono::seconds(10)) == 0);
  REQUIRE(lines.size() == cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const bool py_ok = lines[i] == "ok";
    const std::string py_verdict =
        verdict_of_message(py_ok, py_ok ? "" : lines[i].substr(lines[i].find(' ') + 1));
    std::vector<std::string> args = split_words(cases[i]);
    args.push_back("s.py");
    auto r = parse(args);
    const std::string our_verdict =
        verdict_of_message(r.kind == ParseOutcome::Kind::kRun, r.message);
    INFO("case: " << cases[i] << "\nargparse: " << lines[i] << "\nours: " << r.message);
    CHECK(our_verdict == py_verdict);
  }
}

TEST_CASE("command line: --rdzv_conf store_type=tcp is taken without a warning, file is exit 2",
          "[unit]") {
  for (const char* backend : {"--rdzv_backend=static", "--rdzv_backend=c10d"}) {
    auto r = parse({backend, "--rdzv_endpoint=127.0.0.1:29400",
                    "--rdzv_conf=store_type=tcp,join_timeout=7", "s.py"});
    INFO(backend << ": " << r.message);
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    for (const auto& w : r.warnings) CHECK(w.find("store_type") == std::string::npos);
  }
  auto r = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:29400",
                  "--rdzv_conf=store_type= TCP ", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.warnings.empty());
  require_usage_error(
      {"--rdzv_backend=c10d", "--rdzv_endpoint=/tmp/rdzv", "--rdzv_conf=store_type=file", "s.py"},
      "store_type=file: ctorchrun's rendezvous store is a TCP store");
  require_usage_error({"--rdzv_conf=store_type=redis", "s.py"}, "store_type='redis': expected tcp");
}

TEST_CASE("command line: --standalone with more than one node is exit 2 naming both options",
          "[unit]") {
  require_usage_error({"--standalone", "--nnodes=2", "s.py"},
                      "--standalone runs exactly one node, but --nnodes=2 asks for more");
  require_usage_error({"--nnodes", "1:4", "--standalone", "s.py"},
                      "--standalone runs exactly one node, but --nnodes=1:4");
  require_usage_error({"--nnodes=2:2", "--standalone", "s.py"}, "--nnodes=2:2");
  auto r = parse({"--standalone", "s.py"}, {{"PET_NNODES", "3"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find("--standalone runs exactly one node, but PET_NNODES=3") !=
        std::string::npos);
  r = parse({"--nnodes=2", "s.py"}, {{"PET_STANDALONE", "1"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.message.find("PET_STANDALONE runs exactly one node, but --nnodes=2") !=
        std::string::npos);
  for (const char* one : {"--nnodes=1", "--nnodes=1:1"}) {
    r = parse({"--standalone", one, "s.py"});
    INFO(one << ": " << r.message);
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    CHECK(r.config.nnodes() == 1);
  }
}

TEST_CASE("command line: the README's --rdzv_conf table names the backends that read each key",
          "[unit]") {
  // The table in cli/rdzv_conf.cc is what the code applies (and what --help
  // prints); the README's copy must say the same.
  std::ifstream f(std::string(CTORCHRUN_SOURCE_DIR) + "/README.md");
  std::string line;
  std::map<std::string, std::string> readme_backends;
  while (std::getline(f, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, '|')) {
      cell.erase(0, cell.find_first_not_of(' '));
      cell.erase(cell.find_last_not_of(' ') + 1);
      cells.push_back(cell);
    }
    // "  | `key` | type | range | default | backends | meaning |"
    if (cells.size() >= 7 && cells[1].size() > 2 && cells[1].front() == '`') {
      readme_backends[cells[1].substr(1, cells[1].size() - 2)] = cells[5];
    }
  }
  auto help = parse({"--help"});
  for (const auto& k : cli::rdzv_conf_keys()) {
    INFO(k.name);
    REQUIRE(readme_backends.count(k.name));
    CHECK(readme_backends[k.name] == k.backends);
    // --help prints the same table row.
    CHECK(help.message.find(std::string(k.name)) != std::string::npos);
    auto row = help.message.substr(help.message.find(std::string("  ") + k.name + " "));
    row = row.substr(0, row.find('\n'));
    CHECK(row.find(k.backends) != std::string::npos);
  }
}

TEST_CASE("command line: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE reaches the launch config",
          "[unit]") {
  auto r = parse({"s.py"}, {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.log_line_prefix_template == "[${rank}]:");
  CHECK(parse({"s.py"}).config.log_line_prefix_template.empty());
  // torch main's option beats the variable; an empty one leaves it to it.
  r = parse({"--log-line-prefix-template=[${hostname}]", "s.py"},
            {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:"}});
  CHECK(r.config.log_line_prefix_template == "[${hostname}]");
  r = parse({"--log_line_prefix_template=", "s.py"},
            {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:"}});
  CHECK(r.config.log_line_prefix_template == "[${rank}]:");
  r = parse({"s.py"}, {{"PET_LOG_LINE_PREFIX_TEMPLATE", "<${local_rank}>"}});
  CHECK(r.config.log_line_prefix_template == "<${local_rank}>");
}

TEST_CASE("command line: --status_host picks the address of the agent's HTTP endpoints", "[unit]") {
  CHECK(parse({"s.py"}).config.status_host == "0.0.0.0");  // Kubernetes reaches the pod's address
  CHECK(parse({"--status-host=127.0.0.1", "s.py"}).config.status_host == "127.0.0.1");
  CHECK(parse({"s.py"}, {{"PET_STATUS_HOST", "::1"}}).config.status_host == "::1");
}

TEST_CASE("command line: --virtual_local_rank needs a visible device per local rank", "[unit]") {
  auto r = parse({"--virtual-local-rank", "--nproc_per_node=2", "s.py"},
                 {{"CUDA_VISIBLE_DEVICES", "GPU-1,GPU-2"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.virtual_local_rank);
  CHECK_FALSE(parse({"s.py"}).config.virtual_local_rank);
  CHECK(parse({"--nproc_per_node=4", "s.py"}, {{"PET_VIRTUAL_LOCAL_RANK", "1"}})
            .config.virtual_local_rank);  // no CUDA_VISIBLE_DEVICES: no limit
  r = parse({"--virtual_local_rank", "--nproc_per_node=3", "s.py"},
            {{"CUDA_VISIBLE_DEVICES", "4,5"}});
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  CHECK(r.message.find("local_rank 2 exceeds available GPUs in CUDA_VISIBLE_DEVICES=4,5") !=
        std::string::npos);
}

TEST_CASE("command line: --cpu_backend is gloo or ctorch, gloo by default", "[unit]") {
  CHECK(parse({"s.py"}).config.cpu_backend == "gloo");
  CHECK(parse({"--cpu-backend=ctorch", "s.py"}).config.cpu_backend == "ctorch");
  CHECK(parse({"s.py"}, {{"PET_CPU_BACKEND", "ctorch"}}).config.cpu_backend == "ctorch");
  require_usage_error({"--cpu_backend=mpi", "s.py"}, "--cpu_backend");
  auto r = parse({"--cpu_backend=ctorch", "--no_python", "./trainer"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.notices.size() == 1);  // it is for Python workers
}

TEST_CASE("command line: --duplicate-*-filters split at commas as torch main's, ,, a comma",
          "[unit]") {
  auto r = parse({"--duplicate-stdout-filters=apple,orange,,pie", "--duplicate_stderr_filters",
                  "Traceback", "s.py"});
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  CHECK(r.config.duplicate_stdout_filters == std::vector<std::string>{"apple", "orange,pie"});
  CHECK(r.config.duplicate_stderr_filters == std::vector<std::string>{"Traceback"});
  CHECK(parse({"s.py"}).config.duplicate_stdout_filters.empty());
  CHECK(parse({"--duplicate_stdout_filters=", "s.py"}).config.duplicate_stdout_filters.empty());
  CHECK(parse({"s.py"}, {{"PET_DUPLICATE_STDERR_FILTERS", "a,,b,c"}})
            .config.duplicate_stderr_filters == std::vector<std::string>{"a,b", "c"});
}

TEST_CASE("command line: --run_path runs the script through runpy, before --module", "[unit]") {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--run-path", "/abs/s.py", "a"},
        std::vector<std::string>{"--run_path", "-m", "/abs/s.py", "a"},
        std::vector<std::string>{"--run_path", "--no_python", "/abs/s.py", "a"}}) {
    auto r = parse(args);
    INFO(r.message);
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    const auto& e = r.config.entrypoint;
    REQUIRE(e.size() == 6);
    CHECK(e[0] == "/usr/bin/python3");
    CHECK(e[2] == "-c");
    CHECK(e[3].find("runpy.run_path(sys.argv[0], run_name=\"__main__\")") != std::string::npos);
    CHECK(e[3].find("os._exit(") != std::string::npos);
    CHECK(std::vector<std::string>(e.begin() + 4, e.end()) ==
          std::vector<std::string>{"/abs/s.py", "a"});
  }
}

TEST_CASE(
    "command line: TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT is seconds, off unless positive",
    "[unit]") {
  using std::chrono::milliseconds;
  auto timeout = [](const std::string& v) {
    auto r = parse({"s.py"}, {{"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", v}});
    REQUIRE(r.kind == ParseOutcome::Kind::kRun);
    return std::pair{r.config.uninterruptible_state_timeout, r.warnings.size()};
  };
  CHECK(parse({"s.py"}).config.uninterruptible_state_timeout == milliseconds(0));
  CHECK(timeout("2.5") == std::pair{milliseconds(2500), size_t{0}});
  CHECK(timeout("0") == std::pair{milliseconds(0), size_t{0}});
  CHECK(timeout("-3") == std::pair{milliseconds(0), size_t{0}});    // torch: off, silently
  CHECK(timeout("soon") == std::pair{milliseconds(0), size_t{1}});  // off, and we say so
}

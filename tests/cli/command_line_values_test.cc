// Empty values, `--` before the script, one
// validated table of every --rdzv_conf key, and the hosted store's limits as
// --rdzv_conf keys.

#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <regex>
#include <sstream>

#include "cli/command_line.h"
#include "cli/rdzv_conf.h"
#include "common/error.h"
#include "store/tcp_store.h"
#include "tests/cli/parse_support.h"
#include "tests/launcher/launcher_support.h"

using namespace ctorchrun;
using namespace ctorchrun::testing;
using namespace std::chrono_literals;
using cli::ParseOutcome;

namespace {

ParseOutcome parse_ok(const std::vector<std::string>& args,
                      const std::map<std::string, std::string>& env = {}) {
  auto r = parse(args, env);
  INFO("args: " << Catch::Detail::stringify(args) << " message: " << r.message);
  REQUIRE(r.kind == ParseOutcome::Kind::kRun);
  return r;
}

void require_usage_error(const std::vector<std::string>& args,
                         const std::vector<std::string>& fragments,
                         const std::map<std::string, std::string>& env = {}) {
  auto r = parse(args, env);
  INFO("args: " << Catch::Detail::stringify(args) << " message: " << r.message);
  REQUIRE(r.kind == ParseOutcome::Kind::kExit);
  CHECK(r.exit_code == 2);
  for (const auto& f : fragments) CHECK(r.message.find(f) != std::string::npos);
  CHECK(r.message.find('\n') == std::string::npos);
}

std::vector<std::string> python_run(std::vector<std::string> script) {
  script.insert(script.begin(), {"/usr/bin/python3", "-u"});
  return script;
}

}  // namespace

TEST_CASE("command line: an empty value unsets the optional options and swallows nothing",
          "[unit]") {
  // Each spelling of an empty value: --opt= and --opt ''.
  for (bool attached : {true, false}) {
    auto with_empty = [&](const std::string& opt) {
      std::vector<std::string> args;
      if (attached) {
        args = {opt + "="};
      } else {
        args = {opt, ""};
      }
      args.insert(args.end(), {"--nproc_per_node=2", "s.py"});
      return args;
    };
    for (const char* opt : {"--log_dir", "--log-dir", "--local_addr", "--rdzv_endpoint",
                            "--rdzv_conf", "--local_ranks_filter"}) {
      auto r = parse_ok(with_empty(opt));
      INFO(opt);
      CHECK(r.config.nproc_per_node == 2);
      CHECK(r.config.entrypoint == python_run({"s.py"}));
      CHECK(r.config.log_dir.empty());
      CHECK(r.config.local_addr.empty());
      CHECK(r.config.master_addr == "127.0.0.1");
      CHECK(r.config.master_port == 0);  // one node and no port: a free one
      CHECK(r.config.rdzv_conf.empty());
      CHECK_FALSE(r.config.local_ranks_filter);
    }
  }
  // The command line's empty value wins over an earlier one and over PET_.
  auto r = parse_ok({"--log_dir=/tmp/x", "--log_dir=", "s.py"}, {{"PET_LOG_DIR", "/tmp/y"}});
  CHECK(r.config.log_dir.empty());
  r = parse_ok({"--log_dir=", "--log_dir=/tmp/z", "s.py"});
  CHECK(r.config.log_dir == "/tmp/z");
  r = parse_ok({"--rdzv_endpoint=", "s.py"}, {{"PET_RDZV_ENDPOINT", "10.1.1.1:5"}});
  CHECK(r.config.master_addr == "127.0.0.1");
  // An empty PET_ variable counts as unset.
  r = parse_ok({"--nnodes=2", "s.py"}, {{"PET_NPROC_PER_NODE", ""}, {"PET_RDZV_ID", ""}});
  CHECK(r.config.nproc_per_node == 1);
  CHECK(r.config.run_id == "none");
}

TEST_CASE("command line: an empty value of any other option is exit 2 naming the option",
          "[unit]") {
  for (const char* opt : {"--rdzv_id",
                          "--rdzv-id",
                          "--nnodes",
                          "--nproc_per_node",
                          "--node_rank",
                          "--master_addr",
                          "--master_port",
                          "--max_restarts",
                          "--monitor_interval",
                          "--rdzv_backend",
                          "--start_method",
                          "--role",
                          "-r",
                          "--redirects",
                          "-t",
                          "--tee",
                          "--signals_to_handle",
                          "--event_log_handler",
                          "--logs_specs",
                          "--numa_binding",
                          "--shutdown_timeout",
                          "--exit_barrier_timeout",
                          "--events_file"}) {
    std::string o = opt;
    require_usage_error({o + "=", "--nproc_per_node=2", "s.py"}, {o + ": the value is empty"});
    require_usage_error({o, "", "--nproc_per_node=2", "s.py"}, {o + ": the value is empty"});
  }
}

TEST_CASE("command line: a first -- before the script is dropped, the rest passes unchanged",
          "[unit]") {
  auto r = parse_ok({"--nproc_per_node=2", "--", "s.py", "a"});
  CHECK(r.config.nproc_per_node == 2);
  CHECK(r.config.entrypoint == python_run({"s.py", "a"}));
  // The argument after `--` is the script even if it starts with '-'.
  r = parse_ok({"--", "-weird.py", "--nproc_per_node=3", "--", "x"});
  CHECK(r.config.nproc_per_node == 1);
  CHECK(r.config.entrypoint == python_run({"-weird.py", "--nproc_per_node=3", "--", "x"}));
  CHECK(r.config.entrypoint_name == "-weird.py");
  r = parse_ok({"--", "--"});
  CHECK(r.config.entrypoint == python_run({"--"}));
  // After the script every argument, `--` included, is the script's.
  r = parse_ok({"--no_python", "./trainer", "--", "--steps", "1"});
  CHECK(r.config.entrypoint == std::vector<std::string>{"./trainer", "--", "--steps", "1"});
  r = parse_ok({"-m", "--", "pkg.mod", "--"});
  CHECK(r.config.entrypoint == python_run({"-m", "pkg.mod", "--"}));
  require_usage_error({"--nproc_per_node=2", "--"}, {"no training script"});
  // A separate value may be a negative number (then the range refuses it).
  require_usage_error({"--max_restarts", "-1", "s.py"}, {"--max_restarts: Value -1 not in range"});
}

TEST_CASE("command line: every --rdzv_conf value is checked against its key's range", "[unit]") {
  struct Bad {
    std::string pair;
    std::string expected;
  };
  for (const Bad& b : std::vector<Bad>{
           {"node_timeout=abc", "decimal seconds in (0, 31536000]"},
           {"node_timeout=0", "decimal seconds in (0, 31536000]"},
           {"timeout=-1", "decimal seconds in [0, 31536000]"},
           {"timeout=31536001", "decimal seconds in [0, 31536000]"},
           {"timeout=nan", "decimal seconds"},
           {"timeout=inf", "decimal seconds"},
           {"timeout=", "decimal seconds"},
           {"join_timeout=5s", "decimal seconds"},
           {"last_call_timeout=x", "decimal seconds"},
           {"close_timeout=-0.5", "decimal seconds"},
           {"read_timeout=1e99", "decimal seconds"},
           {"keep_alive_interval=0", "decimal seconds in (0, 31536000]"},
           {"keep_alive_max_attempt=0", "an integer in [1, 1000000]"},
           {"keep_alive_max_attempt=1.5", "an integer"},
           {"is_host=maybe", "a boolean"},
           {"store_max_key_bytes=0", "an integer in [1, 16777216]"},
           {"store_max_value_bytes=-5", "an integer in [1, 4294967296]"},
           {"store_max_value_bytes=99999999999999999999", "an integer"},
           {"store_max_keys_per_op=many", "an integer"},
           {"store_max_connections=2000000", "an integer in [1, 1048576]"},
           {"store_max_request_bytes=1000", "at least store_max_key_bytes + store_max_value_bytes"},
       }) {
    std::string key = b.pair.substr(0, b.pair.find('='));
    // Under a backend that reads the key (a key it does not read is a warning).
    std::vector<std::string> backend = {"--rdzv_backend=c10d", "--rdzv_endpoint=h:1"};
    if (key == "timeout") backend = {};
    backend.push_back("--rdzv_conf=" + b.pair);
    backend.push_back("s.py");
    require_usage_error(backend, {key, b.expected});
    // From the environment too.
    backend.erase(backend.end() - 2);
    require_usage_error(backend, {key, b.expected}, {{"PET_RDZV_CONF", b.pair}});
  }
  require_usage_error({"--rdzv_conf=timeout=5,=3", "s.py"}, {"'=3' is not KEY=VALUE"});
}

TEST_CASE("command line: valid --rdzv_conf values reach LaunchConfig as typed values", "[unit]") {
  auto r =
      parse_ok({"--rdzv_conf= timeout=1.5 ,keep_alive_interval=2,keep_alive_max_attempt=4,"
                "store_max_value_bytes=70000000,store_max_key_bytes=100,"
                "store_max_keys_per_op=7,store_max_connections=9,"
                "store_max_request_bytes=70000100,",
                "s.py"});
  const auto& c = r.config;
  CHECK(c.rdzv_timeout == 1500ms);
  CHECK(c.keep_alive_interval == 2000ms);
  CHECK(c.keep_alive_max_attempt == 4);
  CHECK(c.node_timeout == 8000ms);  // their product
  CHECK(c.store_max_value_bytes == 70000000u);
  CHECK(c.store_max_key_bytes == 100u);
  CHECK(c.store_max_keys_per_op == 7u);
  CHECK(c.store_max_connections == 9u);
  CHECK(c.store_max_request_bytes == 70000100u);
  CHECK(c.rdzv_conf.at("timeout") == "1.5");  // the text stays readable by name
  CHECK(r.warnings.empty());

  r = parse_ok({"--rdzv_conf=node_timeout=7,keep_alive_interval=1,timeout=0", "s.py"});
  CHECK(r.config.node_timeout == 7000ms);  // given: wins over the product
  CHECK(r.config.rdzv_timeout == 0ms);
  r = parse_ok({"s.py"});
  CHECK(r.config.node_timeout == 15000ms);
  CHECK(r.config.rdzv_timeout == 900000ms);
  CHECK_FALSE(r.config.store_max_value_bytes);
  CHECK_FALSE(r.config.is_host);
  auto is_host = [](const std::string& value) {
    return parse_ok({"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=is_host=" + value,
                     "s.py"})
        .config.is_host;
  };
  for (const char* yes : {"1", "true", "T", "yes", "Y"}) CHECK(is_host(yes) == true);
  for (const char* no : {"0", "False", "f", "NO", "n"}) CHECK(is_host(no) == false);
}

TEST_CASE(
    "command line: an unknown --rdzv_conf key, or one the backend does not read, is a warning",
    "[unit]") {
  auto r = parse_ok({"--rdzv_conf=timeout=5,bogus_key=1", "s.py"});
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0].find("unknown key 'bogus_key'") != std::string::npos);
  CHECK(r.config.rdzv_timeout == 5000ms);
  r = parse_ok({"--rdzv_conf=join_timeout=5", "s.py"});
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0].find("'join_timeout' is read by the c10d, etcd-v3 backends, not by static") !=
        std::string::npos);
  // Its value is not checked: torchrun would never read it either.
  r = parse_ok({"--rdzv_conf=join_timeout=soon,protocol=ftp", "s.py"});
  CHECK(r.warnings.size() == 2);
  r = parse_ok({"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=timeout=5'", "s.py"});
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0].find("key 'timeout' is the static backend's") != std::string::npos);
}

TEST_CASE("command line: --rdzv_conf as a Kubernetes args: entry hands it over, quotes included",
          "[unit]") {
  // torch's own launcher test passes this, with no shell to strip the quotes.
  for (const std::string& conf : {std::string("'join_timeout=5,last_call_timeout=1,timeout=5'"),
                                  std::string("\"join_timeout=5,last_call_timeout=1,timeout=5\""),
                                  std::string("join_timeout='5',last_call_timeout=\"1\",timeout=5"),
                                  std::string("'join_timeout'=5,last_call_timeout=1,timeout=5")}) {
    INFO(conf);
    auto r =
        parse_ok({"--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--rdzv-conf=" + conf, "s.py"});
    CHECK(r.config.join_timeout == 5000ms);
    CHECK(r.config.last_call_timeout == 1000ms);
    REQUIRE(r.warnings.size() == 1);  // timeout is the static backend's
    CHECK(r.warnings[0].find("'timeout'") != std::string::npos);
  }
  // A value a key the backend reads cannot use stays exit 2, quotes or not.
  require_usage_error(
      {"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf='join_timeout=soon'", "s.py"},
      {"join_timeout='soon'", "decimal seconds"});
  // Unmatched quotes are the value's own.
  require_usage_error(
      {"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=join_timeout='5", "s.py"},
      {"join_timeout=''5'"});
}

TEST_CASE("command line: PET_ fallbacks are typed and validated like the command line", "[unit]") {
  require_usage_error({"s.py"}, {"PET_MASTER_PORT='abc'", "--master-port"},
                      {{"PET_MASTER_PORT", "abc"}});
  require_usage_error({"s.py"}, {"PET_NODE_RANK='-3'"}, {{"PET_NODE_RANK", "-3"}});
  require_usage_error({"s.py"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT='x'"},
                      {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "x"}});
  require_usage_error({"s.py"}, {"PET_STANDALONE='maybe'"}, {{"PET_STANDALONE", "maybe"}});
  auto r = parse_ok({"s.py"}, {{"PET_STANDALONE", "1"},
                               {"PET_LOCAL_RANKS_FILTER", "0,3"},
                               {"PET_SHUTDOWN_TIMEOUT", "2.5"},
                               {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9"},
                               {"TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", "7"}});
  CHECK(r.config.master_port == 0);  // standalone
  REQUIRE(r.config.local_ranks_filter);
  CHECK(*r.config.local_ranks_filter == std::vector<int>{0, 3});
  CHECK(r.config.shutdown_timeout == 2500ms);
  CHECK(r.config.exit_barrier_timeout == 7000ms);
  r = parse_ok({"--shutdown_timeout=1", "s.py"}, {{"PET_SHUTDOWN_TIMEOUT", "2.5"}});
  CHECK(r.config.shutdown_timeout == 1000ms);
  r = parse_ok({"s.py"}, {{"PET_NO_PYTHON", "0"}, {"PET_MODULE", "false"}});
  CHECK(r.config.entrypoint == python_run({"s.py"}));
}

TEST_CASE("command line: --help and the README list every --rdzv_conf key", "[unit]") {
  auto help = parse({"--help"});
  REQUIRE(help.kind == ParseOutcome::Kind::kExit);
  std::ifstream f(std::string(CTORCHRUN_SOURCE_DIR) + "/README.md");
  std::stringstream readme;
  readme << f.rdbuf();
  REQUIRE(!readme.str().empty());
  for (const auto& k : cli::rdzv_conf_keys()) {
    INFO(k.name);
    CHECK(help.message.find(std::string("  ") + k.name + " ") != std::string::npos);
    CHECK(readme.str().find(std::string("| `") + k.name + "` |") != std::string::npos);
  }
  CHECK(help.message.find("[--] SCRIPT") != std::string::npos);
}

TEST_CASE("command line: ctorchrun refuses bad input at once and accepts -- before the script",
          "[multiproc]") {
  // node_timeout=abc used to end in exit 70 after the rendezvous.
  auto r = run_ctorchrun(
      {"--rdzv_conf=node_timeout=abc", "--master_port=1", "--no_python", "/bin/true"});
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("node_timeout='abc'") != std::string::npos);
  CHECK(r.output.find("rendezvous") == std::string::npos);
  // An unset $JOB_ID no longer makes the next option the run id.
  r = run_ctorchrun({"--rdzv_id=", "--nproc_per_node=2", "--no_python", "/bin/true"});
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("--rdzv_id: the value is empty") != std::string::npos);
  const std::string port = std::to_string(free_port());
  r = run_ctorchrun({"--master_port=" + port, "--rdzv_conf=bogus=1", "--no_python", "--", "/bin/sh",
                     "-c", "test \"$1\" = -- && test \"$2\" = x", "sh", "--", "x"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("unknown key 'bogus'") != std::string::npos);
}

// Runs a one-worker job with --rdzv_conf=`conf` and stores `values` under
// keys of their own in node 0's store with one MULTI_SET: whether the store
// kept them all.
bool hosted_store_keeps(const std::string& conf, const std::vector<std::string>& values) {
  TempDir dir;
  const int port = free_port();
  const std::string ready = dir.file("ready");
  auto p =
      start_ctorchrun({"--master_port=" + std::to_string(port), "--rdzv_conf=" + conf,
                       "--no_python", "/bin/sh", "-c", "echo up > " + ready + "; exec sleep 60"});
  REQUIRE(wait_for_file(ready, 30s));
  store::TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = static_cast<uint16_t>(port);
  o.timeout = 10s;
  std::vector<std::string> keys;
  for (size_t i = 0; i < values.size(); ++i) keys.push_back("issue8/" + std::to_string(i));
  bool stored = false;
  try {
    store::TcpStore client(o);
    client.multi_set(keys, values);
    stored = client.multi_get(keys) == values;
  } catch (const Error&) {
    stored = false;
  }
  p->signal(SIGTERM);
  CHECK(p->exit_code(30s) == 128 + SIGTERM);
  return stored;
}

TEST_CASE("command line: store_max_value_bytes lets a 65 MiB value into the hosted store",
          "[multiproc]") {
  CHECK(hosted_store_keeps("store_max_value_bytes=73400320", {std::string(65u << 20, 'v')}));
  CHECK_FALSE(hosted_store_keeps("store_max_value_bytes=1048576", {std::string(2u << 20, 'v')}));
}

TEST_CASE("command line: store_max_request_bytes caps a whole request to the hosted store",
          "[multiproc]") {
  // Three 1 MiB values each pass the value limit; together they exceed the
  // request cap, so the MULTI_SET is refused only if the cap reaches the server.
  const std::string limits = "store_max_value_bytes=1048576,store_max_key_bytes=65536";
  const std::vector<std::string> values(3, std::string(1u << 20, 'v'));
  CHECK(hosted_store_keeps(limits, values));
  CHECK_FALSE(hosted_store_keeps(limits + ",store_max_request_bytes=2162688", values));
}

TEST_CASE("command line: --hang_timeout takes non-negative seconds in both spellings and from env",
          "[unit]") {
  CHECK(parse_ok({"s.py"}).config.hang_timeout == 0ms);  // off by default
  CHECK(parse_ok({"--hang_timeout=5", "s.py"}).config.hang_timeout == 5000ms);
  CHECK(parse_ok({"--hang-timeout", "0.5", "s.py"}).config.hang_timeout == 500ms);
  CHECK(parse_ok({"s.py"}, {{"PET_HANG_TIMEOUT", "7"}}).config.hang_timeout == 7000ms);
  CHECK(parse_ok({"--hang_timeout=2", "s.py"}, {{"PET_HANG_TIMEOUT", "7"}}).config.hang_timeout ==
        2000ms);
  require_usage_error({"--hang_timeout=-1", "s.py"}, {"--hang"});
  require_usage_error({"--hang_timeout=soon", "s.py"}, {"--hang"});
  require_usage_error({"--hang_timeout=", "s.py"}, {"--hang_timeout: the value is empty"});
  require_usage_error({"s.py"}, {"PET_HANG_TIMEOUT"}, {{"PET_HANG_TIMEOUT", "x"}});
  auto help = parse({"--help"});
  REQUIRE(help.kind == ParseOutcome::Kind::kExit);
  CHECK_THAT(help.message, Catch::Contains("--hang_timeout"));
}

TEST_CASE("command line: a single-node job without a port takes a free one, as torch main's does",
          "[unit]") {
  auto r = parse_ok({"--nproc_per_node=2", "s.py"});
  CHECK(r.config.master_port == 0);
  CHECK(r.config.rdzv_backend == "static");
  CHECK(std::regex_match(r.config.run_id,
                         std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-"
                                    "[0-9a-f]{12}")));  // uuid4, as torchrun's
  CHECK(parse_ok({"s.py"}).config.run_id != r.config.run_id);
  CHECK(parse_ok({"--rdzv_id=mine", "s.py"}).config.run_id == "mine");
  // A port given anywhere, or a job of several nodes, is torchrun's as before.
  CHECK(parse_ok({"--master_port=29500", "s.py"}).config.master_port == 29500);
  CHECK(parse_ok({"s.py"}, {{"PET_MASTER_PORT", "1234"}}).config.master_port == 1234);
  CHECK(parse_ok({"--nnodes=2", "s.py"}).config.master_port == 29500);
  CHECK(parse_ok({"--nnodes=2", "s.py"}).config.run_id == "none");
  CHECK(parse_ok({"--rdzv_endpoint=127.0.0.1", "s.py"}).config.master_port == 29500);
  CHECK(parse_ok({"--rdzv_endpoint=127.0.0.1:77", "s.py"}).config.master_port == 77);
}

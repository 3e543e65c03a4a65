// The worker environment and the failure summary, as torchrun forms them.

#include "agent/worker_env.h"

#include <signal.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <utility>
#include <vector>

#include "agent/failure_summary.h"
#include "common/error.h"

using namespace ctorchrun::agent;

TEST_CASE("worker env: torchrun's variables, formatted as torchrun formats them", "[unit]") {
  WorkerPlacement p;
  p.local_rank = 1;
  p.global_rank = 5;
  p.local_world_size = 4;
  p.world_size = 8;
  p.group_rank = 1;
  p.group_world_size = 2;
  p.master_addr = "10.0.0.1";
  p.master_port = 29500;
  p.restart_count = 2;
  p.failed_restarts = 1;
  p.round = 1;
  p.max_restarts = 3;
  p.run_id = "job";
  p.error_file = "/logs/job_x/attempt_2/1/error.json";
  auto env = build_worker_env({{"PATH", "/bin"}, {"NCCL_ASYNC_ERROR_HANDLING", "0"}}, p);
  CHECK(env.at("PATH") == "/bin");
  CHECK(env.at("LOCAL_RANK") == "1");
  CHECK(env.at("RANK") == "5");
  CHECK(env.at("GROUP_RANK") == "1");
  CHECK(env.at("ROLE_RANK") == "5");
  CHECK(env.at("ROLE_NAME") == "default");
  CHECK(env.at("LOCAL_WORLD_SIZE") == "4");
  CHECK(env.at("WORLD_SIZE") == "8");
  CHECK(env.at("GROUP_WORLD_SIZE") == "2");
  CHECK(env.at("ROLE_WORLD_SIZE") == "8");
  CHECK(env.at("MASTER_ADDR") == "10.0.0.1");
  CHECK(env.at("MASTER_PORT") == "29500");
  CHECK(env.at("TORCHELASTIC_RESTART_COUNT") == "2");
  CHECK(env.at("TORCHELASTIC_MAX_RESTARTS") == "3");
  CHECK(env.at("CTORCHRUN_FAILED_RESTARTS") == "1");
  CHECK(env.at("CTORCHRUN_ROUND") == "1");
  CHECK(env.at("TORCHELASTIC_RUN_ID") == "job");
  CHECK(env.at("TORCHELASTIC_USE_AGENT_STORE") == "True");
  CHECK(env.at("TORCHELASTIC_ERROR_FILE") == p.error_file);
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "0");  // the user's value stays
  CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
}

TEST_CASE(
    "worker env: NCCL_ASYNC_ERROR_HANDLING goes only to workers whose torch is older than 2.2 "
    "or unknown, the user's value stays",
    "[unit]") {
  WorkerPlacement p;
  for (auto [version, old_name] :
       std::vector<std::pair<std::optional<std::pair<int, int>>, bool>>{{std::nullopt, true},
                                                                        {std::pair{1, 13}, true},
                                                                        {std::pair{2, 1}, true},
                                                                        {std::pair{2, 2}, false},
                                                                        {std::pair{2, 6}, false},
                                                                        {std::pair{3, 0}, false}}) {
    p.torch_version = version;
    auto env = build_worker_env({}, p);
    INFO((version ? std::to_string(version->first) + "." + std::to_string(version->second)
                  : std::string("unknown")));
    CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(env.count("NCCL_ASYNC_ERROR_HANDLING") == (old_name ? 1u : 0u));
  }
  p.torch_version = std::pair{2, 6};
  auto env = build_worker_env({{"NCCL_ASYNC_ERROR_HANDLING", "0"}}, p);
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "0");
}

TEST_CASE("worker env: global ranks follow the local world sizes of lower nodes", "[unit]") {
  CHECK(base_global_rank({4, 4, 4}, 0) == 0);
  CHECK(base_global_rank({4, 4, 4}, 2) == 8);
  CHECK(base_global_rank({2, 3, 1}, 2) == 5);
  CHECK(substitute_local_rank({"--rank=${local_rank}", "x${local_rank}${local_rank}"}, 3) ==
        std::vector<std::string>{"--rank=3", "x33"});
}

TEST_CASE("failure summary: torchrun's template, root cause first by time, signals by name",
          "[unit]") {
  FailureRecord a;
  a.rank = 1;
  a.local_rank = 1;
  a.host = "h";
  a.pid = 42;
  a.exit_code = 3;
  a.timestamp = 2000;
  read_error_file("/nonexistent/error.json", &a);
  FailureRecord b;
  b.rank = 0;
  b.local_rank = 0;
  b.host = "h";
  b.pid = 41;
  b.signaled = true;
  b.signal = 11;
  b.timestamp = 1000;
  read_error_file("/nonexistent/error.json", &b);
  std::string s = format_failure_summary("train.py", {a, b});
  CHECK(s.find("train.py FAILED") != std::string::npos);
  auto root = s.find("Root Cause (first observed failure):");
  REQUIRE(root != std::string::npos);
  CHECK(s.find("exitcode  : -11 (pid: 41)", root) != std::string::npos);
  CHECK(s.find("Signal 11 (SIGSEGV) received by PID 41") != std::string::npos);
  CHECK(s.find("exitcode  : 3 (pid: 42)") < root);
  CHECK(s.find("error_file: <N/A>") != std::string::npos);
  CHECK(b.cause() == "signal 11 (SIGSEGV)");
  CHECK(a.cause() == "exit code 3");
  CHECK(FailureRecord::from_json(a.to_json()).to_json() == a.to_json());
}

TEST_CASE("failure summary: a failure record keeps bytes that are not UTF-8", "[unit]") {
  FailureRecord a;
  a.rank = 1;
  a.host = "h\xff";
  a.exit_code = 127;
  a.error_file = "/tmp/\xff/error.json";
  a.message = "/tmp/\xfe/x: No such file or directory";
  std::string text;
  REQUIRE_NOTHROW(text = a.to_json());
  FailureRecord back = FailureRecord::from_json(text);
  CHECK(back.host == a.host);
  CHECK(back.error_file == a.error_file);
  CHECK(back.message == a.message);
  // Different bytes, different records.
  FailureRecord b = a;
  b.host = "h\xfe";
  CHECK(b.to_json() != text);
}

TEST_CASE("failure summary: reads torch's @record error file", "[unit]") {
  std::string path = "/tmp/ctorchrun_error_file_test.json";
  {
    std::ofstream f(path);
    f << R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback...\nValueError: boom", "timestamp": "1795327541"}}})";
  }
  FailureRecord r;
  r.exit_code = 1;
  r.timestamp = 5;
  read_error_file(path, &r);
  CHECK(r.error_file == path);
  CHECK(r.timestamp == 1795327541);
  // Indented as torch shows a traceback in the summary.
  CHECK(r.message == "Traceback...\n  ValueError: boom");
  std::remove(path.c_str());
}

namespace {

// The summary's time field: torch's datetime.fromtimestamp(t).isoformat("_").
std::string local_time(int64_t t) {
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  localtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

FailureRecord failure(int rank, int pid, int64_t timestamp) {
  FailureRecord f;
  f.rank = rank;
  f.local_rank = rank;
  f.host = "node7";
  f.pid = pid;
  f.timestamp = timestamp;
  return f;
}

}  // namespace

// The expected texts below are written by hand from torch main's
// torch/distributed/elastic/multiprocessing/errors/__init__.py
// (_FAILURE_FORMAT_TEMPLATE, _MSG_FORMAT_TEMPLATE, ChildFailedError.format_msg
// and _format_failure, ProcessFailure.__post_init__), from its first rule to
// its last, with a newline after.
TEST_CASE("failure summary: an exit code, as torch main renders it (trailing space, 60 wide)",
          "[unit]") {
  FailureRecord f = failure(0, 5277, 1795327541);
  f.exit_code = 1;
  read_error_file("/nonexistent/error.json", &f);
  const std::string rule(60, '='), section(60, '-');
  CHECK(
      format_failure_summary("train.py", {f}) ==
      rule + "\ntrain.py FAILED\n" + section + "\nFailures:\n  <NO_OTHER_FAILURES>\n" + section +
          "\nRoot Cause (first observed failure):\n[0]:\n  time      : " + local_time(1795327541) +
          "\n  host      : node7\n  rank      : 0 (local_rank: 0)\n"
          "  exitcode  : 1 (pid: 5277) \n  error_file: <N/A>\n"
          "  traceback : To enable traceback see: "
          "https://pytorch.org/docs/stable/elastic/errors.html\n" +
          rule + "\n");
}

TEST_CASE(
    "failure summary: a signal, as torch main renders it (two spaces, rules as wide as "
    "the widest line)",
    "[unit]") {
  FailureRecord f = failure(3, 5277, 1795327541);
  f.local_rank = 1;
  f.signaled = true;
  f.signal = SIGSEGV;
  read_error_file("/nonexistent/error.json", &f);
  // The widest line is the traceback: 54 characters.
  const std::string rule(54, '='), section(54, '-');
  CHECK(
      format_failure_summary("w.py", {f}) ==
      rule + "\nw.py FAILED\n" + section + "\nFailures:\n  <NO_OTHER_FAILURES>\n" + section +
          "\nRoot Cause (first observed failure):\n[0]:\n  time      : " + local_time(1795327541) +
          "\n  host      : node7\n  rank      : 3 (local_rank: 1)\n"
          "  exitcode  : -11 (pid: 5277)  (SIGSEGV)\n  error_file: <N/A>\n"
          "  traceback : Signal 11 (SIGSEGV) received by PID 5277\n" +
          rule + "\n");
  // A signal Python has no name for: "<N/A>" in the message, none after the pid.
  FailureRecord rt = failure(0, 9, 1795327541);
  rt.signaled = true;
  rt.signal = SIGRTMIN + 3;
  read_error_file("/nonexistent/error.json", &rt);
  const std::string n = std::to_string(SIGRTMIN + 3);
  const std::string s = format_failure_summary("w.py", {rt});
  CHECK(s.find("\n  exitcode  : -" + n + " (pid: 9) \n") != std::string::npos);
  CHECK(s.find("\n  traceback : Signal " + n + " (<N/A>) received by PID 9\n") !=
        std::string::npos);
  CHECK(torch_signal_name(SIGABRT) == "SIGABRT");
  CHECK(torch_signal_name(SIGIO) == "SIGIO");
  CHECK(torch_signal_name(SIGRTMIN) == "SIGRTMIN");
  CHECK(torch_signal_name(SIGRTMAX) == "SIGRTMAX");
  CHECK(torch_signal_name(0).empty());
}

TEST_CASE("failure summary: several failures numbered in rank order, the earliest the root cause",
          "[unit]") {
  // Rank 1 failed first: torch lists rank 0 as [0] under Failures and rank 1
  // as [1] under Root Cause.
  FailureRecord a = failure(0, 100, 1795327542);
  a.exit_code = 3;
  FailureRecord b = failure(1, 101, 1795327541);
  b.exit_code = 5;
  // A @record error file: its traceback indented under the field.
  const std::string path = "/tmp/ctorchrun_summary_order_test.json";
  {
    std::ofstream out(path);
    out << R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": )"
           R"("Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom", )"
           R"("timestamp": "1795327541"}}})";
  }
  read_error_file("/nonexistent/error.json", &a);
  read_error_file(path, &b);
  std::remove(path.c_str());
  const std::string rule(60, '='), section(60, '-');
  const std::string expected =
      rule + "\nx FAILED\n" + section +
      "\nFailures:\n[0]:\n  time      : " + local_time(1795327542) +
      "\n  host      : node7\n  rank      : 0 (local_rank: 0)\n"
      "  exitcode  : 3 (pid: 100) \n  error_file: <N/A>\n"
      "  traceback : To enable traceback see: "
      "https://pytorch.org/docs/stable/elastic/errors.html\n" +
      section +
      "\nRoot Cause (first observed failure):\n[1]:\n  time      : " + local_time(1795327541) +
      "\n  host      : node7\n  rank      : 1 (local_rank: 1)\n"
      "  exitcode  : 5 (pid: 101) \n  error_file: " +
      path +
      "\n  traceback : Traceback (most recent call last):\n    File \"t.py\", line 1\n"
      "  ValueError: boom\n" +
      rule + "\n";
  CHECK(format_failure_summary("x", {b, a}) == expected);
  CHECK(format_failure_summary("x", {a, b}) == expected);
  // Three: the others keep rank order around the root cause.
  FailureRecord c = failure(2, 102, 1795327543);
  c.exit_code = 1;
  read_error_file("/nonexistent/error.json", &c);
  const std::string s = format_failure_summary("x", {c, a, b});
  const auto root = s.find("Root Cause");
  CHECK(s.find("[0]:\n  time") < s.find("[2]:\n  time"));
  CHECK(s.find("[2]:\n  time") < root);
  CHECK(s.find("[1]:\n  time") > root);
  CHECK(s.find("\n[0]:\n  time      : " + local_time(1795327542) + "\n  host      : node7\n" +
               "  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 100) \n  error_file: "
               "<N/A>\n  traceback : To enable traceback see: "
               "https://pytorch.org/docs/stable/elastic/errors.html\n[2]:\n") != std::string::npos);
}

TEST_CASE("worker env: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE expands as Python's Template does",
          "[unit]") {
  CHECK(log_line_prefix("", "trainer", 5, 1) == "[trainer1]:");  // torchrun's default
  // The expected values are Python's string.Template(t).safe_substitute(
  // role_name="trainer", rank=5, local_rank=1), which torch 2.x uses, verbatim.
  const std::pair<const char*, const char*> cases[] = {
      {"[${role_name}${local_rank}]:", "[trainer1]:"},
      {"[${rank}]:", "[5]:"},
      {"$rank|$local_rank|$role_name ", "5|1|trainer "},
      {"${rank}0 $rank0 $$rank $ ${rank ${} $1 ${RANK} $Rank ${nope} end$",
       "50 $rank0 $rank $ ${rank ${} $1 ${RANK} $Rank ${nope} end$"},
      {"rank=${rank}, lr=${local_rank}:", "rank=5, lr=1:"},
      {"[${hostname}]:${rank}: ", "[node7]:5: "},  // torch main's macro
      {"$hostname$hostnames", "node7$hostnames"},
  };
  for (const auto& [tmpl, expected] : cases) {
    INFO(tmpl);
    CHECK(log_line_prefix(tmpl, "trainer", 5, 1, "node7") == expected);
  }
  CHECK_FALSE(short_hostname().empty());
}

TEST_CASE("worker env: --virtual_local_rank gives LOCAL_RANK=0 and the worker's own device alone",
          "[unit]") {
  WorkerPlacement p;
  p.local_rank = 1;
  p.global_rank = 5;
  p.virtual_local_rank = true;
  auto env = build_worker_env({{"CUDA_VISIBLE_DEVICES", "GPU-aa11, MIG-bb22,3"}}, p);
  CHECK(env.at("LOCAL_RANK") == "0");
  CHECK(env.at("RANK") == "5");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "MIG-bb22");  // mapped through the parent's
  env = build_worker_env({}, p);
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "1");  // no restriction: the local rank's device
  p.local_rank = 3;
  CHECK_THROWS_AS(build_worker_env({{"CUDA_VISIBLE_DEVICES", "0,1"}}, p), ctorchrun::ConfigError);
  p.virtual_local_rank = false;
  env = build_worker_env({{"CUDA_VISIBLE_DEVICES", "0,1"}}, p);
  CHECK(env.at("LOCAL_RANK") == "3");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "0,1");
}

TEST_CASE("worker env: --cpu_backend ctorch puts its hook first on PYTHONPATH, the package last",
          "[unit]") {
  WorkerPlacement p;
  p.ctorch_package_dir = "/pkg";
  p.ctorch_site_dir = "/pkg/ctorch_site";
  auto env = build_worker_env({{"PYTHONPATH", "/mine:/yours"}}, p);
  CHECK(env.at("PYTHONPATH") == "/pkg/ctorch_site:/mine:/yours:/pkg");
  CHECK(env.at("CTORCHRUN_CPU_BACKEND") == "ctorch");
  env = build_worker_env({}, p);
  CHECK(env.at("PYTHONPATH") == "/pkg/ctorch_site:/pkg");
  p.ctorch_site_dir.clear();
  env = build_worker_env({{"PYTHONPATH", "/mine"}}, p);
  CHECK(env.at("PYTHONPATH") == "/mine:/pkg");
  CHECK(env.count("CTORCHRUN_CPU_BACKEND") == 0);
}

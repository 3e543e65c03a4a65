// ctorchrun: the launcher. Parses torchrun's command line, runs this node's
// agent, and turns its result into the exit code (common/exit_codes.h).

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>

#include "agent/agent.h"
#include "cli/command_line.h"
#include "common/error.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "worker/console.h"
#include "worker/launcher.h"

extern char** environ;

namespace {

using namespace ctorchrun;

std::map<std::string, std::string> environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

// Runs this node's agent; its exit code, after the failure summary and the
// last lines.
int run_agent(const agent::LaunchConfig& config) {
  auto log = get_logger("cli");
  try {
    agent::RunResult r = agent::run(config);
    if (!r.failures.empty()) {
      worker::Console::write(STDERR_FILENO,
                             agent::format_failure_summary(config.entrypoint_name, r.failures));
    }
    if (!r.truncated_logs.empty()) {
      std::string list;
      for (const auto& path : r.truncated_logs) list += (list.empty() ? "" : ", ") + path;
      log->warn("worker logs not written in full (see the warnings above): {}", list);
    }
    // What the console lost is said before the last line.
    worker::Console::flush(worker::Console::kExitStall);
    if (r.exit_code != kExitSuccess && !r.message.empty()) log->error("{}", r.message);
    if (!r.kept_log_dir.empty()) {
      log->info("exiting with code {}; logs kept in {}", r.exit_code, r.kept_log_dir);
    } else if (r.exit_code != kExitSuccess) {
      log->info("exiting with code {}", r.exit_code);
    }
    return r.exit_code;
  } catch (const InternalError& e) {
    log->critical("{}", e.what());
    return kExitInternal;
  } catch (const std::exception& e) {
    log->critical("internal error: {} (please report this)", e.what());
    return kExitInternal;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Handle the stop signals from the first instant: blocked here (every later
  // thread inherits the mask), taken by a sigwait thread below.
  const std::vector<int> default_signals = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  agent::block_signals(default_signals);
  signal(SIGPIPE, SIG_IGN);

  cli::ParseOutcome parsed = cli::parse_command_line(argc, argv, environment());
  if (parsed.kind == cli::ParseOutcome::Kind::kExit) {
    std::FILE* out = parsed.exit_code == 0 ? stdout : stderr;
    std::fprintf(out, "%s%s", parsed.message.c_str(),
                 parsed.message.empty() || parsed.message.back() == '\n' ? "" : "\n");
    return parsed.exit_code;
  }
  const agent::LaunchConfig& config = parsed.config;
  agent::block_signals(config.signals_to_handle);
  // Ctrl-Z stops the workers too (they run in sessions of their own); before
  // any thread starts, so that every thread has SIGTSTP blocked.
  worker::handle_job_control();
  std::vector<int> handled = default_signals;
  for (int s : config.signals_to_handle) handled.push_back(s);
  agent::start_signal_thread(handled);

  // Our own lines share the non-blocking console queue with teed worker
  // output: a console that does not drain never stalls the launcher.
  set_log_sink(worker::Console::log_sink());
  setup_logging(spdlog::level::info);
  for (const auto& notice : parsed.notices) worker::Console::write(STDERR_FILENO, notice + "\n");
  struct FlushConsole {
    ~FlushConsole() { worker::Console::flush(worker::Console::kExitStall); }
  } flush_console_at_exit;

  auto log = get_logger("cli");
  for (const auto& warning : parsed.warnings) log->warn("{}", warning);
  for (const auto& line : parsed.infos) log->info("{}", line);
  return run_agent(config);
}

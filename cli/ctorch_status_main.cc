// ctorch-status HOST:PORT [--watch [--interval SECONDS]] [--timeout SECONDS]: one
// agent's view of the job (its --status_port's GET /status) as a table.
// Exit codes: 0 shown; 1 the agent did not answer, or not with its status;
// 2 usage.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <thread>

#include "cli/status_view.h"
#include "common/config.h"

namespace {

volatile std::sig_atomic_t interrupted = 0;

struct Options {
  std::string address;
  double watch = 0;  // seconds between redraws; 0: once
  double timeout = 5;
};

int show_once(const std::string& host, int port, const Options& o) {
  const auto reply = ctorchrun::cli::fetch_status(
      host, port, std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000)));
  if (!reply.ok) {
    std::cerr << "ctorch-status: " << reply.error << "\n";
    return 1;
  }
  std::cout << ctorchrun::cli::render_status(reply.status) << std::flush;
  return 0;
}

// Redraws every o.watch seconds until Ctrl-C; an agent that stops answering
// is said once per redraw, with since when, and asked again.
int watch(const std::string& host, int port, const Options& o) {
  std::signal(SIGINT, [](int) { interrupted = 1; });
  std::signal(SIGTERM, [](int) { interrupted = 1; });
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  std::time_t gone_since = 0;
  while (!interrupted) {
    const auto reply = ctorchrun::cli::fetch_status(
        host, port, std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000)));
    if (tty) std::cout << "\033[H\033[2J";
    if (reply.ok) {
      gone_since = 0;
      std::cout << ctorchrun::cli::render_status(reply.status);
    } else {
      if (gone_since == 0) gone_since = std::time(nullptr);
      char when[16];
      std::tm tm{};
      localtime_r(&gone_since, &tm);
      std::strftime(when, sizeof when, "%H:%M:%S", &tm);
      std::cout << "agent unreachable since " << when << " (" << reply.error << ")\n";
    }
    std::cout << std::flush;
    for (double waited = 0; waited < o.watch && !interrupted; waited += 0.1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"ctorch-status: one ctorchrun agent's view of the job (its --status_port)",
               "ctorch-status"};
  app.set_version_flag("--version", std::string("ctorch-status ") + CTORCHRUN_VERSION);
  app.add_option("address", o.address, "the agent's HOST:PORT (--status_port), e.g. node0:9400")
      ->required();
  bool watching = false;
  app.add_flag("--watch", watching, "redraw every --interval seconds until Ctrl-C");
  app.add_option("--interval", o.watch, "seconds between two redraws of --watch (2)")
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--timeout", o.timeout, "seconds to wait for the agent's answer (5)")
      ->check(CLI::Range(0.1, 600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (!watching) {
    o.watch = 0;
  } else if (o.watch == 0) {
    o.watch = 2;
  }
  std::string host, error;
  int port = 0;
  if (!ctorchrun::cli::parse_agent_address(o.address, &host, &port, &error)) {
    std::cerr << "ctorch-status: " << error << "\n";
    return 2;
  }
  return o.watch > 0 ? watch(host, port, o) : show_once(host, port, o);
}

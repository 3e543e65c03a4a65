// ctorch-store: a standalone TCPStore-compatible key-value server.
//
//   ctorch-store [--host H] [--port P] [limits...]
//
// Serves torch 1.13 and torch 2.x clients (and ctorchrun's own) on one port.
// Prints "listening on H:P" on stdout once ready (P=0 picks a free port).
// Exits 0 on SIGINT/SIGTERM, 2 on a usage error, 4 when it cannot bind.

#include <signal.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "common/config.h"
#include "common/error.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "store/tcp_store_server.h"

namespace {

// Thousands of clients need thousands of descriptors: raise the soft limit to
// the hard one.
void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

// The store's options on the command line; `port` is separate because 0
// (any free port) is allowed there.
void add_options(CLI::App& app, ctorchrun::store::ServerOptions& options, int& port) {
  app.add_option("--host", options.host, "address to bind (torch binds every address)")
      ->capture_default_str();
  app.add_option("--port", port, "port to listen on; 0 picks a free one and prints it")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--max-key-bytes", options.limits.max_key_bytes,
                 "longest key accepted; a longer one closes that client's connection")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-value-bytes", options.limits.max_value_bytes,
                 "longest value accepted (also the most an APPEND may grow a value to)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-keys-per-op", options.limits.max_keys_per_op,
                 "most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-request-bytes", options.limits.max_request_bytes,
                 "largest whole request (and MULTI_GET reply) accepted; 0 means the larger of "
                 "twice --max-value-bytes and 65 MiB; must be at least key + value limits")
      ->capture_default_str();
  app.add_option("--max-connections", options.max_connections,
                 "most open client connections; further ones are closed at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.set_version_flag("--version", std::string("ctorch-store ") + CTORCHRUN_VERSION);
}

// Serves until SIGINT or SIGTERM; the exit code.
int serve(const ctorchrun::store::ServerOptions& options) {
  using namespace ctorchrun;
  setup_logging(spdlog::level::info);
  raise_fd_limit();

  // Block the stop signals before the server thread starts, so it inherits
  // the mask and sigwait() below is the only place they arrive.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::unique_ptr<store::TcpStoreServer> server;
  try {
    server = store::TcpStoreServer::start(options);
  } catch (const IoError& e) {
    get_logger("store")->error("{}", e.what());
    return kExitStoreNetwork;
  } catch (const ConfigError& e) {
    get_logger("store")->error("{}", e.what());
    return kExitUsage;
  }
  std::printf("listening on %s:%u\n", server->host().c_str(),
              static_cast<unsigned>(server->port()));
  std::fflush(stdout);

  int sig = 0;
  sigwait(&stop_signals, &sig);
  auto stats = server->stats();
  server->stop();
  get_logger("store")->info(
      "stopped by signal {}: served {} connections, {} requests, closed {} misbehaving clients",
      sig, stats.accepted, stats.requests, stats.dropped);
  return kExitSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ctorchrun;
  store::ServerOptions options;
  int port = 29500;
  CLI::App app{
      "ctorch-store: a key-value store server that speaks PyTorch's TCPStore protocol.\n"
      "torch 1.13/2.0 and torch 2.1+ clients (both wire dialects, detected per connection)\n"
      "and ctorchrun's agents share one key space. Runs in the foreground; prints\n"
      "'listening on HOST:PORT' once ready.\n\n"
      "Exit codes: 0 stopped by SIGINT/SIGTERM, 2 usage error, 4 cannot bind.",
      "ctorch-store"};
  add_options(app, options, port);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitSuccess : kExitUsage;
  }
  options.port = static_cast<uint16_t>(port);
  return serve(options);
}

#include "rendezvous/c10d_handler.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/static_handler.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"

namespace ctorchrun::rendezvous {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    throw IoError("rendezvous endpoint '" + host + "' does not resolve (" + gai_strerror(rc) + ")");
  }
  std::string found;
  for (addrinfo* ai = res; ai && found.empty(); ai = ai->ai_next) {
    // A connected datagram socket takes the source address the kernel would
    // route from; nothing goes on the wire.
    int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[NI_MAXHOST] = {};
      if (getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof text, nullptr, 0,
                      NI_NUMERICHOST) == 0) {
        found = text;
      }
    }
    ::close(fd);
  }
  freeaddrinfo(res);
  if (found.empty()) {
    throw IoError("no local address reaches the rendezvous endpoint " + host + ":" + service +
                  "; give --local_addr");
  }
  return found;
}

C10dHandler::C10dHandler(C10dOptions options) : options_(std::move(options)) {}

C10dHandler::~C10dHandler() = default;

void C10dHandler::host_endpoint_if_ours() {
  if (server_ || options_.is_host == false) return;
  auto log = get_logger("rdzv");
  const std::string addr = strip_brackets(options_.endpoint_host);
  std::string bind;
  try {
    bind = bind_address_for(addr);
  } catch (const IoError& e) {
    if (options_.is_host == true) throw;
    log->debug("not hosting the rendezvous endpoint: {}", e.what());
    return;
  }
  store::ServerOptions so = options_.server;
  so.host = bind;
  so.port = static_cast<uint16_t>(options_.endpoint_port);
  try {
    server_ = store::TcpStoreServer::start(so);
    log->info("hosting the rendezvous store on {} port {}", so.host, server_->port());
  } catch (const IoError& e) {
    if (options_.is_host == true) throw;
    // Another agent of this host bound it first: it hosts, this one connects.
    log->debug("rendezvous endpoint already bound on this host, connecting: {}", e.what());
  }
}

RendezvousInfo C10dHandler::next_rendezvous() {
  auto log = get_logger("rdzv");
  const auto start = Clock::now();
  const auto deadline = start + options_.join_timeout;
  const std::string addr = strip_brackets(options_.endpoint_host);
  const std::string endpoint = format_endpoint(addr, options_.endpoint_port);
  host_endpoint_if_ours();

  ConnectRetry retry;
  retry.deadline = deadline;
  retry.wait_log_interval = options_.wait_log_interval;
  retry.op_timeout = options_.read_timeout;
  retry.on_wait = [&](const std::string& why) {
    log->info("rendezvous '{}': waiting for the endpoint {}: {}", options_.run_id, endpoint, why);
  };
  retry.timeout_message = [&](const std::string& why) {
    return "rendezvous '" + options_.run_id + "' timed out after " +
           format_duration(options_.join_timeout) + ": cannot reach the endpoint " + endpoint +
           "; check --rdzv_endpoint and that its host runs (" + why + ")";
  };
  std::shared_ptr<store::TcpStore> conn = connect_until(addr, options_.endpoint_port, retry);
  // torchrun's c10d agents keep one blob under this key of the same store.
  if (conn->check({"torch.rendezvous." + options_.run_id})) {
    throw ConfigError("the endpoint " + endpoint + " holds torchrun's rendezvous for id '" +
                      options_.run_id + "' (key torch.rendezvous." + options_.run_id +
                      "); start every node with ctorchrun, or use another --rdzv_id");
  }

  const std::string job_prefix = std::string(StaticHandler::kNamespace) + "/" + options_.run_id;
  auto job = std::make_shared<store::PrefixStore>(job_prefix, conn);
  C10dSettings settings{options_.min_nodes, options_.max_nodes, options_.max_restarts,
                        options_.entrypoint};
  NodeInfo me;
  me.local_world_size = options_.local_world_size;
  me.max_restarts = options_.max_restarts;
  me.host = options_.host;
  me.pid = static_cast<int>(::getpid());
  me.hosts_endpoint = server_ != nullptr;
  C10dState state(*job, settings, me, options_.last_call_timeout);
  auto next_log = start + options_.wait_log_interval;
  std::optional<C10dRound> round;
  try {
    state.join();
    log->debug("rendezvous '{}': joined round {} as arrival {}", options_.run_id, state.round(),
               state.arrival_index());

    for (;;) {
      round = state.poll();
      if (round) break;
      if (Clock::now() >= deadline) {
        throw TimeoutError("rendezvous '" + options_.run_id + "' timed out after " +
                           format_duration(options_.join_timeout) + ": " + state.progress() +
                           " (endpoint " + endpoint +
                           "); start the other nodes with the same --rdzv_endpoint and --rdzv_id, "
                           "or lower --nnodes' minimum");
      }
      if (Clock::now() >= next_log) {
        next_log = Clock::now() + options_.wait_log_interval;
        log->info("rendezvous '{}': waiting for nodes: {}", options_.run_id, state.progress());
      }
      try {
        job->wait({state.wait_key()},
                  std::clamp(left_until(deadline), milliseconds(1), options_.poll_interval));
      } catch (const TimeoutError&) {
      }
    }
  } catch (const IoError& e) {
    // The endpoint's store went away while the round formed: a rendezvous
    // failure (exit 3), not a set-up one.
    throw Error("lost the rendezvous store at " + endpoint + " while round " +
                std::to_string(std::max(state.round(), 0)) + " formed: " + e.what());
  }

  // The round's workers' store, on group rank 0.
  const std::string workers_key = "rdzv/" + std::to_string(round->round) + "/workers_store";
  std::string workers_addr;
  int workers_port = 0;
  if (round->group_rank == 0) {
    workers_addr = options_.advertise_addr.empty()
                       ? local_address_towards(addr, options_.endpoint_port)
                       : strip_brackets(options_.advertise_addr);
    store::ServerOptions so = options_.server;
    so.host = bind_address_for(workers_addr);  // IoError: not an address of this host
    so.port = 0;
    workers_server_.reset();
    workers_server_ = store::TcpStoreServer::start(so);
    workers_port = workers_server_->port();
    job->set(workers_key, nlohmann::json{{"addr", workers_addr}, {"port", workers_port}}.dump());
  } else {
    workers_server_.reset();
    try {
      job->wait({workers_key}, options_.read_timeout);  // rank 0 sets it right after the round
    } catch (const IoError& e) {
      throw Error("lost the rendezvous store at " + endpoint +
                  " while waiting for the workers' store of round " + std::to_string(round->round) +
                  ": " + e.what());
    }
    auto j = nlohmann::json::parse(job->get(workers_key), nullptr, false);
    if (!j.is_object() || !j.contains("addr") || !j["addr"].is_string() || !j.contains("port") ||
        !j["port"].is_number_integer()) {
      throw ProtocolError("unreadable workers' store address at key '" + workers_key + "'");
    }
    workers_addr = j["addr"].get<std::string>();
    workers_port = j["port"].get<int>();
  }
  log->debug("round {}: the workers' store is at {}:{}", round->round, workers_addr, workers_port);

  const std::string round_prefix = job_prefix + "/r" + std::to_string(round->round);
  RendezvousInfo info;
  info.store = std::make_shared<store::PrefixStore>(round_prefix, conn);
  // Background connections make only quick calls: a frozen store shows as a
  // timeout within seconds.
  info.connect = [addr, port = options_.endpoint_port, round_prefix] {
    return std::make_shared<store::PrefixStore>(
        round_prefix, tcp_client(addr, port, milliseconds(3'000), milliseconds(3'000)));
  };
  info.namespace_prefix = std::string("/") + StaticHandler::kNamespace + "/";
  info.round = round->round;
  info.group_rank = round->group_rank;
  info.group_world_size = static_cast<int>(round->nodes.size());
  info.nodes = round->nodes;
  info.master_addr = workers_addr;
  info.master_port = workers_port;
  if (workers_server_) {
    store::TcpStoreServer* server = workers_server_.get();
    info.clear_worker_keys = [server] { return server->erase_keys_except({}); };
  }
  // The endpoint's host leaves last; with no member hosting it (a standalone
  // store at the endpoint), group rank 0 publishes liveness.
  const bool any_host = std::any_of(round->nodes.begin(), round->nodes.end(),
                                    [](const NodeInfo& n) { return n.hosts_endpoint; });
  info.store_host = any_host ? server_ != nullptr : round->group_rank == 0;
  return info;
}

}  // namespace ctorchrun::rendezvous

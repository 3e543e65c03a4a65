#include "rendezvous/c10d_handler.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/static_handler.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"

namespace ctorchrun::rendezvous {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string seconds(milliseconds d) {
  auto ms = d.count();
  return ms >= 1000 ? std::to_string((ms + 500) / 1000) + "s" : std::to_string(ms) + "ms";
}

milliseconds left_until(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

}  // namespace

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
  const std::string endpoint = (addr.find(':') != std::string::npos ? "[" + addr + "]" : addr) +
                               ":" + std::to_string(options_.endpoint_port);
  host_endpoint_if_ours();

  auto tcp = [addr, port = options_.endpoint_port](milliseconds connect_timeout,
                                                   milliseconds op_timeout) {
    store::TcpStoreOptions o;
    o.host = addr;
    o.port = static_cast<uint16_t>(port);
    o.connect_timeout = connect_timeout;
    o.timeout = op_timeout;
    return std::make_shared<store::TcpStore>(o);
  };
  std::shared_ptr<store::TcpStore> conn;
  for (;;) {
    try {
      conn = tcp(std::clamp(left_until(deadline), milliseconds(1), options_.wait_log_interval),
                 options_.read_timeout);
      break;
    } catch (const TimeoutError& e) {
      if (Clock::now() >= deadline) {
        throw TimeoutError("rendezvous '" + options_.run_id + "' timed out after " +
                           seconds(options_.join_timeout) + ": cannot reach the endpoint " +
                           endpoint + "; check --rdzv_endpoint and that its host runs (" +
                           e.what() + ")");
      }
      log->info("rendezvous '{}': waiting for the endpoint {}: {}", options_.run_id, endpoint,
                e.what());
      std::this_thread::sleep_for(std::min(left_until(deadline), milliseconds(20)));
    }
  }
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
  C10dState state(*job, settings, me, options_.last_call_timeout);
  state.join();
  log->debug("rendezvous '{}': joined round {} as arrival {}", options_.run_id, state.round(),
             state.arrival_index());

  auto next_log = start + options_.wait_log_interval;
  std::optional<C10dRound> round;
  for (;;) {
    round = state.poll();
    if (round) break;
    if (Clock::now() >= deadline) {
      throw TimeoutError("rendezvous '" + options_.run_id + "' timed out after " +
                         seconds(options_.join_timeout) + ": " + state.progress() + " (endpoint " +
                         endpoint +
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

  const std::string round_prefix = job_prefix + "/r" + std::to_string(round->round);
  RendezvousInfo info;
  info.store = std::make_shared<store::PrefixStore>(round_prefix, conn);
  // Background connections make only quick calls: a frozen store shows as a
  // timeout within seconds.
  info.connect = [tcp, round_prefix] {
    return std::make_shared<store::PrefixStore>(round_prefix,
                                                tcp(milliseconds(3'000), milliseconds(3'000)));
  };
  info.namespace_prefix = std::string("/") + StaticHandler::kNamespace + "/";
  info.group_rank = round->group_rank;
  info.group_world_size = static_cast<int>(round->nodes.size());
  info.nodes = round->nodes;
  info.master_addr = addr;
  info.master_port = options_.endpoint_port;
  if (server_) {
    store::TcpStoreServer* server = server_.get();
    std::string keep = info.namespace_prefix;
    info.clear_worker_keys = [server, keep] { return server->erase_keys_except({keep}); };
  }
  return info;
}

}  // namespace ctorchrun::rendezvous

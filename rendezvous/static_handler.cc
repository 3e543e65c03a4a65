#include "rendezvous/static_handler.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/log.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

namespace {

std::string node_key(int rank) { return "nodes/" + std::to_string(rank); }

}  // namespace

StaticHandler::StaticHandler(StaticOptions options) : options_(std::move(options)) {}

StaticHandler::~StaticHandler() = default;

RendezvousInfo StaticHandler::next_rendezvous() {
  auto log = get_logger("rdzv");
  const auto start = std::chrono::steady_clock::now();
  std::string endpoint = options_.master_addr + ":" + std::to_string(options_.master_port);
  int port = options_.master_port;

  if (options_.node_rank == 0 && !server_) {
    store::ServerOptions so = options_.server;
    // As torch's agent binds: reachable on every interface; a job whose master
    // is this machine's loopback address stays on it.
    const std::string& m = options_.master_addr;
    so.host = (m == "localhost" || m.rfind("127.", 0) == 0) ? "127.0.0.1" : "0.0.0.0";
    so.port = static_cast<uint16_t>(options_.master_port);
    server_ = store::TcpStoreServer::start(so);  // IoError names the port
    port = server_->port();
    endpoint = options_.master_addr + ":" + std::to_string(port);
    log->debug("hosting the job's store on port {}", port);
  } else if (server_) {
    port = server_->port();
  }

  const std::string prefix = std::string(kNamespace) + "/" + options_.run_id;
  const std::string addr = options_.master_addr;
  // Each store call of the agents is short; long waits pass their own timeout.
  auto connect = [addr, port, prefix](std::chrono::milliseconds connect_timeout,
                                      std::chrono::milliseconds op_timeout) {
    store::TcpStoreOptions o;
    o.host = addr;
    o.port = static_cast<uint16_t>(port);
    o.connect_timeout = connect_timeout;
    o.timeout = op_timeout;
    return std::make_shared<store::PrefixStore>(prefix, std::make_shared<store::TcpStore>(o));
  };

  std::shared_ptr<store::Store> store;
  try {
    store = connect(options_.timeout, std::chrono::milliseconds(30'000));
  } catch (const TimeoutError& e) {
    throw TimeoutError(
        "rendezvous '" + options_.run_id + "' failed: cannot reach the store of node 0 at " +
        endpoint + " within " + std::to_string(options_.timeout.count() / 1000) +
        "s; check that node 0 runs and that --master_addr/--master_port point to it (" + e.what() +
        ")");
  }

  // Announce ourselves; a rank already taken by someone else is a mistake.
  nlohmann::json me = {{"local_world_size", options_.local_world_size},
                       {"max_restarts", options_.max_restarts},
                       {"host", options_.host},
                       {"pid", static_cast<int>(::getpid())}};
  std::string mine = me.dump();
  std::string got = store->compare_set(node_key(options_.node_rank), "", mine);
  if (got != mine) {
    auto other = nlohmann::json::parse(got, nullptr, false);
    throw ConfigError(
        "node rank " + std::to_string(options_.node_rank) + " is already taken in job '" +
        options_.run_id + "' by host " +
        (other.is_object() ? other.value("host", std::string("?")) : std::string("?")) + " pid " +
        (other.is_object() ? std::to_string(other.value("pid", 0)) : "?") +
        "; give every node a distinct --node_rank");
  }

  std::vector<std::string> keys;
  for (int r = 0; r < options_.nnodes; ++r) keys.push_back(node_key(r));
  auto left = options_.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now() - start);
  try {
    store->wait(keys, std::max(left, std::chrono::milliseconds(1)));
  } catch (const TimeoutError&) {
    std::string missing;
    int joined = 0;
    for (int r = 0; r < options_.nnodes; ++r) {
      if (store->check({node_key(r)})) {
        ++joined;
      } else {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    throw TimeoutError(
        "rendezvous '" + options_.run_id + "' timed out after " +
        std::to_string(options_.timeout.count() / 1000) + "s: " + std::to_string(joined) + " of " +
        std::to_string(options_.nnodes) + " nodes joined (missing node ranks " + missing +
        "; endpoint " + endpoint +
        "); start every node with the same --nnodes, --master_addr and --master_port");
  }

  RendezvousInfo info;
  auto values = store->multi_get(keys);
  // Node 0 keeps the store up until every node has read the others' records,
  // so that a node that finds a mismatch below cannot take the store away from
  // one that has yet to find it (the others would see a closed connection).
  if (store->add("nodes_read", 1) == options_.nnodes) store->set("nodes_all_read", "1");
  if (options_.node_rank == 0) {
    try {
      store->wait({"nodes_all_read"},
                  std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(10)));
    } catch (const TimeoutError&) {
      // A node died between joining and reading: the job will notice.
    }
  }
  for (int r = 0; r < options_.nnodes; ++r) {
    auto j = nlohmann::json::parse(values[static_cast<size_t>(r)], nullptr, false);
    if (!j.is_object())
      throw ProtocolError("node " + std::to_string(r) + " announced an unreadable record");
    NodeInfo n;
    n.group_rank = r;
    n.local_world_size = j.value("local_world_size", 0);
    n.max_restarts = j.value("max_restarts", 0);
    n.host = j.value("host", std::string());
    n.pid = j.value("pid", 0);
    if (n.max_restarts != options_.max_restarts) {
      throw ConfigError("nodes disagree on --max_restarts: node " + std::to_string(r) + " (" +
                        n.host + ") has " + std::to_string(n.max_restarts) + ", node " +
                        std::to_string(options_.node_rank) + " has " +
                        std::to_string(options_.max_restarts) + "; give every node the same value");
    }
    info.nodes.push_back(n);
  }
  info.store = store;
  // Background connections make only quick calls: a frozen store shows as a
  // timeout within seconds.
  info.connect = [connect] {
    return connect(std::chrono::milliseconds(3'000), std::chrono::milliseconds(3'000));
  };
  info.namespace_prefix = std::string("/") + kNamespace + "/";
  info.group_rank = options_.node_rank;
  info.group_world_size = options_.nnodes;
  info.master_addr = options_.master_addr;
  info.master_port = port;
  if (server_) {
    store::TcpStoreServer* server = server_.get();
    std::string keep = info.namespace_prefix;
    info.clear_worker_keys = [server, keep] { return server->erase_keys_except({keep}); };
  }
  return info;
}

}  // namespace ctorchrun::rendezvous

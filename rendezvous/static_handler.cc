#include "rendezvous/static_handler.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/node_record.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Keys of the store's root namespace ("ctorchrun/"): one job per store.
constexpr const char* kJobKey = "job";        // the job's settings, by node 0
constexpr const char* kFormedKey = "formed";  // every node has announced itself
// Keys of the job's namespace ("ctorchrun/<run_id>/").
constexpr const char* kRefusedKey = "refused";  // why a node of this job refused it
std::string node_key(int rank) { return "nodes/" + std::to_string(rank); }

int int_setting(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) {
    throw ProtocolError("the job's settings at " + where + " lack an integer '" + key + "'");
  }
  return it->get<int>();
}

}  // namespace

StaticHandler::StaticHandler(StaticOptions options) : options_(std::move(options)) {}

StaticHandler::~StaticHandler() = default;

int StaticHandler::check_admission(store::Store& root, store::Store& job,
                                   const std::string& endpoint) {
  auto log = get_logger("rdzv");
  const std::string raw = root.get(kJobKey);
  auto settings = json_text::parse_record(raw);
  if (!settings.is_object() || !settings.contains("run_id") || !settings["run_id"].is_string()) {
    throw ProtocolError("unreadable job settings at key 'ctorchrun/" + std::string(kJobKey) +
                        "' of the store at " + endpoint + ": " + json_text::utf8_prefix(raw, 200));
  }
  const std::string run_id = settings["run_id"].get<std::string>();
  const int nnodes = int_setting(settings, "nnodes", endpoint);
  const int max_restarts = int_setting(settings, "max_restarts", endpoint);
  if (run_id != options_.job.run_id) {
    throw RendezvousClosedError("the store at " + endpoint + " serves job '" + run_id + "', not '" +
                                options_.job.run_id +
                                "'; check --master_addr/--master_port and --rdzv_id");
  }
  if (root.check({kFormedKey})) {
    throw RendezvousClosedError("job '" + run_id + "' at " + endpoint + " has already formed (" +
                                std::to_string(nnodes) +
                                " nodes) and admits no other node; check --master_port, or "
                                "start this node with the job's other nodes");
  }
  auto differ = [&](const char* flag, int theirs, int mine) {
    std::string why = std::string("nodes disagree on ") + flag + ": node 0 has " +
                      std::to_string(theirs) + ", node " + std::to_string(options_.node_rank) +
                      " (" + options_.job.host + ") has " + std::to_string(mine) +
                      "; give every node the same value";
    // Same job, not formed yet: tell the others, so that they stop too.
    job.compare_set(kRefusedKey, "", why);
    log->debug("refusing job '{}': {}", run_id, why);
    throw ConfigError(why);
  };
  if (nnodes != options_.job.max_nodes) differ("--nnodes", nnodes, options_.job.max_nodes);
  if (max_restarts != options_.job.max_restarts) {
    differ("--max_restarts", max_restarts, options_.job.max_restarts);
  }
  return max_restarts;
}

void StaticHandler::await_nodes(store::Store& job, const std::vector<std::string>& keys,
                                Clock::time_point deadline, const std::string& endpoint) {
  auto log = get_logger("rdzv");
  auto next_log = Clock::now() + options_.wait_log_interval;
  auto missing = [&] {
    std::string m;
    int joined = 0;
    for (int r = 0; r < options_.job.max_nodes; ++r) {
      if (job.check({node_key(r)})) {
        ++joined;
      } else {
        m += (m.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return std::to_string(joined) + " of " + std::to_string(options_.job.max_nodes) +
           " nodes joined (missing node ranks " + m + "; endpoint " + endpoint + ")";
  };
  for (;;) {
    try {
      job.wait(keys, std::clamp(left_until(deadline), milliseconds(1), milliseconds(200)));
      return;
    } catch (const TimeoutError&) {
    }
    if (job.check({kRefusedKey})) throw ConfigError(job.get(kRefusedKey));
    if (Clock::now() >= deadline) {
      throw TimeoutError("rendezvous '" + options_.job.run_id + "' timed out after " +
                         format_duration(options_.timeout) + ": " + missing() +
                         "; start every node with the same --nnodes, --master_addr and "
                         "--master_port");
    }
    if (Clock::now() >= next_log) {
      next_log = Clock::now() + options_.wait_log_interval;
      log->info("rendezvous '{}': waiting for the other nodes: {}", options_.job.run_id, missing());
    }
  }
}

RendezvousInfo StaticHandler::next_rendezvous() {
  auto log = get_logger("rdzv");
  const auto start = Clock::now();
  const auto deadline = start + options_.timeout;
  const std::string addr = strip_brackets(options_.master_addr);
  int port = options_.master_port;
  std::string endpoint = format_endpoint(addr, port);

  if (options_.node_rank == 0 && !server_) {
    // Both families of a loopback master_addr, so that nodes spelling it
    // 127.0.0.1, [::1] or localhost all reach it.
    const auto bind = bind_addresses_for(addr);  // IoError: not resolvable, not this host
    store::ServerOptions so = options_.job.server;
    so.host = bind.front();
    so.also_hosts.assign(bind.begin() + 1, bind.end());
    so.port = static_cast<uint16_t>(options_.master_port);
    auto server = store::TcpStoreServer::start(so);  // IoError names the address and port
    std::lock_guard<std::mutex> lock(server_mutex_);
    server_ = std::move(server);
    port = server_->port();
    endpoint = format_endpoint(addr, port);
    std::string where;
    for (const auto& h : server_->hosts()) where += (where.empty() ? "" : " and ") + h;
    log->debug("hosting the job's store on {} port {}", where, port);
  } else if (server_) {
    port = server_->port();
    endpoint = format_endpoint(addr, port);
  }

  const std::string prefix = std::string(kNamespace) + "/" + options_.job.run_id;
  // Each store call of the agents is short; long waits pass their own timeout.
  auto connect = [addr, port, prefix](milliseconds connect_timeout, milliseconds op_timeout) {
    return std::make_shared<store::PrefixStore>(
        prefix, tcp_client(addr, port, connect_timeout, op_timeout));
  };

  // Reach node 0's store, as torch's client does: retry an address that does
  // not resolve or answer until the rendezvous timeout, saying what we wait for.
  ConnectRetry retry;
  retry.deadline = deadline;
  retry.wait_log_interval = options_.wait_log_interval;
  retry.on_wait = [&](const std::string& why) {
    log->info("rendezvous '{}': waiting for node 0's store at {} ({} of {} left): {}",
              options_.job.run_id, endpoint, format_duration(left_until(deadline)),
              format_duration(options_.timeout), why);
  };
  retry.timeout_message = [&](const std::string& why) {
    return "rendezvous '" + options_.job.run_id + "' failed: cannot reach the store of node 0 at " +
           endpoint + " within " + format_duration(options_.timeout) +
           "; check that node 0 runs and that --master_addr/--master_port point to it (" + why +
           ")";
  };
  std::shared_ptr<store::TcpStore> conn = connect_until(addr, port, retry);
  auto root = std::make_shared<store::PrefixStore>(kNamespace, conn);
  auto store = std::make_shared<store::PrefixStore>(prefix, conn);

  // The job's max_restarts: node 0's, as its record says; every node uses it.
  int agreed_max_restarts = options_.job.max_restarts;
  if (options_.node_rank == 0) {
    // Before any node can announce itself: what this job is.
    nlohmann::json settings = {{"run_id", options_.job.run_id},
                               {"nnodes", options_.job.max_nodes},
                               {"max_restarts", options_.job.max_restarts}};
    root->set(kJobKey, json_text::dump_record(settings));
  } else {
    for (;;) {
      try {
        root->wait({kJobKey},
                   std::clamp(left_until(deadline), milliseconds(1), options_.wait_log_interval));
        break;
      } catch (const TimeoutError&) {
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError("rendezvous '" + options_.job.run_id + "' timed out after " +
                           format_duration(options_.timeout) + ": the store at " + endpoint +
                           " never said which job it serves; is it node 0 of a ctorchrun job?");
      }
      log->info("rendezvous '{}': waiting for node 0 at {} to publish the job's settings",
                options_.job.run_id, endpoint);
    }
    agreed_max_restarts = check_admission(*root, *store, endpoint);
  }

  // Announce ourselves; a rank already taken by someone else is a mistake.
  NodeInfo self;
  self.local_world_size = options_.job.local_world_size;
  self.host = options_.job.host;
  self.pid = static_cast<int>(::getpid());
  self.hosts_endpoint = options_.node_rank == 0;
  std::string mine = json_text::dump_record(node_record(self));
  std::string got = store->compare_set(node_key(options_.node_rank), "", mine);
  if (got != mine) {
    auto other = json_text::parse_record(got);
    auto host = other.is_object() && other.contains("host") && other["host"].is_string()
                    ? other["host"].get<std::string>()
                    : std::string("?");
    auto pid = other.is_object() && other.contains("pid") && other["pid"].is_number_integer()
                   ? std::to_string(other["pid"].get<int64_t>())
                   : std::string("?");
    throw ConfigError("node rank " + std::to_string(options_.node_rank) +
                      " is already taken in job '" + options_.job.run_id + "' by host " + host +
                      " pid " + pid + "; give every node a distinct --node_rank");
  }

  std::vector<std::string> keys;
  for (int r = 0; r < options_.job.max_nodes; ++r) keys.push_back(node_key(r));
  await_nodes(*store, keys, deadline, endpoint);
  if (options_.node_rank == 0) root->set(kFormedKey, "1");

  RendezvousInfo info;
  auto values = store->multi_get(keys);
  // Node 0 keeps the store up until every node has read the others' records,
  // so that a node that finds a mismatch below cannot take the store away from
  // one that has yet to find it (the others would see a closed connection).
  if (store->add("nodes_read", 1) == options_.job.max_nodes) store->set("nodes_all_read", "1");
  if (options_.node_rank == 0) {
    try {
      store->wait({"nodes_all_read"},
                  std::min<milliseconds>(options_.timeout, milliseconds(10'000)));
    } catch (const TimeoutError&) {
      // A node died between joining and reading: the job will notice.
    }
  }
  for (int r = 0; r < options_.job.max_nodes; ++r) {
    const std::string key = node_key(r);
    auto j = json_text::parse_record(values[static_cast<size_t>(r)]);
    NodeInfo n = parse_node_record(j, key);  // ProtocolError naming the key
    n.group_rank = r;
    info.nodes.push_back(n);
  }
  info.store = store;
  info.max_restarts = agreed_max_restarts;
  // Background connections make only quick calls: a frozen store shows as a
  // timeout within seconds.
  info.connect = [connect] { return connect(milliseconds(3'000), milliseconds(3'000)); };
  info.namespace_prefix = std::string("/") + kNamespace + "/";
  info.group_rank = options_.node_rank;
  info.group_world_size = options_.job.max_nodes;
  info.master_addr = addr;
  info.master_port = port;
  if (server_) {
    store::TcpStoreServer* server = server_.get();
    std::string keep = info.namespace_prefix;
    info.clear_worker_keys = [server, keep] { return server->erase_keys_except({keep}); };
  }
  return info;
}

std::vector<HostedStore> StaticHandler::hosted_stores() {
  std::lock_guard<std::mutex> lock(server_mutex_);
  if (!server_) return {};
  return {{"job", server_->stats()}};
}

}  // namespace ctorchrun::rendezvous

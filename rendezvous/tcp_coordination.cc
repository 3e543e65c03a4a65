// TcpCoordination (rendezvous/coordination.h): the agents of a c10d job
// coordinate through the TCP store at --rdzv_endpoint, hosted by the agent
// whose host owns the endpoint's address (or a standalone ctorch-store).

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"
#include "rendezvous/coordination.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/static_handler.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::rendezvous {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

class TcpCoordination : public Coordination {
 public:
  explicit TcpCoordination(const C10dOptions& options) : options_(options) {}

  void open() override {
    auto log = get_logger("rdzv");
    const auto deadline = Clock::now() + options_.join_timeout;
    const std::string addr = strip_brackets(options_.endpoint_host);
    const int port = options_.endpoint_port;
    endpoint_ = format_endpoint(addr, port);
    // Which agent hosts is decided from the name's addresses: wait for them
    // (within join_timeout) rather than decide from a failed lookup.
    await_resolvable(addr, deadline, options_.wait_log_interval, [&] {
      log->info("rendezvous '{}': waiting for the endpoint's name {} to resolve",
                options_.job.run_id, addr);
    });
    host_endpoint_if_ours();
    ConnectRetry retry;
    retry.deadline = deadline;
    retry.wait_log_interval = options_.wait_log_interval;
    retry.op_timeout = options_.read_timeout;
    retry.on_wait = [&](const std::string& why) {
      log->info("rendezvous '{}': waiting for the endpoint {}: {}", options_.job.run_id, endpoint_,
                why);
    };
    retry.timeout_message = [&](const std::string& why) {
      return "rendezvous '" + options_.job.run_id + "' timed out after " +
             format_duration(options_.join_timeout) + ": cannot reach the endpoint " + endpoint_ +
             "; check --rdzv_endpoint and that its host runs (" + why + ")";
    };
    conn_ = connect_until(addr, port, retry);
    // torchrun's c10d agents keep one blob under this key of the same store.
    if (conn_->check({"torch.rendezvous." + options_.job.run_id})) {
      throw ConfigError("the endpoint " + endpoint_ + " holds torchrun's rendezvous for id '" +
                        options_.job.run_id + "' (key torch.rendezvous." + options_.job.run_id +
                        "); start every node with ctorchrun, or use another --rdzv_id");
    }
    job_prefix_ = std::string(StaticHandler::kNamespace) + "/" + options_.job.run_id;
    // This agent's presence: a connection whose keys vanish with it
    // (store/protocol.h's BIND_KEYS). A store without the extension leaves
    // the heartbeats to notice a lost agent.
    try {
      // Quick calls only (a record, a presence key): a store that does not
      // answer within seconds must not hold up an agent that leaves.
      auto c = tcp_client(addr, port, milliseconds(3'000), milliseconds(3'000));
      c->bind_keys_to_connection();
      presence_ = std::make_shared<store::PrefixStore>(job_prefix_, c);
    } catch (const store::NotSupportedError& e) {
      presence_.reset();
      log->info(
          "the store at the endpoint {} cannot bind keys to a connection ({}); lost nodes are "
          "noticed by their heartbeats alone",
          endpoint_, e.what());
    }
  }

  const std::string& describe() const override { return endpoint_; }
  std::shared_ptr<store::Store> store() const override { return conn_; }
  const std::string& job_prefix() const override { return job_prefix_; }
  OpenStore background() const override {
    return [addr = strip_brackets(options_.endpoint_host), port = options_.endpoint_port](
               const std::string& prefix, milliseconds timeout) -> std::shared_ptr<store::Store> {
      auto s =
          std::make_shared<store::PrefixStore>(prefix, tcp_client(addr, port, timeout, timeout));
      s->set_timeout(timeout);
      return s;
    };
  }
  std::shared_ptr<store::Store> presence() const override { return presence_; }
  bool hosts_endpoint() const override {
    std::lock_guard<std::mutex> lock(server_mutex_);
    return server_ != nullptr;
  }
  std::optional<store::TcpStoreServer::Stats> endpoint_stats() override {
    std::lock_guard<std::mutex> lock(server_mutex_);
    if (!server_) return std::nullopt;
    return server_->stats();
  }

  Endpoint route_target() const override {
    return {strip_brackets(options_.endpoint_host), options_.endpoint_port};
  }
  // One store: its silence for read_timeout ends the job (the defaults).
  void set_tolerance(RendezvousInfo&) const override {}

  MembershipCheck membership_check(const C10dRound&, MembershipCheck full_check,
                                   std::function<bool()>) override {
    return full_check;  // a few reads a monitor tick
  }
  // A lost agent's presence goes with its connection, at once.
  bool probes_rank0() const override { return false; }
  bool renew() override { return false; }
  // The endpoint's store goes with the job.
  std::function<void()> tidy(const C10dRound&) const override { return nullptr; }
  // Bound keys go when the agent's connection closes.
  void abandon() noexcept override {}

 private:
  // With is_host unset, an agent whose host owns the endpoint's address tries
  // to bind it; when another agent of this host already did, or the address
  // is not this host's, it connects as a client. is_host=1 makes a failed
  // bind an IoError; is_host=0 never binds.
  void host_endpoint_if_ours() {
    if (hosts_endpoint() || options_.is_host == false) return;
    auto log = get_logger("rdzv");
    const std::string addr = strip_brackets(options_.endpoint_host);
    std::vector<std::string> bind;
    try {
      // Every address family the endpoint's spellings reach (127.0.0.1 and
      // ::1 for localhost), so that agents that spell it differently meet here.
      bind = bind_addresses_for(addr);
    } catch (const IoError& e) {
      if (options_.is_host == true) throw;
      log->debug("not hosting the rendezvous endpoint: {}", e.what());
      return;
    }
    store::ServerOptions so = options_.job.server;
    so.host = bind.front();
    so.also_hosts.assign(bind.begin() + 1, bind.end());
    so.port = static_cast<uint16_t>(options_.endpoint_port);
    try {
      // All or nothing: an agent of this host that holds any of them hosts.
      auto server = store::TcpStoreServer::start(so);
      std::lock_guard<std::mutex> lock(server_mutex_);
      server_ = std::move(server);
      std::string where;
      for (const auto& h : server_->hosts()) where += (where.empty() ? "" : " and ") + h;
      log->info("hosting the rendezvous store on {} port {}", where, server_->port());
    } catch (const IoError& e) {
      if (options_.is_host == true) throw;
      // Another agent of this host bound it first: it hosts, this one connects.
      log->debug("rendezvous endpoint already bound on this host, connecting: {}", e.what());
    }
  }

  const C10dOptions options_;
  std::string endpoint_;
  std::string job_prefix_;
  std::shared_ptr<store::TcpStore> conn_;
  std::shared_ptr<store::Store> presence_;
  // The endpoint's store, when ours; the mutex for the status sampler's reads.
  mutable std::mutex server_mutex_;
  std::unique_ptr<store::TcpStoreServer> server_;
};

}  // namespace

std::unique_ptr<Coordination> make_tcp_coordination(const C10dOptions& options) {
  return std::make_unique<TcpCoordination>(options);
}

}  // namespace ctorchrun::rendezvous

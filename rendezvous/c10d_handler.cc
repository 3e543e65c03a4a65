#include "rendezvous/c10d_handler.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common/deadline.h"
#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"
#include "rendezvous/c10d_state.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/host_probe.h"
#include "rendezvous/static_handler.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"

namespace ctorchrun::rendezvous {

namespace {
// Round rank 0 died before it published the workers' store.
struct RankZeroLost {};
}  // namespace

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

namespace {
// What the c10d rendezvous makes the nodes agree on.
C10dSettings settings_of(const JobSettings& job) {
  return C10dSettings{job.min_nodes, job.max_nodes, job.max_restarts, job.entrypoint};
}
}  // namespace

milliseconds wait_slice(milliseconds poll_interval, milliseconds until_last_call,
                        milliseconds until_deadline) {
  milliseconds slice = poll_interval;
  // until_last_call is max() when no last call runs: no arithmetic on it then.
  if (until_last_call < poll_interval) slice = until_last_call + milliseconds(1);
  slice = std::min(slice, until_deadline);
  return std::clamp(slice, milliseconds(1), std::max(poll_interval, milliseconds(1)));
}

C10dHandler::C10dHandler(C10dOptions options) : options_(std::move(options)) {}

C10dHandler::~C10dHandler() {
  // Leaving by any path: the presence lease goes now, not at its expiry (its
  // keys were withdrawn on purpose already where that mattered).
  abandon();
}

void C10dHandler::abandon() noexcept {
  // From the signal thread too, while the agent's thread may be making
  // coord_: the pointer published once it is whole.
  if (Coordination* coord = coord_live_.load()) coord->abandon();
}

void C10dHandler::renew_presence() {
  // Keys of a lost presence went with it: the presence key is written anew.
  if (coord_->renew()) presence_key_.clear();
}

RendezvousInfo C10dHandler::next_rendezvous() {
  CTORCHRUN_CHECK(!state_, "C10dHandler::next_rendezvous() called twice; use next_round()");
  auto log = get_logger("rdzv");
  coord_ = make_coordination(options_);
  coord_live_.store(coord_.get());
  coord_->open();
  endpoint_ = coord_->describe();
  job_prefix_ = coord_->job_prefix();
  conn_ = coord_->store();
  open_background_ = coord_->background();
  presence_ = coord_->presence();
  job_ = std::make_shared<store::PrefixStore>(job_prefix_, conn_);
  C10dSettings settings = settings_of(options_.job);
  NodeInfo me;
  me.local_world_size = options_.job.local_world_size;
  me.host = options_.job.host;
  me.pid = static_cast<int>(::getpid());
  me.hosts_endpoint = coord_->hosts_endpoint();
  C10dTiming timing;
  timing.last_call_timeout = options_.last_call_timeout;
  timing.closed_window = options_.closed_window.value_or(options_.join_timeout);
  state_ = std::make_unique<C10dState>(*job_, settings, me, timing, C10dState::Clock::now,
                                       C10dState::WallClock::now, presence_.get());
  try {
    state_->join();
  } catch (const IoError& e) {
    throw Error("lost the rendezvous store at " + endpoint_ + " while joining: " + e.what());
  }
  log->debug("rendezvous '{}': entered round {} of generation {} as {}", options_.job.run_id,
             state_->round(), state_->generation(), state_->slot());
  return form();
}

RendezvousInfo C10dHandler::next_round(const MembershipChange& change, int attempt) {
  CTORCHRUN_CHECK(state_ && round_, "C10dHandler::next_round() before a round formed");
  try {
    rejoin(*round_, attempt, change.lost);
  } catch (const IoError& e) {
    throw Error("lost the rendezvous store at " + endpoint_ + " while round " +
                std::to_string(round_->round + 1) + " formed: " + e.what());
  }
  return form();
}

void C10dHandler::rejoin(const C10dRound& previous, int attempt, const std::vector<int>& lost) {
  renew_presence();
  if (options_.before_entry) options_.before_entry();
  try {
    state_->rejoin(previous, attempt, lost);
  } catch (const IoError&) {
    throw;
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    // An operator's `etcdctl lease revoke`, or etcd losing the lease, after
    // renew_presence() found it alive: the entry's first write (its record,
    // on the lease) failed, so nothing of it was written. Anything else (the
    // lease still held, or the entry not begun) is the error it is.
    if (state_->round() == previous.round || !coord_->renew()) throw;
    presence_key_.clear();
    get_logger("rdzv")->warn(
        "rendezvous '{}': this node's lease went while it entered round {} ({}); entering it "
        "again under a new lease",
        options_.job.run_id, state_->round(), e.what());
    state_->reenter();
  }
}

RendezvousInfo C10dHandler::form() {
  for (int tries = 0;; ++tries) {
    C10dRound round;
    try {
      round = form_round();
    } catch (const JobClosedError&) {
      if (coord_->hosts_endpoint()) linger_for_members();
      throw;
    }
    round_ = round;
    try {
      return round_info(round);
    } catch (const RankZeroLost&) {
      CTORCHRUN_CHECK(tries < 1000, "the workers' store host kept vanishing");
      get_logger("rdzv")->warn(
          "rendezvous '{}': node 0 of round {} ({}) was lost before it served the workers' store; "
          "forming the next round",
          options_.job.run_id, round.round, round.node0.host);
      C10dSettings settings = settings_of(options_.job);
      C10dRoundWatch watch(*job_, settings, round, options_.last_call_timeout);
      auto change = watch.reform(
          {"node 0 was lost before it served the workers' store", {0}, "agent exited"});
      rejoin(round, round.attempt, change.lost);
    }
  }
}

void C10dHandler::linger_for_members() {
  // This waiting node hosts the endpoint's store: the members of the job
  // that just ended still need it to leave. Until their presence keys are
  // gone (withdrawn or dead), at most 10 s.
  if (state_->round() < 1) return;
  const int running = state_->round() - 1;
  const auto until = Clock::now() + milliseconds(10'000);
  try {
    for (int g = 0; g < options_.job.max_nodes && Clock::now() < until; ++g) {
      const std::string key = C10dRoundWatch::present_key(state_->generation(), running, g);
      while (job_->check({key}) && Clock::now() < until) {
        std::this_thread::sleep_for(milliseconds(50));
      }
    }
  } catch (const Error&) {
    // Nothing left to serve.
  }
}

C10dRound C10dHandler::form_round() {
  auto log = get_logger("rdzv");
  auto deadline = Clock::now() + options_.join_timeout;
  auto next_log = Clock::now() + options_.wait_log_interval;
  bool was_waiting = false;
  int waiting_round = -1;
  int polls = 0;
  const auto started = Clock::now();
  std::optional<C10dRound> round;
  try {
    for (;;) {
      round = state_->poll();
      ++polls;
      if (round) break;
      if (state_->waiting()) {
        // The job runs: wait for it as long as it does.
        deadline = Clock::now() + options_.join_timeout;
        if (!was_waiting || waiting_round != state_->round()) {
          if (state_->spare()) {
            log->info(
                "rendezvous '{}': the job runs with its maximum of {} nodes; waiting as a spare "
                "for a place in a later round",
                options_.job.run_id, options_.job.max_nodes);
          } else {
            log->info(
                "rendezvous '{}': the job is running; waiting to be admitted at its next "
                "re-formation",
                options_.job.run_id);
          }
        }
        was_waiting = true;
        waiting_round = state_->round();
      } else if (Clock::now() >= deadline) {
        throw TimeoutError("rendezvous '" + options_.job.run_id + "' timed out after " +
                           format_duration(options_.join_timeout) + ": " + state_->progress() +
                           " (endpoint " + endpoint_ +
                           "); start the other nodes with the same --rdzv_endpoint and --rdzv_id, "
                           "or lower --nnodes' minimum");
      } else if (Clock::now() >= next_log) {
        next_log = Clock::now() + options_.wait_log_interval;
        log->info("rendezvous '{}': waiting for nodes: {}", options_.job.run_id,
                  state_->progress());
      }
      const auto slice =
          wait_slice(options_.poll_interval, state_->until_last_call(), left_until(deadline));
      try {
        job_->wait({state_->wait_key()}, slice);
      } catch (const TimeoutError&) {
      }
    }
  } catch (const IoError& e) {
    // The endpoint's store went away while the round formed: a rendezvous
    // failure (exit 3), not a set-up one.
    throw Error("lost the rendezvous store at " + endpoint_ + " while round " +
                std::to_string(std::max(state_->round(), 0)) + " formed: " + e.what());
  }
  log->debug("rendezvous '{}': round {} formed after {} polls in {}", options_.job.run_id,
             round->round, polls,
             format_duration(std::chrono::duration_cast<milliseconds>(Clock::now() - started)));
  return *round;
}

RendezvousInfo C10dHandler::round_info(const C10dRound& round) {
  const WorkersStore workers = publish_workers_store(round);
  const std::string round_prefix =
      job_prefix_ + "/g" + std::to_string(round.generation) + "/r" + std::to_string(round.round);
  RendezvousInfo info;
  info.store = std::make_shared<store::PrefixStore>(round_prefix, conn_);
  // Background connections make only quick calls: a frozen store shows as a
  // timeout within seconds.
  info.connect = [open = open_background_, round_prefix, t = options_.monitor_timeout] {
    return open(round_prefix, t);
  };
  info.namespace_prefix = std::string("/") + StaticHandler::kNamespace + "/";
  info.round = round.round;
  info.group_rank = round.group_rank;
  info.group_world_size = round.roster.size();
  info.world_size = static_cast<int>(round.roster.world_size());
  info.base_rank = static_cast<int>(round.roster.first_rank(round.group_rank));
  // The members' records only on demand (events, messages naming hosts):
  // one read of O(N) bytes, on the agent's main connection.
  info.read_nodes = [job = job_, round] { return C10dState::read_members(*job, round); };
  info.master_addr = workers.addr;
  info.master_port = workers.port;
  info.attempt = round.attempt;
  info.max_restarts = round.max_restarts;
  if (workers_server_) {
    store::TcpStoreServer* server = workers_server_.get();
    info.clear_worker_keys = [server] { return server->erase_keys_except({}); };
  }
  // The endpoint's host leaves last; with no member hosting it (a standalone
  // store at the endpoint), group rank 0 publishes liveness.
  const bool any_host = round.endpoint_node >= 0;
  info.store_host = any_host ? coord_->hosts_endpoint() : round.group_rank == 0;

  info.store_endpoint = endpoint_;
  coord_->set_tolerance(info);

  hold_presence(round, info);
  watch_membership(round, workers, info);
  set_up_ending(round, info);
  return info;
}

C10dHandler::WorkersStore C10dHandler::publish_workers_store(const C10dRound& round) {
  auto log = get_logger("rdzv");
  // Towards the agents' store (the endpoint, or the first etcd member): the
  // route that gives the workers' store its address.
  const Endpoint towards = coord_->route_target();
  const std::string& addr = towards.host;
  const int port = towards.port;
  // The round's workers' store, on group rank 0.
  const std::string workers_key =
      C10dState::round_key(round.generation, round.round, "workers_store");
  std::string workers_addr;
  int workers_port = 0;
  {
    std::lock_guard<std::mutex> lock(servers_mutex_);
    workers_server_.reset();  // the last round's workers are stopped
  }
  if (round.group_rank == 0) {
    workers_addr = options_.advertise_addr.empty() ? local_address_towards(addr, port)
                                                   : strip_brackets(options_.advertise_addr);
    store::ServerOptions so = options_.job.server;
    so.host = bind_address_for(workers_addr);  // IoError: not an address of this host
    so.port = 0;
    auto server = store::TcpStoreServer::start(so);
    workers_port = server->port();
    std::lock_guard<std::mutex> lock(servers_mutex_);
    workers_server_ = std::move(server);
    job_->set(workers_key,
              json_text::dump_record({{"addr", workers_addr}, {"port", workers_port}}));
  } else {
    // Rank 0 sets it right after the round; if rank 0 dies first (its
    // record's gone marker), the round re-forms without it.
    const std::string rank0_gone =
        C10dState::round_key(round.generation, round.round, "node/" + round.roster.slot(0)) +
        store::protocol::kGoneSuffix;
    const auto until = Clock::now() + options_.read_timeout;
    for (;;) {
      try {
        job_->wait({workers_key},
                   std::clamp(left_until(until), milliseconds(1), milliseconds(250)));
        break;
      } catch (const TimeoutError&) {
        if (presence_ && job_->check({rank0_gone})) throw RankZeroLost{};
        if (Clock::now() >= until) {
          throw TimeoutError("node 0 of round " + std::to_string(round.round) + " (" +
                             round.node0.host + ", pid " + std::to_string(round.node0.pid) +
                             ") did not publish the workers' store within read_timeout (" +
                             format_duration(options_.read_timeout) + ")");
        }
      } catch (const IoError& e) {
        throw Error("lost the rendezvous store at " + endpoint_ +
                    " while waiting for the workers' store of round " +
                    std::to_string(round.round) + ": " + e.what());
      }
    }
    auto j = json_text::parse_record(job_->get(workers_key));
    if (!j.is_object() || !j.contains("addr") || !j["addr"].is_string() || !j.contains("port") ||
        !j["port"].is_number_integer() || j["port"].get<int64_t>() < 1 ||
        j["port"].get<int64_t>() > 65535 || j["addr"].get<std::string>().empty() ||
        j["addr"].get<std::string>().size() > 255) {
      throw ProtocolError("unreadable workers' store address at key '" + workers_key + "'");
    }
    workers_addr = j["addr"].get<std::string>();
    workers_port = static_cast<int>(j["port"].get<int64_t>());
  }
  log->debug("round {}: the workers' store is at {}:{}", round.round, workers_addr, workers_port);
  return {workers_addr, workers_port};
}

void C10dHandler::hold_presence(const C10dRound& round, RendezvousInfo& info) {
  // This member's presence: a key bound to a connection of its own, so that
  // it vanishes with this agent (store/protocol.h's BIND_KEYS). A store
  // without the extension leaves the heartbeats to notice a lost agent.
  if (presence_ && !presence_key_.empty()) presence_->delete_key(presence_key_);
  presence_key_.clear();
  if (presence_) {
    presence_key_ = C10dRoundWatch::present_key(round.generation, round.round, round.group_rank);
    presence_->set(presence_key_, std::to_string(::getpid()));
  }
  auto presence = presence_;
  info.withdraw = [presence, round] {
    if (!presence) return;
    try {
      // Deleted on purpose: no gone marker, so nobody takes this node for
      // lost.
      C10dRoundWatch::withdraw(*presence, round);
    } catch (const Error&) {
      // The store is gone: nobody is left to mistake this node for lost.
    }
  };

  info.stopping = [target = presence ? presence : job_, round](milliseconds grace) {
    try {
      C10dRoundWatch::announce_stopping(*target, round, grace);
    } catch (const Error& e) {
      get_logger("rdzv")->debug("could not announce stopping the workers: {}", e.what());
    }
  };

  info.depart = [open = open_background_, prefix = job_prefix_, g = round.generation,
                 r = round.round, rank = round.group_rank, withdraw = info.withdraw] {
    try {
      // A connection of its own, with a short timeout: the agent's may wait
      // on a store that no longer answers. Not the presence connection, whose
      // keys vanish with this agent.
      auto job = open(prefix, milliseconds(3'000));
      C10dRoundWatch::leave(*job, g, r, rank);
    } catch (const Error& e) {
      get_logger("rdzv")->debug("could not announce leaving round {}: {}", r, e.what());
    }
    withdraw();
  };
}

void C10dHandler::watch_membership(const C10dRound& round, const WorkersStore& workers,
                                   RendezvousInfo& info) {
  const std::string& workers_addr = workers.addr;
  const int workers_port = workers.port;
  // The monitor's view of the round: a connection of its own, opened on first
  // use and again after an error (which also restarts the admission timer).
  // The agent's thread may re-form the round too: a mutex keeps them apart.
  struct Watcher {
    std::mutex mutex;
    std::shared_ptr<store::Store> job;
    std::unique_ptr<C10dRoundWatch> watch;
    std::shared_ptr<HostProbe> rank0;
  };
  auto watcher = std::make_shared<Watcher>();
  C10dSettings settings = settings_of(options_.job);
  // Where presence goes only seconds after a loss (etcd), rank 0's death
  // shows at once as its workers' store closing.
  const bool probe_rank0 = coord_->probes_rank0() && round.group_rank != 0;
  auto call = [watcher, open = open_background_, prefix = job_prefix_, settings, round,
               lct = options_.last_call_timeout, probe_rank0, workers_addr,
               workers_port](auto&& fn) {
    std::lock_guard<std::mutex> lock(watcher->mutex);
    try {
      if (!watcher->watch) {
        watcher->job = open(prefix, milliseconds(3'000));
        watcher->watch = std::make_unique<C10dRoundWatch>(*watcher->job, settings, round, lct);
        if (probe_rank0) {
          if (!watcher->rank0) {
            watcher->rank0 = std::make_shared<HostProbe>(
                workers_addr, static_cast<std::uint16_t>(workers_port), milliseconds(1'000));
          }
          watcher->watch->set_rank0_probe([probe = watcher->rank0] { return probe->gone(); });
        }
      }
      return fn(*watcher->watch);
    } catch (const Error& e) {
      if (dynamic_cast<const ProtocolError*>(&e) == nullptr) {
        watcher->watch.reset();
        watcher->job.reset();
      }
      throw;
    }
  };
  auto full_check = [call](int attempt) {
    return call([attempt](C10dRoundWatch& w) { return w.check(attempt); });
  };
  auto rank0_gone = [watcher] {
    std::lock_guard<std::mutex> lock(watcher->mutex);
    return watcher->rank0 && watcher->rank0->gone();
  };
  info.check_membership = coord_->membership_check(round, full_check, rank0_gone);
  info.reform = [call](const MembershipChange& change) {
    return call([&](C10dRoundWatch& w) { return w.reform(change); });
  };
}

void C10dHandler::set_up_ending(const C10dRound& round, RendezvousInfo& info) {
  auto presence = presence_;
  C10dState* state = state_.get();
  info.mark_finishing = [state, presence, round](int attempt) {
    const bool finishing = state->mark_finishing(attempt);
    if (presence) {
      try {
        C10dRoundWatch::finish(*presence, round);
      } catch (const Error&) {
        // The store is gone: nobody is left to mistake this node for lost.
      }
    }
    return finishing;
  };
  const bool hosts_endpoint = coord_->hosts_endpoint();
  const auto linger = std::min(options_.close_timeout, milliseconds(3'000));
  info.tidy = coord_->tidy(round);
  info.close = [state, hosts_endpoint, linger,
                run_id = options_.job.run_id](const std::string& outcome) {
    int waiting = state->close(outcome);
    if (!hosts_endpoint || waiting <= 0) return;
    // The endpoint's store goes with this agent: let the waiting nodes read
    // the end first (they look at least once a poll interval).
    const auto until = Clock::now() + linger;
    while (state->closed_seen() < waiting && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(50));
    }
    get_logger("rdzv")->debug("rendezvous '{}': {} waiting nodes told of the end", run_id, waiting);
  };
}

std::vector<HostedStore> C10dHandler::hosted_stores() {
  std::vector<HostedStore> out;
  if (Coordination* coord = coord_live_.load()) {  // the status sampler's thread
    if (auto stats = coord->endpoint_stats()) out.push_back({"rendezvous", *stats});
  }
  std::lock_guard<std::mutex> lock(servers_mutex_);
  if (workers_server_) out.push_back({"workers", workers_server_->stats()});
  return out;
}

}  // namespace ctorchrun::rendezvous

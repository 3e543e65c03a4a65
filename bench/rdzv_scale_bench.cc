// ctorch-rdzv-bench: how the c10d rendezvous scales with the number of
// agents. N agents, each a thread with its own TCP connection to one store
// (ctorch-store's server, in this process on its own thread) and a second
// one bound to it for its records (its presence, as the agent holds it), run
// the real state machine (rendezvous/c10d_state.h) the way C10dHandler
// drives it:
// join, then poll and wait on the key the state names, until the round
// (--nnodes=N:N) is complete with the agent in it.
//
//   ctorch-rdzv-bench --agents 64,256,1024 [--runs R] [--etcd HOST:PORT[,...]]
//
// With --etcd the agents' store is that etcd cluster instead (EtcdStore,
// keys under /ctorchrun-bench/), as under --rdzv_backend=etcd-v3.
//
// Measured per size: the time from releasing all agents (connected already)
// to the last one holding the round; store requests per agent (max and
// median) and bytes per agent (keys and values sent and received): the most
// any member read or wrote but the one that built the roster, that builder's
// (it reads the N records and writes the full list once), and all agents'
// together. With --etcd each run is followed by etcd's own floor: as many
// threads, each with an EtcdClient of its own as an agent has, released at
// once, each putting as many small keys as the rendezvous took requests on
// the wire per agent (median); the time to the last one done.
// The last stdout line is JSON with one object per size.

#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "etcd/client.h"
#include "etcd/etcd_store.h"
#include "rendezvous/c10d_state.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

using namespace ctorchrun;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Forwards to a store and counts requests and bytes (keys and values sent,
// values received). A tally of a TCP store costs its portable form's
// requests (`portable`); etcd's is one request each.
class CountingStore : public store::Store {
 public:
  CountingStore(store::Store& inner, bool portable) : inner_(inner), portable_(portable) {}
  int64_t requests = 0;
  int64_t bytes = 0;

  void set(const std::string& k, const std::string& v) override {
    count(k.size() + v.size());
    inner_.set(k, v);
  }
  std::string get(const std::string& k) override {
    auto v = inner_.get(k);
    count(k.size() + v.size());
    return v;
  }
  int64_t add(const std::string& k, int64_t d) override {
    count(k.size() + 8);
    return inner_.add(k, d);
  }
  std::string compare_set(const std::string& k, const std::string& e,
                          const std::string& d) override {
    auto v = inner_.compare_set(k, e, d);
    count(k.size() + e.size() + d.size() + v.size());
    return v;
  }
  using Store::wait;
  void wait(const std::vector<std::string>& k, milliseconds t) override {
    count(total(k));
    inner_.wait(k, t);
  }
  bool check(const std::vector<std::string>& k) override {
    count(total(k));
    return inner_.check(k);
  }
  int64_t num_keys() override {
    count(0);
    return inner_.num_keys();
  }
  bool delete_key(const std::string& k) override {
    count(k.size());
    return inner_.delete_key(k);
  }
  void append(const std::string& k, const std::string& v) override {
    count(k.size() + v.size());
    inner_.append(k, v);
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& k) override {
    auto v = inner_.multi_get(k);
    count(total(k) + total(v));
    return v;
  }
  void multi_set(const std::vector<std::string>& k, const std::vector<std::string>& v) override {
    count(total(k) + total(v));
    inner_.multi_set(k, v);
  }
  int64_t tally_add(const std::string& k, const std::string& e) override {
    if (portable_) return store::portable_tally::add(*this, k, e);
    count(k.size() + e.size() + 8);
    return inner_.tally_add(k, e);
  }
  int64_t tally_count(const std::string& k) override {
    if (portable_) return store::portable_tally::count(*this, k);
    count(k.size() + 8);
    return inner_.tally_count(k);
  }
  std::vector<std::string> tally_entries(const std::string& k) override {
    if (portable_) return store::portable_tally::entries(*this, k);
    auto v = inner_.tally_entries(k);
    count(k.size() + total(v));
    return v;
  }

 private:
  void count(size_t b) {
    ++requests;
    bytes += static_cast<int64_t>(b);
  }
  static size_t total(const std::vector<std::string>& v) {
    size_t n = 0;
    for (const auto& s : v) n += s.size();
    return n;
  }
  store::Store& inner_;
  const bool portable_;
};

struct Result {
  double seconds = 0;
  double connect_seconds = 0;
  int64_t max_requests = 0;
  int64_t median_requests = 0;
  int64_t max_bytes = 0;
  int64_t max_member_bytes = 0;  // the most of any agent but the roster's builder
  int64_t builder_bytes = 0;
  int64_t total_bytes = 0;
  double etcd_floor_seconds = 0;  // --etcd: the same writes without the rendezvous
  // etcd: requests on the wire per agent (retries and keep-alives included).
  int64_t max_exchanges = 0;
  int64_t median_exchanges = 0;
  int failures = 0;
  std::string first_error;
};

// etcd alone: `agents` threads, each with a client of its own (connected
// before the release, as the agents are), each putting `writes` keys of 16
// bytes one after the other; seconds from the release to the last put.
double etcd_floor(int agents, int run, int64_t writes,
                  const std::vector<std::string>& etcd_endpoints) {
  std::mutex mu;
  std::condition_variable cv;
  int ready = 0;
  bool go = false;
  std::vector<Clock::time_point> done(static_cast<size_t>(agents));
  std::atomic<int> failures{0};
  Clock::time_point t_go;
  std::vector<std::thread> threads;
  const std::string prefix = "/ctorchrun-bench-floor/" + std::to_string(getpid()) + "_" +
                             std::to_string(agents) + "_" + std::to_string(run) + "/";
  for (int i = 0; i < agents; ++i) {
    threads.emplace_back([&, i] {
      try {
        etcd::EtcdClient client(etcd_endpoints, milliseconds(60'000));
        client.get(prefix + "warm");  // the connection up, as an agent's is
        {
          std::unique_lock<std::mutex> lock(mu);
          ++ready;
          cv.notify_all();
          cv.wait(lock, [&] { return go; });
        }
        for (int64_t w = 0; w < writes; ++w) {
          client.put(prefix + std::to_string(i) + "/" + std::to_string(w), "0123456789abcdef");
        }
      } catch (const std::exception&) {
        ++failures;
      }
      done[static_cast<size_t>(i)] = Clock::now();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return ready == agents; });
    t_go = Clock::now();
    go = true;
    cv.notify_all();
  }
  for (auto& t : threads) t.join();
  try {
    etcd::EtcdClient(etcd_endpoints, milliseconds(60'000)).delete_prefix(prefix);
  } catch (const std::exception&) {
  }
  if (failures > 0) return -1;
  const double seconds =
      std::chrono::duration<double>(*std::max_element(done.begin(), done.end()) - t_go).count();
  std::fprintf(stderr, "%d agents, run %d: etcd alone, %lld puts each: %.3f s\n", agents, run,
               static_cast<long long>(writes), seconds);
  return seconds;
}

Result run_once(int agents, int run, const std::vector<std::string>& etcd_endpoints) {
  store::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  std::unique_ptr<store::TcpStoreServer> server;
  if (etcd_endpoints.empty()) server = store::TcpStoreServer::start(so);
  // The process's own id too: an etcd that outlives a run keeps its keys.
  const std::string id =
      "bench" + std::to_string(getpid()) + "_" + std::to_string(agents) + "_" + std::to_string(run);

  std::mutex mu;
  std::condition_variable cv;
  int connected = 0;
  bool go = false;
  std::vector<int64_t> requests(static_cast<size_t>(agents)), bytes(static_cast<size_t>(agents)),
      exchanges(static_cast<size_t>(agents));
  std::vector<Clock::time_point> done(static_cast<size_t>(agents));
  std::vector<char> builder(static_cast<size_t>(agents), 0);
  std::atomic<int> failures{0};
  std::string first_error;
  const auto t_connect = Clock::now();
  Clock::time_point t_go;

  std::vector<std::thread> threads;
  for (int i = 0; i < agents; ++i) {
    threads.emplace_back([&, i] {
      const auto idx = static_cast<size_t>(i);
      try {
        std::shared_ptr<store::Store> conn;
        std::shared_ptr<store::Store> presence;  // as the agent holds it
        std::shared_ptr<etcd::EtcdClient> etcd_client;
        if (server) {
          store::TcpStoreOptions o;
          o.host = "127.0.0.1";
          o.port = server->port();
          o.timeout = milliseconds(60'000);
          o.connect_timeout = milliseconds(60'000);
          conn = std::make_shared<store::TcpStore>(o);
          auto bound = std::make_shared<store::TcpStore>(o);
          bound->bind_keys_to_connection();
          presence = std::make_shared<store::PrefixStore>("ctorchrun/" + id, bound);
        } else {
          auto client = std::make_shared<etcd::EtcdClient>(etcd_endpoints, milliseconds(60'000));
          etcd_client = client;
          conn = std::make_shared<etcd::EtcdStore>(client, "/ctorchrun-bench/");
          auto leased = std::make_shared<etcd::EtcdStore>(client, "/ctorchrun-bench/");
          leased->bind_keys_to_lease(milliseconds(15'000));
          presence = std::make_shared<store::PrefixStore>("ctorchrun/" + id, leased);
        }
        store::PrefixStore job("ctorchrun/" + id, conn);
        CountingStore counted(job, server != nullptr);
        rendezvous::NodeInfo me;
        me.local_world_size = 8;
        me.host = "node" + std::to_string(i);
        me.pid = 1000 + i;
        rendezvous::C10dTiming timing;
        timing.last_call_timeout = milliseconds(30'000);
        rendezvous::C10dState state(counted, {agents, agents, 3, "train.py"}, me, timing,
                                    rendezvous::C10dState::Clock::now,
                                    rendezvous::C10dState::WallClock::now, presence.get());
        {
          std::unique_lock<std::mutex> lock(mu);
          ++connected;
          cv.notify_all();
          cv.wait(lock, [&] { return go; });
        }
        state.join();
        const auto deadline = Clock::now() + std::chrono::seconds(120);
        for (;;) {
          if (auto round = state.poll()) {
            builder[idx] = round->builder == state.slot();
            break;
          }
          if (Clock::now() > deadline) throw TimeoutError("no round after 120 s");
          try {
            counted.wait({state.wait_key()}, milliseconds(1'000));
          } catch (const TimeoutError&) {
          }
        }
        done[idx] = Clock::now();
        requests[idx] = counted.requests;
        bytes[idx] = counted.bytes;
        if (etcd_client) exchanges[idx] = static_cast<int64_t>(etcd_client->exchanges());
      } catch (const std::exception& e) {
        ++failures;
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) first_error = e.what();
        done[idx] = Clock::now();
      }
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return connected == agents; });
    t_go = Clock::now();
    go = true;
    cv.notify_all();
  }
  for (auto& t : threads) t.join();
  Result r;
  r.connect_seconds = std::chrono::duration<double>(t_go - t_connect).count();
  r.seconds =
      std::chrono::duration<double>(*std::max_element(done.begin(), done.end()) - t_go).count();
  r.failures = failures;
  r.first_error = first_error;
  std::vector<int64_t> sorted = requests;
  std::sort(sorted.begin(), sorted.end());
  r.max_requests = sorted.back();
  r.median_requests = sorted[sorted.size() / 2];
  r.max_bytes = *std::max_element(bytes.begin(), bytes.end());
  for (size_t i = 0; i < bytes.size(); ++i) {
    r.total_bytes += bytes[i];
    if (builder[i]) {
      r.builder_bytes = std::max(r.builder_bytes, bytes[i]);
    } else {
      r.max_member_bytes = std::max(r.max_member_bytes, bytes[i]);
    }
  }
  std::sort(exchanges.begin(), exchanges.end());
  r.max_exchanges = exchanges.back();
  r.median_exchanges = exchanges[exchanges.size() / 2];
  std::fprintf(stderr, "%d agents, run %d: round %.3f s, %d failures\n", agents, run, r.seconds,
               r.failures);
  if (!etcd_endpoints.empty() && r.failures == 0) {
    r.etcd_floor_seconds = etcd_floor(agents, run, r.median_exchanges, etcd_endpoints);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ctorch-rdzv-bench: c10d rendezvous time and cost against the number of agents"};
  std::string sizes = "64,256,1024";
  int runs = 3;
  std::string etcd_list;
  app.add_option("--agents", sizes, "comma-separated agent counts");
  app.add_option("--etcd", etcd_list, "etcd members HOST:PORT[,...]: the agents' store is etcd");
  app.add_option("--runs", runs, "runs per size (the median is reported)")
      ->check(CLI::Range(1, 50));
  CLI11_PARSE(app, argc, argv);

  // Each agent holds one socket here and the server one: raise the soft limit.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  nlohmann::json out = nlohmann::json::array();
  std::stringstream ss(sizes);
  for (std::string item; std::getline(ss, item, ',');) {
    int n = 0;
    try {
      n = std::stoi(item);
    } catch (const std::exception&) {
      std::fprintf(stderr, "--agents: '%s' is not a number\n", item.c_str());
      return 2;
    }
    if (n < 1 || n > 4096) {
      std::fprintf(stderr, "--agents: %d is outside 1..4096\n", n);
      return 2;
    }
    std::vector<Result> results;
    std::vector<std::string> etcd_endpoints;
    std::stringstream es(etcd_list);
    for (std::string e; std::getline(es, e, ',');) {
      if (!e.empty()) etcd_endpoints.push_back(e);
    }
    for (int r = 0; r < runs; ++r) results.push_back(run_once(n, r, etcd_endpoints));
    std::vector<double> secs, floor_secs;
    int failures = 0;
    for (const auto& r : results) {
      secs.push_back(r.seconds);
      floor_secs.push_back(r.etcd_floor_seconds);
      failures += r.failures;
      if (r.failures) std::fprintf(stderr, "%d agents: %s\n", n, r.first_error.c_str());
    }
    std::sort(secs.begin(), secs.end());
    std::sort(floor_secs.begin(), floor_secs.end());
    const Result& last = results.back();
    std::printf("agents=%d round_s median=%.3f (runs:", n, secs[secs.size() / 2]);
    for (const auto& r : results) std::printf(" %.3f", r.seconds);
    std::printf(
        ") requests/agent max=%lld median=%lld bytes/agent max=%lld member_max=%lld "
        "builder=%lld total=%lld connect_s=%.3f failures=%d",
        static_cast<long long>(last.max_requests), static_cast<long long>(last.median_requests),
        static_cast<long long>(last.max_bytes), static_cast<long long>(last.max_member_bytes),
        static_cast<long long>(last.builder_bytes), static_cast<long long>(last.total_bytes),
        last.connect_seconds, failures);
    if (!etcd_endpoints.empty()) {
      std::printf(" etcd_requests/agent max=%lld median=%lld etcd_floor_s median=%.3f (runs:",
                  static_cast<long long>(last.max_exchanges),
                  static_cast<long long>(last.median_exchanges), floor_secs[floor_secs.size() / 2]);
      for (const auto& r : results) std::printf(" %.3f", r.etcd_floor_seconds);
      std::printf(")");
    }
    std::printf("\n");
    std::fflush(stdout);
    out.push_back({{"agents", n},
                   {"round_s_median", secs[secs.size() / 2]},
                   {"max_requests_per_agent", last.max_requests},
                   {"median_requests_per_agent", last.median_requests},
                   {"max_bytes_per_agent", last.max_bytes},
                   {"max_member_bytes", last.max_member_bytes},
                   {"builder_bytes", last.builder_bytes},
                   {"total_bytes", last.total_bytes},
                   {"etcd_floor_s_median", floor_secs[floor_secs.size() / 2]},
                   {"max_etcd_requests_per_agent", last.max_exchanges},
                   {"failures", failures}});
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

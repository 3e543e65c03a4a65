#include "rendezvous/c10d_state.h"

#include <nlohmann/json.hpp>

#include "common/error.h"

namespace ctorchrun::rendezvous {

namespace {

std::string nnodes_text(const C10dSettings& s) {
  return std::to_string(s.min_nodes) + ":" + std::to_string(s.max_nodes);
}

nlohmann::json settings_json(const C10dSettings& s) {
  return {
      {"nnodes", nnodes_text(s)}, {"max_restarts", s.max_restarts}, {"entrypoint", s.entrypoint}};
}

std::string text_of(const nlohmann::json& j) {
  return j.is_string() ? j.get<std::string>() : j.dump();
}

}  // namespace

C10dState::C10dState(store::Store& job, C10dSettings settings, NodeInfo me,
                     std::chrono::milliseconds last_call_timeout,
                     std::function<Clock::time_point()> now)
    : job_(job),
      settings_(std::move(settings)),
      me_(std::move(me)),
      last_call_timeout_(last_call_timeout),
      now_(std::move(now)) {}

std::string C10dState::key(const std::string& what) const {
  return "rdzv/" + std::to_string(round_) + "/" + what;
}

std::string C10dState::wait_key() const { return key("complete"); }

void C10dState::join() {
  const std::string mine = settings_json(settings_).dump();
  const std::string got = job_.compare_set("rdzv/settings", "", mine);
  if (got != mine) {
    auto theirs = nlohmann::json::parse(got, nullptr, false);
    if (!theirs.is_object()) {
      throw ProtocolError("unreadable rendezvous settings at key 'rdzv/settings': " +
                          got.substr(0, 200));
    }
    const auto ours = settings_json(settings_);
    for (const char* name : {"nnodes", "max_restarts", "entrypoint"}) {
      const std::string a = theirs.contains(name) ? text_of(theirs[name]) : std::string("<none>");
      const std::string b = text_of(ours[name]);
      if (a != b) {
        throw ConfigError(std::string("nodes disagree on --") + name +
                          ": the job's first node has " + a + ", this node (" + me_.host +
                          ") has " + b + "; give every node the same value");
      }
    }
  }
  round_ = static_cast<int>(job_.add("rdzv/round", 0));
  index_ = static_cast<int>(job_.add(key("joined"), 1));
  if (index_ > settings_.max_nodes) {
    throw RendezvousClosedError("round " + std::to_string(round_) + " already has its maximum of " +
                                std::to_string(settings_.max_nodes) +
                                " nodes; this node arrived as number " + std::to_string(index_));
  }
  nlohmann::json rec = {{"local_world_size", me_.local_world_size},
                        {"host", me_.host},
                        {"pid", me_.pid},
                        {"hosts_endpoint", me_.hosts_endpoint}};
  job_.set(key("node/" + std::to_string(index_ - 1)), rec.dump());
  if (index_ == settings_.max_nodes) {
    job_.compare_set(key("complete"), "", std::to_string(index_));
  }
}

std::optional<C10dRound> C10dState::poll() {
  CTORCHRUN_CHECK(round_ >= 0, "C10dState::poll() before join()");
  std::string complete;
  if (job_.check({key("complete")})) {
    complete = job_.get(key("complete"));
  } else {
    const int joined = static_cast<int>(job_.add(key("joined"), 0));
    if (joined < settings_.min_nodes) return std::nullopt;
    if (!last_call_since_) last_call_since_ = now_();
    if (now_() - *last_call_since_ < last_call_timeout_) return std::nullopt;
    // Last call is over on this node's clock: close the round at the count
    // now joined. Another node may have closed it first; its count wins.
    const int count = std::min(joined, settings_.max_nodes);
    complete = job_.compare_set(key("complete"), "", std::to_string(count));
  }
  int members = 0;
  try {
    members = std::stoi(complete);
  } catch (const std::exception&) {
    throw ProtocolError("unreadable member count at key '" + key("complete") +
                        "': " + complete.substr(0, 100));
  }
  if (members < 1 || members > settings_.max_nodes) {
    throw ProtocolError("member count " + std::to_string(members) + " at key '" + key("complete") +
                        "' is outside 1.." + std::to_string(settings_.max_nodes));
  }
  if (index_ > members) {
    throw RendezvousClosedError("round " + std::to_string(round_) + " completed with " +
                                std::to_string(members) +
                                " nodes before this node could join it (it arrived as number " +
                                std::to_string(index_) + ")");
  }
  return read_round(members);
}

C10dRound C10dState::read_round(int members) {
  std::vector<std::string> keys;
  for (int i = 0; i < members; ++i) keys.push_back(key("node/" + std::to_string(i)));
  // Each member sets its record right after its ADD; the store's timeout bounds
  // the wait for one that has yet to.
  auto values = job_.multi_get(keys);
  C10dRound r;
  r.round = round_;
  r.group_rank = index_ - 1;
  for (int i = 0; i < members; ++i) {
    const std::string& k = keys[static_cast<size_t>(i)];
    auto j = nlohmann::json::parse(values[static_cast<size_t>(i)], nullptr, false);
    if (!j.is_object() || !j.contains("local_world_size") ||
        !j["local_world_size"].is_number_integer() || !j.contains("pid") ||
        !j["pid"].is_number_integer() || !j.contains("host") || !j["host"].is_string()) {
      throw ProtocolError("unreadable node record at key '" + k + "'");
    }
    NodeInfo n;
    n.group_rank = i;
    n.local_world_size = j["local_world_size"].get<int>();
    n.pid = j["pid"].get<int>();
    n.host = j["host"].get<std::string>();
    n.max_restarts = settings_.max_restarts;
    auto he = j.find("hosts_endpoint");
    n.hosts_endpoint = he != j.end() && he->is_boolean() && he->get<bool>();
    if (n.local_world_size < 1) {
      throw ProtocolError("node record at key '" + k + "': local_world_size " +
                          std::to_string(n.local_world_size) + " is not positive");
    }
    r.nodes.push_back(std::move(n));
  }
  return r;
}

std::string C10dState::progress() {
  int joined = round_ >= 0 ? static_cast<int>(job_.add(key("joined"), 0)) : 0;
  return std::to_string(joined) + " of min " + std::to_string(settings_.min_nodes) + ", max " +
         std::to_string(settings_.max_nodes) + " nodes joined round " +
         std::to_string(std::max(round_, 0));
}

}  // namespace ctorchrun::rendezvous

#include "rendezvous/c10d_state.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/deadline.h"
#include "common/error.h"
#include "common/json_text.h"
#include "rendezvous/node_record.h"
#include "rendezvous/roster.h"
#include "store/protocol.h"

namespace ctorchrun::rendezvous {

namespace {

// Bounds every walk over generations, rounds or list items.
constexpr int kMaxSteps = 100'000;

std::string nnodes_text(const C10dSettings& s) {
  return std::to_string(s.min_nodes) + ":" + std::to_string(s.max_nodes);
}

nlohmann::json settings_json(const C10dSettings& s) {
  return {
      {"nnodes", nnodes_text(s)}, {"max_restarts", s.max_restarts}, {"entrypoint", s.entrypoint}};
}

std::string text_of(const nlohmann::json& j) {
  return j.is_string() ? j.get<std::string>() : json_text::dump_for_people(j);
}

nlohmann::json parse_object(const std::string& raw, const std::string& key) {
  auto j = json_text::parse_record(raw);
  if (!j.is_object()) {
    throw ProtocolError("unreadable record at key '" + key +
                        "': " + json_text::utf8_prefix(raw, 200));
  }
  return j;
}

int int_field(const nlohmann::json& j, const char* name, const std::string& key) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_integer()) {
    throw ProtocolError("unreadable record at key '" + key + "': no integer '" + name + "'");
  }
  auto v = it->get<int64_t>();
  if (v < 0 || v > 1'000'000'000) {
    throw ProtocolError("unreadable record at key '" + key + "': '" + name + "' out of range");
  }
  return static_cast<int>(v);
}

int64_t int_text(const std::string& raw, const std::string& key) {
  if (raw.empty() || raw.size() > 9 ||
      !std::all_of(raw.begin(), raw.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    throw ProtocolError("unreadable number at key '" + key +
                        "': " + json_text::utf8_prefix(raw, 100));
  }
  return std::stoll(raw);
}

// Raises the max-register at `key` to `count`, starting from a
// compare_set that expects `expected` (nullopt: the key missing):
// C10dState::raise_count.
int raise_from(store::Store& store, const std::string& key, int count,
               std::optional<std::string> expected) {
  CTORCHRUN_CHECK(count > 0, "a restart count below 1 for " + key);
  const std::string target = std::to_string(count);
  // Each turn after the first finds a higher value than the last (the
  // register only grows), so the loop ends within count + 2 turns; the
  // bound guards a store that breaks that.
  for (int step = 0;; ++step) {
    CTORCHRUN_CHECK(step < kMaxSteps, "the restart count at " + key + " never settled");
    // torch's rules: an empty `expected` creates a missing key; a replay of
    // a swap that applied finds `target` there and returns it.
    const std::string got = store.compare_set(key, expected.value_or(""), target);
    if (got == target) return count;
    if (expected && got == *expected) {
      expected.reset();  // `expected` back: the key is missing
      continue;
    }
    const int64_t have = int_text(got, key);
    if (have >= count) return static_cast<int>(have);
    expected = got;
  }
}

// A slot: 'n' or 'm' and a number.
bool valid_slot(const std::string& s) {
  return s.size() >= 2 && s.size() <= 10 && (s[0] == 'n' || s[0] == 'm') &&
         std::all_of(s.begin() + 1, s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The value of a round's reform key (C10dRoundWatch::parse reads it).
std::string reform_record(const MembershipChange& change) {
  return json_text::dump_record(
      {{"reason", change.reason}, {"lost", change.lost}, {"cause", change.cause}});
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int g : ranks) s += (s.empty() ? "" : ", ") + std::to_string(g);
  return s;
}

// The change for members that left on purpose and members lost (their agents
// exited): "nodes 1, 2 left; lost node 3 (agent exited)".
MembershipChange gone_change(const std::vector<int>& left, const std::vector<int>& lost) {
  MembershipChange change;
  change.lost = left;
  change.lost.insert(change.lost.end(), lost.begin(), lost.end());
  std::sort(change.lost.begin(), change.lost.end());
  change.cause = lost.empty() ? "agent left" : "agent exited";
  if (!left.empty()) {
    change.reason = std::string(left.size() == 1 ? "node " : "nodes ") + rank_list(left) + " left";
  }
  if (!lost.empty()) {
    change.reason += (change.reason.empty() ? "" : "; ") + std::string("lost node") +
                     (lost.size() == 1 ? " " : "s ") + rank_list(lost) + " (agent exited)";
  }
  return change;
}

}  // namespace

std::string C10dState::round_key(int generation, int round, const std::string& what) {
  return "g" + std::to_string(generation) + "/rdzv/" + std::to_string(round) + "/" + what;
}

std::string C10dState::closed_key(int generation) {
  return "g" + std::to_string(generation) + "/rdzv/closed";
}

std::string C10dState::count_key(int generation) {
  return "g" + std::to_string(generation) + "/rdzv/attempt";
}

std::string C10dState::restarts_key(int generation, int round) {
  return "g" + std::to_string(generation) + "/r" + std::to_string(round) + "/" + kRestartsKey;
}

int C10dState::read_count(store::Store& store, const std::string& key) {
  const auto v = store::read_if_present(store, key);
  return v ? static_cast<int>(int_text(*v, key)) : 0;
}

int C10dState::raise_count(store::Store& store, const std::string& key, int count, int believed) {
  return raise_from(
      store, key, count,
      believed > 0 ? std::optional<std::string>(std::to_string(believed)) : std::nullopt);
}

C10dState::C10dState(store::Store& job, C10dSettings settings, NodeInfo me, C10dTiming timing,
                     std::function<Clock::time_point()> now,
                     std::function<WallClock::time_point()> wall_now, store::Store* presence)
    : job_(job),
      presence_(presence),
      settings_(std::move(settings)),
      me_(std::move(me)),
      timing_(timing),
      now_(std::move(now)),
      wall_now_(std::move(wall_now)) {}

void C10dState::check_settings() {
  const std::string key = "g" + std::to_string(generation_) + "/rdzv/settings";
  const std::string mine = json_text::dump_record(settings_json(settings_));
  const std::string got = job_.compare_set(key, "", mine);
  if (got == mine) return;
  auto theirs = parse_object(got, key);
  const auto ours = settings_json(settings_);
  for (const char* name : {"nnodes", "max_restarts", "entrypoint"}) {
    const std::string a = theirs.contains(name) ? text_of(theirs[name]) : std::string("<none>");
    const std::string b = text_of(ours[name]);
    if (a != b) {
      throw ConfigError(std::string("nodes disagree on --") + name + ": the job's first node has " +
                        a + ", this node (" + me_.host + ") has " + b +
                        "; give every node the same value");
    }
  }
}

void C10dState::join() {
  CTORCHRUN_CHECK(round_ < 0, "C10dState::join() called twice");
  // The generation: walk past jobs of this id that ended before the window.
  int g = static_cast<int>(job_.add("generation", 0));
  for (int step = 0;; ++step) {
    CTORCHRUN_CHECK(step < kMaxSteps, "no usable generation of the rendezvous id");
    const std::string key = closed_key(g);
    // The marker lives on a lease: it may expire between two calls.
    const auto raw = store::read_if_present(job_, key);
    if (!raw) break;
    auto j = parse_object(*raw, key);
    auto at = j.find("closed_at_ms");
    auto outcome = j.find("outcome");
    if (at == j.end() || !at->is_number_integer() || outcome == j.end() || !outcome->is_string()) {
      throw ProtocolError("unreadable record at key '" + key + "'");
    }
    const int64_t at_ms = at->get<int64_t>();
    if (at_ms < 0 || at_ms > int64_t{1} << 50) {
      throw ProtocolError("unreadable record at key '" + key + "': closed_at_ms out of range");
    }
    const auto closed_at = WallClock::time_point(std::chrono::milliseconds(at_ms));
    const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(wall_now_() - closed_at);
    if (age < timing_.closed_window) {
      throw JobClosedError(
          "the job of this --rdzv_id ended (" + outcome->get<std::string>() + ") " +
              format_duration(std::max(age, std::chrono::milliseconds(0))) +
              " ago; a node arriving within join_timeout (" +
              format_duration(timing_.closed_window) +
              ") of the end is refused, so that a restarted node does not start the job again. "
              "Use another --rdzv_id, or wait " +
              format_duration(timing_.closed_window - age),
          outcome->get<std::string>(), false, false);
    }
    // The window has passed: the id is free for a new job.
    job_.compare_set("generation", std::to_string(g), std::to_string(g + 1));
    ++g;
  }
  generation_ = g;
  check_settings();
  settings_checked_ = true;
  const std::string hint_key = "g" + std::to_string(g) + "/rdzv/round";
  const auto hint = store::read_if_present(job_, hint_key);
  int r = hint ? static_cast<int>(int_text(*hint, hint_key)) : 0;
  for (int step = 0; job_.check({round_key(g, r, "complete")}); ++step) {
    CTORCHRUN_CHECK(step < kMaxSteps, "no forming round of the rendezvous");
    ++r;
  }
  enter_as_newcomer(r, 0, r == 0);
}

void C10dState::rejoin(const C10dRound& previous, int attempt, const std::vector<int>& lost) {
  CTORCHRUN_CHECK(
      settings_checked_ && previous.round == round_ && previous.generation == generation_,
      "C10dState::rejoin() of a round this node did not form");
  const int size = previous.roster.size();
  const int expected = expected_members(size, lost);
  const bool me_lost = std::find(lost.begin(), lost.end(), previous.group_rank) != lost.end();
  // A failure charged in `previous` (as its workers restarted there, or as
  // it gave way): the job's count in the store first, so that it outlives
  // this node whatever round forms next.
  if (attempt > previous.attempt) {
    raise_count(job_, count_key(generation_), attempt, previous.attempt);
  }
  attempt_ = attempt;
  if (me_lost) {
    // Declared lost, yet here: not one of those the round waits for; it
    // comes as a newcomer, after them.
    enter_as_newcomer(previous.round + 1, attempt, true);
    expected_back_ = expected;
    expected_list_ = expected_ranks(size, lost);
    running_ = previous.roster;
    return;
  }
  round_ = previous.round + 1;
  slot_ = "m" + std::to_string(previous.group_rank);
  expected_back_ = expected;
  expected_list_ = expected_ranks(size, lost);
  last_call_wait_ = timing_.last_call_timeout;
  open_ = true;
  running_ = previous.roster;
  min_seen_ = false;
  last_call_since_.reset();
  claim_seen_at_.reset();
  enter(slot_, attempt);
}

int C10dState::expected_members(int size, const std::vector<int>& lost) {
  return static_cast<int>(expected_ranks(size, lost).size());
}

std::vector<int> C10dState::expected_ranks(int size, const std::vector<int>& lost) {
  std::vector<int> out;
  for (int g = 0; g < size; ++g) {
    if (std::find(lost.begin(), lost.end(), g) == lost.end()) out.push_back(g);
  }
  return out;
}

void C10dState::enter_as_newcomer(int round, int attempt, bool open) {
  round_ = round;
  attempt_ = attempt;
  expected_back_ = 0;
  expected_list_.clear();
  last_call_wait_ = timing_.last_call_timeout;
  min_seen_ = false;
  last_call_since_.reset();
  claim_seen_at_.reset();
  open_ = open;
  running_ = Roster();
  next_watched_ = 0;
  const int i = static_cast<int>(job_.tally_add(key("joined"), ""));
  slot_ = "n" + std::to_string(i);
  enter(slot_, attempt);
}

std::string C10dState::record_json(int attempt) const {
  nlohmann::json j = node_record(me_);
  j["attempt"] = attempt;
  return json_text::dump_record(j);
}

void C10dState::enter(const std::string& slot, int attempt) {
  // On the presence connection, the record vanishes with this agent (and its
  // gone marker tells the node that builds the roster).
  (presence_ != nullptr ? *presence_ : job_).set(key("node/" + slot), record_json(attempt));
  // A SET has no reply, and the presence connection is not the one the
  // tallies below go over: one round trip on it makes the record visible
  // before this node counts as entered, so that a roster builder, which
  // reads only records present, never takes a node that is on its way for
  // one that died.
  if (presence_ != nullptr) presence_->check({key("node/" + slot)});
  int rejoined = 0;
  if (slot[0] == 'm') rejoined = static_cast<int>(job_.tally_add(key("rejoined"), ""));
  const int count = static_cast<int>(job_.tally_add(key("entered"), slot));
  if (count == settings_.min_nodes) job_.set(key("min"), "1");
  if (!open_) return;
  const bool all_back = rejoined >= expected_back_;
  if ((count >= settings_.max_nodes && all_back) ||
      (slot[0] == 'm' && rejoined == expected_back_ && count >= settings_.min_nodes)) {
    try_complete();
  }
}

void C10dState::try_complete() {
  const std::string claim = job_.compare_set(key("claim"), "", slot_);
  if (claim != slot_) {
    if (!claim_seen_at_ || claim != claim_seen_) {
      // A claim not seen before (a first one, or another node's takeover):
      // its builder gets the whole claim_timeout.
      claim_seen_at_ = now_();
      claim_seen_ = claim;
    }
    if (now_() - *claim_seen_at_ < timing_.claim_timeout) return;
    // The claimant went silent: take its claim over, one node at a time
    // (compare_set from the claim seen), so that a roster slow to build (a
    // large round on a loaded store) is not then built by every waiting
    // node at once; a node that loses the takeover waits on the new claim.
    const std::string taken = job_.compare_set(key("claim"), claim, slot_);
    if (taken != slot_) {
      claim_seen_at_ = now_();
      claim_seen_ = taken;
      return;
    }
  }
  const std::string entered_key = key("entered");
  const std::vector<std::string> entered = job_.tally_entries(entered_key);
  CTORCHRUN_CHECK(entered.size() <= static_cast<size_t>(kMaxSteps),
                  "runaway list at " + entered_key);
  std::vector<std::pair<int, std::string>> back, fresh;  // (number, slot)
  for (const std::string& s : entered) {
    if (!valid_slot(s)) {
      throw ProtocolError("unreadable record at key '" + entered_key + "': " + s.substr(0, 200));
    }
    auto& list = s[0] == 'm' ? back : fresh;
    const int n = std::stoi(s.substr(1));
    if (std::none_of(list.begin(), list.end(), [&](const auto& p) { return p.first == n; })) {
      list.emplace_back(n, s);
    }
  }
  std::sort(back.begin(), back.end());
  std::sort(fresh.begin(), fresh.end());
  std::vector<std::string> candidates;
  for (const auto* list : {&back, &fresh}) {
    for (const auto& p : *list) candidates.push_back(p.second);
  }
  // Only entrants present now: one that died (its record vanished with its
  // connection or lease) or left on purpose (withdrew its record) since it
  // entered is not in the roster, and nothing here waits for a record.
  std::vector<std::string> keys;
  for (const auto& s : candidates) keys.push_back(key("node/" + s));
  const std::vector<std::optional<std::string>> records = present_records(keys);
  std::vector<std::string> slots;
  std::vector<int> sizes;
  nlohmann::json members = nlohmann::json::array();
  int attempt = 0;
  NodeInfo node0;
  int endpoint_node = -1;
  int64_t world = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (static_cast<int>(slots.size()) >= settings_.max_nodes) break;
    if (!records[i]) continue;
    auto rec = parse_object(*records[i], keys[i]);
    // Checked here, once: the members read only the compact roster.
    const NodeInfo n = parse_node_record(rec, keys[i]);
    attempt = std::max(attempt, int_field(rec, "attempt", keys[i]));
    if (slots.empty()) node0 = n;
    if (n.hosts_endpoint && endpoint_node < 0) endpoint_node = static_cast<int>(slots.size());
    world += n.local_world_size;
    if (world > (int64_t{1} << 30)) {
      throw ProtocolError("the records under '" + key("node/") + "' add up to a world size of " +
                          std::to_string(world) + ", out of range");
    }
    rec["slot"] = candidates[i];
    members.push_back(std::move(rec));
    slots.push_back(candidates[i]);
    sizes.push_back(n.local_world_size);
  }
  if (static_cast<int>(slots.size()) < settings_.min_nodes) {
    // Entrants that died or left counted towards MIN: wait for more. The
    // claim goes, so that the next poll (of any node) tries again.
    job_.delete_key(key("claim"));
    return;
  }
  // The job's count: what the members carry, the register, and the restarts
  // charged within the round before (whose members may all be gone). The
  // register holds it before the roster does, so that no later round starts
  // lower whoever forms it.
  const std::string count = count_key(generation_);
  const std::optional<std::string> held = store::read_if_present(job_, count);
  const int stored = held ? static_cast<int>(int_text(*held, count)) : 0;
  attempt = std::max(attempt, stored);
  if (round_ > 0)
    attempt = std::max(attempt, read_count(job_, restarts_key(generation_, round_ - 1)));
  if (attempt > stored) raise_from(job_, count, attempt, held);
  // The full list first, under this builder's slot (a builder that takes an
  // abandoned claim over writes its own: the roster that wins names whose
  // list is its), then the compact roster every member reads.
  job_.set(key("members/" + slot_), json_text::dump_record(members));
  nlohmann::json roster{{"attempt", attempt},
                        {"by", slot_},
                        {"node0", {{"host", node0.host}, {"pid", node0.pid}}},
                        {"endpoint_node", endpoint_node}};
  Roster::build(slots, sizes).to_json(roster);
  job_.compare_set(key("complete"), "", json_text::dump_record(roster));
  job_.set("g" + std::to_string(generation_) + "/rdzv/round", std::to_string(round_));
}

std::vector<std::optional<std::string>> C10dState::present_records(
    const std::vector<std::string>& keys) {
  std::vector<std::optional<std::string>> out(keys.size());
  if (keys.empty()) return out;
  // Usually every entrant is there: one check and one read for all. A record
  // may vanish between the two (the TCP store then answers an empty value,
  // etcd waits for it): such a one, and every key when some are missing, is
  // read alone without waiting.
  std::vector<bool> settled(keys.size(), false);
  if (job_.check(keys)) {
    try {
      std::vector<std::string> values = job_.multi_get(keys);
      for (size_t i = 0; i < keys.size() && i < values.size(); ++i) {
        if (values[i].empty()) continue;
        out[i] = std::move(values[i]);
        settled[i] = true;
      }
    } catch (const TimeoutError&) {
      // A record vanished after the check: each is read alone below.
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!settled[i]) out[i] = store::read_if_present(job_, keys[i]);
  }
  return out;
}

C10dRound C10dState::read_roster(const std::string& raw) {
  const std::string k = key("complete");
  auto j = parse_object(raw, k);
  C10dRound r;
  r.generation = generation_;
  r.round = round_;
  r.max_restarts = settings_.max_restarts;  // check_settings() refused any other
  r.roster = Roster::from_json(j, k, settings_.max_nodes);
  r.group_rank = r.roster.group_rank_of(slot_).value_or(-1);
  r.attempt = int_field(j, "attempt", k);
  auto by = j.find("by");
  if (by == j.end() || !by->is_string() || !valid_slot(by->get<std::string>())) {
    throw ProtocolError("unreadable roster at key '" + k + "': no builder's slot 'by'");
  }
  r.builder = by->get<std::string>();
  auto node0 = j.find("node0");
  if (node0 == j.end() || !node0->is_object()) {
    throw ProtocolError("unreadable roster at key '" + k + "': no 'node0'");
  }
  auto host = node0->find("host");
  if (host == node0->end() || !host->is_string() || host->get<std::string>().size() > 255) {
    throw ProtocolError("unreadable roster at key '" + k + "': node 0's host is no name");
  }
  r.node0.host = host->get<std::string>();
  r.node0.pid = int_field(*node0, "pid", k);
  r.node0.local_world_size = r.roster.local_world_size(0);
  auto endpoint = j.find("endpoint_node");
  if (endpoint == j.end() || !endpoint->is_number_integer() || endpoint->get<int64_t>() < -1 ||
      endpoint->get<int64_t>() >= r.roster.size()) {
    throw ProtocolError("unreadable roster at key '" + k + "': 'endpoint_node' out of range");
  }
  r.endpoint_node = endpoint->get<int>();
  r.node0.hosts_endpoint = r.endpoint_node == 0;
  return r;
}

std::vector<NodeInfo> C10dState::read_members(store::Store& job, const C10dRound& round) {
  const std::string k = round_key(round.generation, round.round, "members/" + round.builder);
  // Never a waiting read: a list removed since (a tidied store) is an error
  // at once, not a wait for the store's timeout.
  const std::optional<std::string> raw = store::read_if_present(job, k);
  if (!raw) throw ProtocolError("no member list at key '" + k + "' (removed since?)");
  auto j = json_text::parse_record(*raw);
  if (!j.is_array() || j.size() != static_cast<size_t>(round.roster.size())) {
    throw ProtocolError("unreadable member list at key '" + k + "': not the roster's " +
                        std::to_string(round.roster.size()) + " members");
  }
  std::vector<NodeInfo> out;
  out.reserve(j.size());
  int g = 0;
  for (const auto& m : j) {
    NodeInfo n = parse_node_record(m, k);
    auto slot = m.find("slot");
    if (slot == m.end() || !slot->is_string() || slot->get<std::string>() != round.roster.slot(g) ||
        n.local_world_size != round.roster.local_world_size(g)) {
      throw ProtocolError("member list at key '" + k +
                          "' does not match the roster at group rank " + std::to_string(g));
    }
    n.group_rank = g++;
    out.push_back(std::move(n));
  }
  return out;
}

void C10dState::check_closed(bool while_waiting) {
  const std::string key = closed_key(generation_);
  // Reads that never wait, here and in poll(): the store host's tidy may
  // take any of the job's keys away between two calls.
  const auto raw = store::read_if_present(job_, key);
  if (!raw) return;
  auto j = parse_object(*raw, key);
  auto outcome = j.find("outcome");
  const std::string o = outcome != j.end() && outcome->is_string() ? outcome->get<std::string>()
                                                                   : std::string("ended");
  if (while_waiting) job_.tally_add("g" + std::to_string(generation_) + "/rdzv/closed_seen", "");
  throw JobClosedError("the job ended (" + o + ") while this node waited for a round", o,
                       while_waiting, was_member_);
}

std::optional<C10dRound> C10dState::poll() {
  CTORCHRUN_CHECK(round_ >= 0, "C10dState::poll() before join()");
  if (const auto complete = store::read_if_present(job_, key("complete"))) {
    C10dRound r = read_roster(*complete);
    if (r.group_rank >= 0) {
      was_member_ = true;
      return r;
    }
    // Left out (the round was full, or completed before this node came
    // back): wait in the next one, carrying the restart count it has.
    enter_as_newcomer(round_ + 1, attempt_, false);
    running_ = r.roster;
    return std::nullopt;
  }
  check_closed(true);
  if (!open_) {
    const std::string reform_key = round_key(generation_, round_ - 1, "reform");
    const auto reform_raw = store::read_if_present(job_, reform_key);
    if (!reform_raw) {
      if (running_.size() == 0) {
        const std::string prev = round_key(generation_, round_ - 1, "complete");
        if (const auto raw = store::read_if_present(job_, prev)) {
          running_ = Roster::from_json(parse_object(*raw, prev), prev, settings_.max_nodes);
        }
      }
      watch_running_round();
      return std::nullopt;
    }
    // Round round_-1 made way: this round is open. The members of round_-1
    // not lost are expected back.
    auto reform = parse_object(*reform_raw, reform_key);
    auto lost_json = reform.find("lost");
    std::vector<int> lost;
    if (lost_json != reform.end() && lost_json->is_array()) {
      for (const auto& v : *lost_json) {
        if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < kMaxSteps) {
          lost.push_back(v.get<int>());
        }
      }
    }
    const std::string prev = round_key(generation_, round_ - 1, "complete");
    const auto prev_raw = store::read_if_present(job_, prev);
    if (!prev_raw) return std::nullopt;  // tidied: the next poll reads the closed marker
    const int size =
        Roster::from_json(parse_object(*prev_raw, prev), prev, settings_.max_nodes).size();
    expected_back_ = expected_members(size, lost);
    expected_list_ = expected_ranks(size, lost);
    open_ = true;
  }
  const int count = static_cast<int>(job_.tally_count(key("entered")));
  const int rejoined = expected_back_ > 0 ? static_cast<int>(job_.tally_count(key("rejoined"))) : 0;
  const bool all_back = rejoined >= expected_back_;
  if (count >= settings_.min_nodes) min_seen_ = true;
  if ((count >= settings_.max_nodes && all_back) ||
      (expected_back_ > 0 && all_back && count >= settings_.min_nodes)) {
    try_complete();
  } else if (count >= settings_.min_nodes) {
    if (!last_call_since_) last_call_since_ = now_();
    const auto waited = now_() - *last_call_since_;
    if (waited >= timing_.last_call_timeout) {
      // Members still stopping their workers are waited for (bounded by
      // their announced grace); the rest of the last call is unchanged.
      last_call_wait_ = expected_back_ > 0 ? std::max(timing_.last_call_timeout, stopping_wait())
                                           : timing_.last_call_timeout;
      if (waited >= last_call_wait_) try_complete();
    }
  }
  if (job_.check({key("complete")})) return poll();
  return std::nullopt;
}

std::chrono::milliseconds C10dState::stopping_wait() {
  std::vector<std::string> back;
  const std::string entered = key("entered");
  if (job_.tally_count(entered) > 0) back = job_.tally_entries(entered);
  std::chrono::milliseconds longest{0};
  for (int g : expected_list_) {
    if (std::find(back.begin(), back.end(), "m" + std::to_string(g)) != back.end()) continue;
    const auto v =
        store::read_if_present(job_, C10dRoundWatch::stopping_key(generation_, round_ - 1, g));
    if (!v) continue;
    // Written by a peer: a number of ms within a year, or it is ignored.
    if (v->empty() || v->size() > 11 ||
        !std::all_of(v->begin(), v->end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    const auto ms = std::chrono::milliseconds(std::stoll(*v));
    if (ms > std::chrono::hours(24 * 365)) continue;
    longest = std::max(longest, ms + kStoppingMargin);
  }
  return longest;
}

std::chrono::milliseconds C10dState::until_last_call() const {
  if (!last_call_since_) return std::chrono::milliseconds::max();
  auto left = std::max(last_call_wait_, timing_.last_call_timeout) -
              std::chrono::duration_cast<std::chrono::milliseconds>(now_() - *last_call_since_);
  return std::max(left, std::chrono::milliseconds(0));
}

std::string C10dState::wait_key() const {
  if (!open_) return round_key(generation_, round_ - 1, "reform");
  return min_seen_ ? key("complete") : key("min");
}

int C10dState::close(const std::string& outcome) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(wall_now_().time_since_epoch()).count();
  job_.compare_set(
      closed_key(generation_), "",
      json_text::dump_record({{"outcome", outcome}, {"round", round_}, {"closed_at_ms", ms}}));
  return static_cast<int>(job_.tally_count(round_key(generation_, round_ + 1, "entered")));
}

int C10dState::closed_seen() {
  return static_cast<int>(
      job_.tally_count("g" + std::to_string(generation_) + "/rdzv/closed_seen"));
}

bool C10dState::mark_finishing(int attempt) {
  return job_.compare_set(key("gate/" + std::to_string(attempt)), "", "finishing") == "finishing";
}

void C10dState::watch_running_round() {
  // Every member of the running round may have died or left: nobody would
  // re-form it then, and this node would wait for ever. One presence per
  // poll, in turn, and the round's leavers; when one is gone, all are looked
  // at.
  if (running_members() <= 0 || round_ < 1) return;
  const std::vector<int> left =
      C10dRoundWatch::left_members(job_, generation_, round_ - 1, running_members());
  if (presence_ == nullptr && static_cast<int>(left.size()) < running_members()) return;
  // Lost: its presence key vanished with its agent, or its record did (a
  // member that died before it held its presence).
  auto gone = [&](int g) {
    if (std::find(left.begin(), left.end(), g) != left.end()) return true;
    if (presence_ == nullptr) return false;
    if (job_.check({C10dRoundWatch::present_key(generation_, round_ - 1, g) +
                    store::protocol::kGoneSuffix})) {
      return true;
    }
    if (job_.check({round_key(generation_, round_ - 1, "node/" + running_.slot(g)) +
                    store::protocol::kGoneSuffix})) {
      return true;
    }
    // A member whose workers finished withdrew its presence: its done key
    // still goes with it.
    return job_.check(
        {C10dRoundWatch::done_key(generation_, round_ - 1, g) + store::protocol::kGoneSuffix});
  };
  const int g = next_watched_++ % running_members();
  if (!gone(g)) return;
  MembershipChange change;
  for (int m = 0; m < running_members(); ++m) {
    if (!gone(m)) return;
    change.lost.push_back(m);
  }
  const bool all_left = static_cast<int>(left.size()) >= running_members();
  change.cause = all_left ? "agent left" : "agent exited";
  change.reason = "every node of round " + std::to_string(round_ - 1) + " is gone (" +
                  (all_left ? "left" : "lost or left") + ")";
  job_.compare_set(round_key(generation_, round_ - 1, "reform"), "", reform_record(change));
}

std::string C10dState::progress() {
  int count = round_ >= 0 ? static_cast<int>(job_.tally_count(key("entered"))) : 0;
  return std::to_string(count) + " of min " + std::to_string(settings_.min_nodes) + ", max " +
         std::to_string(settings_.max_nodes) + " nodes joined round " +
         std::to_string(std::max(round_, 0));
}

// ---------------------------------------------------------------------------

C10dRoundWatch::C10dRoundWatch(store::Store& job, C10dSettings settings, const C10dRound& round,
                               std::chrono::milliseconds last_call_timeout,
                               std::function<Clock::time_point()> now)
    : job_(job),
      settings_(std::move(settings)),
      generation_(round.generation),
      round_(round.round),
      members_(round.roster.size()),
      roster_(round.roster),
      me_(round.group_rank),
      last_call_timeout_(last_call_timeout),
      now_(std::move(now)),
      formed_at_(now_()) {}

std::string C10dRoundWatch::key(int round, const std::string& what) const {
  return C10dState::round_key(generation_, round, what);
}

MembershipChange C10dRoundWatch::parse(const std::string& raw) const {
  const std::string k = key(round_, "reform");
  auto j = parse_object(raw, k);
  MembershipChange r;
  auto reason = j.find("reason");
  auto lost = j.find("lost");
  if (reason == j.end() || !reason->is_string() || lost == j.end() || !lost->is_array()) {
    throw ProtocolError("unreadable record at key '" + k + "'");
  }
  r.reason = reason->get<std::string>();
  auto cause = j.find("cause");
  if (cause != j.end() && cause->is_string()) r.cause = cause->get<std::string>();
  for (const auto& v : *lost) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= members_) {
      throw ProtocolError("unreadable record at key '" + k + "': a lost member out of range");
    }
    r.lost.push_back(v.get<int>());
  }
  return r;
}

MembershipChange C10dRoundWatch::reform(const MembershipChange& change) {
  return parse(job_.compare_set(key(round_, "reform"), "", reform_record(change)));
}

std::string C10dRoundWatch::stopping_key(int generation, int round, int group_rank) {
  return C10dState::round_key(generation, round, "stopping/" + std::to_string(group_rank));
}

void C10dRoundWatch::announce_stopping(store::Store& presence, const C10dRound& round,
                                       std::chrono::milliseconds grace) {
  presence.set(stopping_key(round.generation, round.round, round.group_rank),
               std::to_string(std::max<int64_t>(grace.count(), 0)));
}

std::string C10dRoundWatch::done_key(int generation, int round, int group_rank) {
  return C10dState::round_key(generation, round, "done/" + std::to_string(group_rank));
}

void C10dRoundWatch::withdraw(store::Store& presence, const C10dRound& round) {
  CTORCHRUN_CHECK(round.group_rank >= 0 && round.group_rank < round.roster.size(),
                  "C10dRoundWatch::withdraw() by a node outside the round");
  presence.delete_key(present_key(round.generation, round.round, round.group_rank));
  presence.delete_key(C10dState::round_key(round.generation, round.round,
                                           "node/" + round.roster.slot(round.group_rank)));
  presence.delete_key(done_key(round.generation, round.round, round.group_rank));
}

void C10dRoundWatch::finish(store::Store& presence, const C10dRound& round) {
  withdraw(presence, round);
  presence.set(done_key(round.generation, round.round, round.group_rank), "1");
}

std::string C10dRoundWatch::left_key(int generation, int round) {
  return C10dState::round_key(generation, round, "left");
}

std::vector<int> C10dRoundWatch::left_members(store::Store& job, int generation, int round,
                                              int members) {
  const std::string k = left_key(generation, round);
  if (job.tally_count(k) <= 0) return {};
  std::vector<int> out;
  for (const std::string& e : job.tally_entries(k)) {
    // Written by peers: a group rank of the round, or it is ignored.
    if (e.empty() || e.size() > 9 ||
        !std::all_of(e.begin(), e.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      continue;
    }
    const int g = std::stoi(e);
    if (g < members && std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void C10dRoundWatch::leave(store::Store& job, int generation, int round, int group_rank) {
  job.tally_add(left_key(generation, round), std::to_string(group_rank));
}

std::string C10dRoundWatch::present_key(int generation, int round, int group_rank) {
  return C10dState::round_key(generation, round, "present/" + std::to_string(group_rank));
}

bool C10dRoundWatch::lost(int g) {
  return job_.check({present_key(generation_, round_, g) + store::protocol::kGoneSuffix}) ||
         (g < roster_.size() &&
          job_.check({key(round_, "node/" + roster_.slot(g)) + store::protocol::kGoneSuffix}));
}

MembershipChange C10dRoundWatch::gone_members(const std::vector<int>& left) {
  std::vector<int> left_now, lost_now;
  for (int g = 0; g < members_; ++g) {
    if (g == me_) continue;
    if (std::find(left.begin(), left.end(), g) != left.end()) {
      left_now.push_back(g);
    } else if (lost(g)) {
      lost_now.push_back(g);
    }
  }
  if (left_now.empty() && lost_now.empty()) return {};
  return gone_change(left_now, lost_now);
}

std::optional<MembershipChange> C10dRoundWatch::check(int attempt) {
  // One read that never waits: the record goes with the job's keys when the
  // last node tidies them (etcd), maybe while this check runs.
  if (auto record = store::read_if_present(job_, key(round_, "reform"))) return parse(*record);
  std::vector<int> left;
  if (members_ > 1) {
    // Gone: it left on purpose (the round's left tally), its presence key
    // vanished with its agent, or its record did (an agent that died after
    // entering, before it could hold its presence).
    left = left_members(job_, generation_, round_, members_);
    auto has_left = [&](int g) { return std::find(left.begin(), left.end(), g) != left.end(); };
    const bool any_left = std::any_of(left.begin(), left.end(), [&](int g) { return g != me_; });
    if (any_left || lost((me_ + 1) % members_)) {
      MembershipChange change = gone_members(left);
      if (!change.lost.empty()) return reform(change);
    }
    if (me_ != 0 && rank0_closed_ && rank0_closed_() && !has_left(0) &&
        job_.check({present_key(generation_, round_, 0)})) {
      MembershipChange change;
      change.lost = {0};
      change.cause = "agent exited";
      change.reason = "lost node 0 (agent exited: the workers' store it hosted closed)";
      return reform(change);
    }
  }
  if (members_ >= settings_.max_nodes || now_() - formed_at_ < last_call_timeout_) {
    return std::nullopt;
  }
  const int64_t waiting = live_waiters();
  if (waiting <= 0) return std::nullopt;
  // One gate per attempt: either it admits or its workers finish, never both.
  if (job_.compare_set(key(round_, "gate/" + std::to_string(attempt)), "", "admit") != "admit") {
    return std::nullopt;
  }
  const std::string admitting =
      "admitting " + std::to_string(waiting) + " waiting node" + (waiting == 1 ? "" : "s");
  // A member lost that this one does not watch may be what failed the
  // workers: the re-formation names it, so that the failure is refunded
  // (agent/restart_budget.h), and admits the waiting nodes all the same.
  // Once per attempt and member (the gate is taken): one request when every
  // other member's presence is there, one or two per member otherwise.
  std::vector<std::string> present;
  for (int g = 0; g < members_; ++g) {
    if (g != me_) present.push_back(present_key(generation_, round_, g));
  }
  const bool any_left = std::any_of(left.begin(), left.end(), [&](int g) { return g != me_; });
  if (members_ > 1 && (any_left || !job_.check(present))) {
    MembershipChange change = gone_members(left);
    if (!change.lost.empty()) {
      change.reason += "; " + admitting;
      return reform(change);
    }
  }
  MembershipChange admit;
  admit.reason = admitting;
  return reform(admit);
}

int64_t C10dRoundWatch::live_waiters() {
  const std::string entered = key(round_ + 1, "entered");
  if (job_.tally_count(entered) <= 0) return 0;
  // Only waiters whose record is there now: one that died or left while it
  // waited is no reason to stop the workers.
  std::vector<std::string> records;
  for (const std::string& s : job_.tally_entries(entered)) {
    if (valid_slot(s)) records.push_back(key(round_ + 1, "node/" + s));
    if (records.size() > static_cast<size_t>(kMaxSteps)) break;
  }
  if (records.empty()) return 0;
  if (job_.check(records)) return static_cast<int64_t>(records.size());
  int64_t live = 0;
  for (const auto& r : records) live += job_.check({r}) ? 1 : 0;
  return live;
}

}  // namespace ctorchrun::rendezvous

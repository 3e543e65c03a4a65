#include "rendezvous/roster.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace ctorchrun::rendezvous {

namespace {

constexpr int64_t kMaxLocalWorldSize = int64_t{1} << 20;
constexpr int64_t kMaxWorldSize = int64_t{1} << 30;
constexpr int64_t kMaxSlotNumber = 999'999'999;  // a slot has at most 9 digits

// 'n' or 'm' and a number of at most 9 digits.
std::optional<std::pair<char, int>> parse_slot(const std::string& s) {
  if (s.size() < 2 || s.size() > 10 || (s[0] != 'n' && s[0] != 'm')) return std::nullopt;
  if (!std::all_of(s.begin() + 1, s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::make_pair(s[0], std::stoi(s.substr(1)));
}

}  // namespace

Roster Roster::build(const std::vector<std::string>& slots, const std::vector<int>& sizes) {
  CTORCHRUN_CHECK(slots.size() == sizes.size(), "a roster with more slots than sizes");
  Roster r;
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto slot = parse_slot(slots[i]);
    CTORCHRUN_CHECK(slot.has_value(), "a roster slot that is none: " + slots[i]);
    CTORCHRUN_CHECK(sizes[i] >= 1 && sizes[i] <= kMaxLocalWorldSize,
                    "a roster member's local world size out of range");
    auto& runs = r.slot_runs_;
    if (!runs.empty() && runs.back().kind == slot->first &&
        static_cast<int64_t>(runs.back().first) + runs.back().count == slot->second) {
      ++runs.back().count;
    } else {
      runs.push_back({slot->first, slot->second, 1});
    }
    if (!r.size_runs_.empty() && r.size_runs_.back().local_world_size == sizes[i]) {
      ++r.size_runs_.back().count;
    } else {
      r.size_runs_.push_back({sizes[i], 1});
    }
    ++r.size_;
    r.world_ += sizes[i];
  }
  return r;
}

Roster Roster::from_json(const nlohmann::json& j, const std::string& key, int max_members) {
  auto bad = [&](const std::string& why) {
    return ProtocolError("unreadable roster at key '" + key + "': " + why);
  };
  auto number = [&](const nlohmann::json& v, int64_t lo, int64_t hi, const char* what) {
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      throw bad(std::string(what) + " out of range");
    }
    return v.get<int64_t>();
  };
  const auto slots = j.find("slots");
  const auto sizes = j.find("sizes");
  if (slots == j.end() || !slots->is_array() || sizes == j.end() || !sizes->is_array()) {
    throw bad("no 'slots' and 'sizes' lists");
  }
  // Each run holds a member at least: no more runs than members.
  if (slots->size() > static_cast<size_t>(max_members) ||
      sizes->size() > static_cast<size_t>(max_members)) {
    throw bad("more runs than " + std::to_string(max_members) + " members");
  }
  Roster r;
  int64_t members = 0;
  for (const auto& run : *slots) {
    if (!run.is_array() || run.size() != 3 || !run[0].is_string()) throw bad("a bad slot run");
    const std::string kind = run[0].get<std::string>();
    if (kind != "n" && kind != "m") throw bad("a slot kind that is neither 'n' nor 'm'");
    const int64_t first = number(run[1], 0, kMaxSlotNumber, "a slot number");
    const int64_t count = number(run[2], 1, max_members, "a slot run's count");
    if (first + count - 1 > kMaxSlotNumber) throw bad("a slot number out of range");
    members += count;
    if (members > max_members) throw bad("more than " + std::to_string(max_members) + " members");
    r.slot_runs_.push_back({kind[0], static_cast<int>(first), static_cast<int>(count)});
  }
  // No slot twice: runs of one kind do not overlap.
  std::vector<SlotRun> sorted = r.slot_runs_;
  std::sort(sorted.begin(), sorted.end(), [](const SlotRun& a, const SlotRun& b) {
    return a.kind != b.kind ? a.kind < b.kind : a.first < b.first;
  });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].kind == sorted[i - 1].kind &&
        static_cast<int64_t>(sorted[i - 1].first) + sorted[i - 1].count > sorted[i].first) {
      throw bad("a slot listed twice");
    }
  }
  int64_t sized = 0;
  for (const auto& run : *sizes) {
    if (!run.is_array() || run.size() != 2) throw bad("a bad size run");
    const int64_t lws = number(run[0], 1, kMaxLocalWorldSize, "a local world size");
    const int64_t count = number(run[1], 1, max_members, "a size run's count");
    sized += count;
    if (sized > members) throw bad("more sizes than members");
    r.world_ += lws * count;
    if (r.world_ > kMaxWorldSize) throw bad("a world size out of range");
    r.size_runs_.push_back({static_cast<int>(lws), static_cast<int>(count)});
  }
  if (sized != members || members == 0) throw bad("sizes and slots of different members");
  r.size_ = static_cast<int>(members);
  return r;
}

void Roster::to_json(nlohmann::json& j) const {
  nlohmann::json slots = nlohmann::json::array();
  for (const auto& run : slot_runs_) {
    slots.push_back({std::string(1, run.kind), run.first, run.count});
  }
  nlohmann::json sizes = nlohmann::json::array();
  for (const auto& run : size_runs_) sizes.push_back({run.local_world_size, run.count});
  j["slots"] = std::move(slots);
  j["sizes"] = std::move(sizes);
}

std::optional<int> Roster::group_rank_of(const std::string& slot) const {
  const auto s = parse_slot(slot);
  if (!s) return std::nullopt;
  int g = 0;
  for (const auto& run : slot_runs_) {
    if (run.kind == s->first && s->second >= run.first &&
        static_cast<int64_t>(s->second) < static_cast<int64_t>(run.first) + run.count) {
      return g + (s->second - run.first);
    }
    g += run.count;
  }
  return std::nullopt;
}

std::string Roster::slot(int g) const {
  CTORCHRUN_CHECK(g >= 0 && g < size_, "Roster::slot() of a group rank outside the roster");
  for (const auto& run : slot_runs_) {
    if (g < run.count) return std::string(1, run.kind) + std::to_string(run.first + g);
    g -= run.count;
  }
  CTORCHRUN_CHECK(false, "Roster::slot(): runs shorter than the roster");
  return {};
}

int Roster::local_world_size(int g) const {
  CTORCHRUN_CHECK(g >= 0 && g < size_, "Roster::local_world_size() outside the roster");
  for (const auto& run : size_runs_) {
    if (g < run.count) return run.local_world_size;
    g -= run.count;
  }
  CTORCHRUN_CHECK(false, "Roster::local_world_size(): runs shorter than the roster");
  return 0;
}

int64_t Roster::first_rank(int g) const {
  CTORCHRUN_CHECK(g >= 0 && g <= size_, "Roster::first_rank() outside the roster");
  int64_t rank = 0;
  for (const auto& run : size_runs_) {
    const int n = std::min(g, run.count);
    rank += static_cast<int64_t>(n) * run.local_world_size;
    g -= n;
    if (g == 0) break;
  }
  return rank;
}

std::vector<std::string> Roster::slots() const {
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(size_));
  for (const auto& run : slot_runs_) {
    for (int i = 0; i < run.count; ++i) {
      out.push_back(std::string(1, run.kind) + std::to_string(run.first + i));
    }
  }
  return out;
}

std::vector<int> Roster::local_world_sizes() const {
  std::vector<int> out;
  out.reserve(static_cast<size_t>(size_));
  for (const auto& run : size_runs_)
    out.insert(out.end(), static_cast<size_t>(run.count), run.local_world_size);
  return out;
}

bool Roster::operator==(const Roster& o) const {
  auto same_slots = [](const SlotRun& a, const SlotRun& b) {
    return a.kind == b.kind && a.first == b.first && a.count == b.count;
  };
  auto same_sizes = [](const SizeRun& a, const SizeRun& b) {
    return a.local_world_size == b.local_world_size && a.count == b.count;
  };
  return size_ == o.size_ && world_ == o.world_ &&
         std::equal(slot_runs_.begin(), slot_runs_.end(), o.slot_runs_.begin(), o.slot_runs_.end(),
                    same_slots) &&
         std::equal(size_runs_.begin(), size_runs_.end(), o.size_runs_.begin(), o.size_runs_.end(),
                    same_sizes);
}

}  // namespace ctorchrun::rendezvous

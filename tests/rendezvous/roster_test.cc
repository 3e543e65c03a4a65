// rendezvous::Roster: the compact roster a round's completer publishes:
// runs of slots and of local world sizes, the prefix sums every member takes
// its ranks from, and a peer's bad roster refused.

#include "rendezvous/roster.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"

using ctorchrun::ProtocolError;
using ctorchrun::rendezvous::Roster;

namespace {

// Written and read back as a member reads it.
Roster round_trip(const Roster& r, int max_members) {
  nlohmann::json j = nlohmann::json::object();
  r.to_json(j);
  return Roster::from_json(nlohmann::json::parse(j.dump()), "g0/rdzv/0/complete", max_members);
}

Roster read(const std::string& raw, int max_members = 16) {
  return Roster::from_json(nlohmann::json::parse(raw), "g0/rdzv/0/complete", max_members);
}

}  // namespace

TEST_CASE(
    "Roster: prefix sums of mixed local world sizes give each member's first rank and the "
    "world size",
    "[unit]") {
  const std::vector<std::string> slots{"n0", "n1", "n2", "n3", "n4", "n5", "n6"};
  const std::vector<int> sizes{8, 8, 8, 4, 4, 2, 8};
  const Roster r = round_trip(Roster::build(slots, sizes), 7);
  CHECK(r.size() == 7);
  CHECK(r.world_size() == 42);
  // Equal neighbours collapse into runs: 8x3, 4x2, 2, 8.
  REQUIRE(r.size_runs().size() == 4);
  CHECK(r.size_runs()[0].count == 3);
  const std::vector<int64_t> first{0, 8, 16, 24, 28, 32, 34};
  for (int g = 0; g < 7; ++g) {
    CHECK(r.first_rank(g) == first[static_cast<size_t>(g)]);
    CHECK(r.local_world_size(g) == sizes[static_cast<size_t>(g)]);
  }
  CHECK(r.first_rank(7) == 42);
  CHECK(r.local_world_sizes() == sizes);
}

TEST_CASE("Roster: runs of consecutive slots collapse and group ranks follow them", "[unit]") {
  // Members of the round before first (m2 lost), then newcomers by arrival
  // (n1 died before the roster).
  const std::vector<std::string> slots{"m0", "m1", "m3", "n0", "n2", "n3", "n4"};
  const Roster r = round_trip(Roster::build(slots, std::vector<int>(7, 2)), 8);
  REQUIRE(r.slot_runs().size() == 4);
  CHECK(r.slots() == slots);
  for (int g = 0; g < 7; ++g) {
    CHECK(r.slot(g) == slots[static_cast<size_t>(g)]);
    CHECK(r.group_rank_of(slots[static_cast<size_t>(g)]) == g);
  }
  CHECK_FALSE(r.group_rank_of("m2").has_value());
  CHECK_FALSE(r.group_rank_of("n1").has_value());
  CHECK_FALSE(r.group_rank_of("n5").has_value());
  CHECK_FALSE(r.group_rank_of("x1").has_value());
  CHECK(r.size_runs().size() == 1);
}

TEST_CASE("Roster: 4096 members alike publish in a few dozen bytes", "[unit]") {
  std::vector<std::string> slots;
  for (int i = 0; i < 4096; ++i) slots.push_back("n" + std::to_string(i));
  const Roster r = Roster::build(slots, std::vector<int>(4096, 8));
  nlohmann::json j = nlohmann::json::object();
  r.to_json(j);
  CHECK(j.dump().size() < 64);
  const Roster back = round_trip(r, 4096);
  CHECK(back == r);
  CHECK(back.world_size() == 32768);
  CHECK(back.group_rank_of("n4095") == 4095);
  CHECK(back.first_rank(4095) == 32760);
}

TEST_CASE("Roster: a peer's unreadable roster is a protocol error naming the key", "[unit]") {
  const char* bad[] = {
      R"({"sizes": [[1, 1]]})",                                       // no slots
      R"({"slots": [["n", 0, 2]], "sizes": [[1, 1]]})",               // sizes short
      R"({"slots": [["n", 0, 1]], "sizes": [[1, 2]]})",               // sizes long
      R"({"slots": [["n", 0, 2], ["n", 1, 1]], "sizes": [[1, 3]]})",  // n1 twice
      R"({"slots": [["x", 0, 1]], "sizes": [[1, 1]]})",               // no kind
      R"({"slots": [["n", -1, 1]], "sizes": [[1, 1]]})",              // negative
      R"({"slots": [["n", 0, 0]], "sizes": [[1, 1]]})",               // an empty run
      R"({"slots": [["n", 0, 17]], "sizes": [[1, 17]]})",             // over max
      R"({"slots": [["n", 0, 1]], "sizes": [[0, 1]]})",               // no workers
      R"({"slots": [["n", 0, 1]], "sizes": [[2000000, 1]]})",         // too many workers
      R"({"slots": [["n", 999999999, 2]], "sizes": [[1, 2]]})",       // past 9 digits
      R"({"slots": [], "sizes": []})",                                // nobody
      R"({"slots": [["n", 0, 1, 4]], "sizes": [[1, 1]]})",            // a bad run
  };
  for (const char* raw : bad) {
    INFO(raw);
    try {
      read(raw);
      FAIL("accepted");
    } catch (const ProtocolError& e) {
      CHECK_THAT(e.what(), Catch::Contains("g0/rdzv/0/complete"));
    }
  }
  // The world size is bounded (2^30): 1025 nodes of 2^20 workers is too many.
  CHECK_THROWS_AS(read(R"({"slots": [["n", 0, 1025]], "sizes": [[1048576, 1025]]})", 2048),
                  ProtocolError);
  CHECK(read(R"({"slots": [["m", 0, 2], ["n", 0, 1]], "sizes": [[3, 3]]})").world_size() == 9);
}

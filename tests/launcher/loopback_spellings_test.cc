// Agents of one job on one host whose endpoint spells the loopback three ways
// (localhost, 127.0.0.1, [::1]) meet one store and form one job: the store
// binds both address families, as torch's does (rendezvous/endpoint.h's
// bind_addresses_for). Shell workers record what they see.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "tests/launcher/launcher_support.h"

using namespace ctorchrun::testing;
using namespace std::chrono_literals;

namespace {

const std::vector<std::string> kSpellings = {"localhost", "127.0.0.1", "[::1]"};

// A socket to `literal`:`port`, bound or connected.
bool socket_to(const std::string& literal, int port, bool connect) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, literal.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a4;
  } else if (inet_pton(AF_INET6, literal.c_str(), &a6->sin6_addr) == 1) {
    family = AF_INET6;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a6;
  } else {
    return false;
  }
  int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  auto* sa = reinterpret_cast<sockaddr*>(&ss);
  const bool ok = connect ? ::connect(fd, sa, len) == 0 : ::bind(fd, sa, len) == 0;
  ::close(fd);
  return ok;
}

bool has_v6_loopback() { return socket_to("::1", 0, false); }

// A port free on 127.0.0.1 and on ::1.
int free_loopback_port() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = free_port();
    if (socket_to("127.0.0.1", port, false) && socket_to("::1", port, false)) return port;
  }
  FAIL("no port free on both 127.0.0.1 and ::1");
  return 0;
}

// Waits (bounded) until something accepts on `spelling`:`port`, reached the
// way that spelling is (localhost: its first address).
bool listening(const std::string& spelling, int port, std::chrono::milliseconds timeout) {
  const std::string literal = spelling == "localhost" ? "127.0.0.1"
                              : spelling == "[::1]"   ? "::1"
                                                      : spelling;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (socket_to(literal, port, true)) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// Checks that agent i's worker saw a job of 3 nodes (one worker each) and
// returns its group rank, or -1.
int group_rank_seen(const TempDir& d, size_t i) {
  const std::string path = d.file("seen_" + std::to_string(i));
  INFO("agent " << i << " (" << kSpellings[i] << ") recorded: " << read_file(path));
  REQUIRE(file_exists(path));
  std::istringstream in(read_file(path));
  std::string world, group_world;
  int group_rank = -1;
  in >> world >> group_world >> group_rank;
  CHECK(world == "3");
  CHECK(group_world == "3");
  return group_rank;
}

// Every agent's exit code (within 60 s) and output.
struct Ended {
  std::vector<int> codes;
  std::vector<std::string> outputs;
  std::string all;  // each agent's spelling, exit code and output, for INFO
};
Ended ended(std::vector<std::unique_ptr<Process>>& agents) {
  Ended e;
  for (auto& a : agents) e.codes.push_back(a->exit_code(60s));
  for (size_t i = 0; i < agents.size(); ++i) {
    e.outputs.push_back(agents[i]->read_all(1s));
    e.all += "---- agent " + std::to_string(i) + " (" + kSpellings[i] + "): exit " +
             std::to_string(e.codes[i]) + "\n" + e.outputs[i] + "\n";
  }
  return e;
}

}  // namespace

TEST_CASE("c10d: agents whose endpoints are localhost, 127.0.0.1 and [::1] form one job of 3",
          "[multiproc]") {
  if (!has_v6_loopback()) {
    WARN("this host has no ::1: [::1] is not a spelling of its loopback");
    return;
  }
  // Which agent starts first and hosts the store (3: all at once).
  const size_t first = GENERATE(0, 1, 2, 3);
  INFO("first: " << (first < 3 ? kSpellings[first] : "all at once"));
  TempDir d;
  const std::string port = std::to_string(free_loopback_port());
  std::vector<std::unique_ptr<Process>> agents(3);
  auto start = [&](size_t i) {
    agents[i] =
        start_ctorchrun(concat({"--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                "--rdzv_endpoint=" + kSpellings[i] + ":" + port, "--rdzv_id=same",
                                "--max_restarts=0", "--rdzv_conf=join_timeout=20"},
                               sh("echo \"$WORLD_SIZE $GROUP_WORLD_SIZE $GROUP_RANK\" > " +
                                  d.file("seen_" + std::to_string(i)))));
  };
  if (first < 3) {
    start(first);
    REQUIRE(listening(kSpellings[first], std::stoi(port), 30s));
  }
  for (size_t i = 0; i < 3; ++i) {
    if (!agents[i]) start(i);
  }
  const Ended e = ended(agents);
  INFO(e.all);
  CHECK(e.codes == std::vector<int>{0, 0, 0});
  // One store, hosted by one agent (the first, when one started first).
  CHECK(count_lines_with(e.all, "hosting the rendezvous store") == 1);
  if (first < 3) CHECK(count_lines_with(e.outputs[first], "hosting the rendezvous store") == 1);
  std::set<int> ranks;
  for (size_t i = 0; i < 3; ++i) ranks.insert(group_rank_seen(d, i));
  CHECK(ranks == std::set<int>{0, 1, 2});
}

TEST_CASE("static: nodes whose --master_addr is localhost, 127.0.0.1 and [::1] form one job of 3",
          "[multiproc]") {
  if (!has_v6_loopback()) {
    WARN("this host has no ::1: [::1] is not a spelling of its loopback");
    return;
  }
  // Which spelling node 0 (the store's host) is given.
  const size_t host = GENERATE(0, 1, 2);
  INFO("node 0: " << kSpellings[host]);
  TempDir d;
  const std::string port = std::to_string(free_loopback_port());
  std::vector<std::unique_ptr<Process>> agents(3);
  int next_rank = 1;
  for (size_t i = 0; i < 3; ++i) {
    const int rank = i == host ? 0 : next_rank++;
    agents[i] = start_ctorchrun(concat(
        {"--nnodes=3", "--nproc_per_node=1", "--node_rank=" + std::to_string(rank),
         "--master_addr=" + kSpellings[i], "--master_port=" + port, "--rdzv_conf=timeout=20"},
        sh("echo \"$WORLD_SIZE $GROUP_WORLD_SIZE $GROUP_RANK\" > " +
           d.file("seen_" + std::to_string(i)))));
  }
  const Ended e = ended(agents);
  INFO(e.all);
  CHECK(e.codes == std::vector<int>{0, 0, 0});
  std::set<int> ranks;
  for (size_t i = 0; i < 3; ++i) ranks.insert(group_rank_seen(d, i));
  CHECK(ranks == std::set<int>{0, 1, 2});
}

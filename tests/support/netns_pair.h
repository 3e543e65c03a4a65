#pragma once

// Two "machines" for multi-node tests: network namespaces joined by a veth
// pair, made by the test and removed when it ends. Needs root (CI runs as
// root); without it `ok` is false and the test fails rather than skips.

#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace ctorchrun::testing {

inline int netns_sh(const std::string& cmd) { return std::system(cmd.c_str()); }

// Two namespaces, "<tag>a" (10.251.N.1) and "<tag>b" (10.251.N.2), removed on
// destruction.
struct NetnsPair {
  NetnsPair() {
    std::random_device rd;
    subnet = static_cast<int>(rd() % 200) + 20;
    tag = "ctr" + std::to_string(::getpid() % 100000);
    a = tag + "a";
    b = tag + "b";
    addr_a = "10.251." + std::to_string(subnet) + ".1";
    addr_b = "10.251." + std::to_string(subnet) + ".2";
    std::string va = tag + "va", vb = tag + "vb";
    ok = netns_sh("ip netns add " + a) == 0 && netns_sh("ip netns add " + b) == 0 &&
         netns_sh("ip link add " + va + " type veth peer name " + vb) == 0 &&
         netns_sh("ip link set " + va + " netns " + a) == 0 &&
         netns_sh("ip link set " + vb + " netns " + b) == 0 &&
         netns_sh("ip -n " + a + " addr add " + addr_a + "/24 dev " + va) == 0 &&
         netns_sh("ip -n " + b + " addr add " + addr_b + "/24 dev " + vb) == 0 &&
         netns_sh("ip -n " + a + " link set " + va + " up") == 0 &&
         netns_sh("ip -n " + b + " link set " + vb + " up") == 0 &&
         netns_sh("ip -n " + a + " link set lo up") == 0 &&
         netns_sh("ip -n " + b + " link set lo up") == 0;
    if_a = va;
    if_b = vb;
  }
  ~NetnsPair() {
    netns_sh("ip netns del " + a + " 2>/dev/null");
    netns_sh("ip netns del " + b + " 2>/dev/null");
  }
  // argv running `args` inside namespace `ns`.
  std::vector<std::string> in(const std::string& ns, const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {"/usr/sbin/ip", "netns", "exec", ns};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  bool ok = false;
  int subnet = 0;
  std::string tag, a, b, addr_a, addr_b, if_a, if_b;
};

}  // namespace ctorchrun::testing

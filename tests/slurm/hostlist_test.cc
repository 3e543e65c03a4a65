// Slurm's hostlist grammar, as cli/slurm.h expands it; the [multiproc] case
// checks the same expressions against Slurm's own `scontrol show hostnames`.

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cli/slurm.h"
#include "common/error.h"
#include "tests/slurm/slurm_support.h"

using ctorchrun::ConfigError;
using ctorchrun::cli::expand_hostlist;
using Hosts = std::vector<std::string>;

TEST_CASE("hostlist: a range in brackets keeps the zero padding of its low end", "[unit]") {
  CHECK(expand_hostlist("n[01-04,07]") == Hosts{"n01", "n02", "n03", "n04", "n07"});
  CHECK(expand_hostlist("n[08-11]") == Hosts{"n08", "n09", "n10", "n11"});
  CHECK(expand_hostlist("n[8-11]") == Hosts{"n8", "n9", "n10", "n11"});
  CHECK(expand_hostlist("n[007-9]") == Hosts{"n007", "n008", "n009"});
  CHECK(expand_hostlist("n[1-010]").size() == 10);
  CHECK(expand_hostlist("n[1-010]").back() == "n10");
  CHECK(expand_hostlist("n[0-2]") == Hosts{"n0", "n1", "n2"});
  CHECK(expand_hostlist("n[05]") == Hosts{"n05"});
}

TEST_CASE("hostlist: several brackets in one name are a product with the first slowest", "[unit]") {
  CHECK(expand_hostlist("r[1-2]-n[1-2]") == Hosts{"r1-n1", "r1-n2", "r2-n1", "r2-n2"});
  CHECK(expand_hostlist("n[1-2]y[03-04]") == Hosts{"n1y03", "n1y04", "n2y03", "n2y04"});
  CHECK(expand_hostlist("n[1-2][3-4]") == Hosts{"n13", "n14", "n23", "n24"});
}

TEST_CASE("hostlist: top-level commas separate names and duplicates are kept", "[unit]") {
  CHECK(expand_hostlist("a,b[1-2],c") == Hosts{"a", "b1", "b2", "c"});
  CHECK(expand_hostlist("n1,n1,n2") == Hosts{"n1", "n1", "n2"});
  CHECK(expand_hostlist("n[1,1]") == Hosts{"n1", "n1"});
  CHECK(expand_hostlist("n[1-3],n[2-3]") == Hosts{"n1", "n2", "n3", "n2", "n3"});
  CHECK(expand_hostlist("n[2-2,1]") == Hosts{"n2", "n1"});
  CHECK(expand_hostlist(",n1,,m,") == Hosts{"n1", "m"});
  CHECK(expand_hostlist("a b") == Hosts{"a", "b"});
  CHECK(expand_hostlist("node-1.cluster") == Hosts{"node-1.cluster"});
  CHECK(expand_hostlist("").empty());
}

TEST_CASE("hostlist: malformed expressions are errors naming the expression", "[unit]") {
  for (const char* bad : {"n[3-1]", "n[]", "n[1-2", "n1]", "n[a-b]", "n[1-2,]", "n[1--2]", "n[-1]",
                          "n[1-2]x", "n[[1-2]]", "x[1-2]]", "n[1-2]-", "n[0-200000]",
                          "n[1-3]y,m[5]", "n[99999999999999999999999]"}) {
    INFO(bad);
    try {
      expand_hostlist(bad);
      FAIL("no error for " << bad);
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()).find(bad) != std::string::npos);
    }
  }
  // A product that would not fit in memory is refused before it is built.
  CHECK_THROWS_AS(expand_hostlist("a[0-65535]b[0-65535]"), ConfigError);
}

TEST_CASE("hostlist: every expression expands as scontrol show hostnames does", "[multiproc]") {
  // scontrol needs a configuration file, not a daemon, for this.
  ctorchrun::testing::TempDir dir("hostlist");
  {
    std::ofstream conf(dir.path + "/slurm.conf");
    conf << "ClusterName=probe\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n";
  }
  const std::vector<std::string> expressions = {
      "n[01-04,07]",  "r[1-2]-n[1-2]", "n1,n1,n2", "n[1-010]",    "n[8-11]",   "n[08-11]",
      "a,b[1-2],c",   "n[1,1]",        "n[007-9]", "n[1-2][3-4]", "n[01-2]",   "n[9-10]",
      "n[0-0]",       "node-1",        "n[1-2],",  ",n1",         "n,,m",      "[1-2]",
      "n[1-2]-[3-4]", "n[1-2,3-4]",    "n[0-10]",  "n[00-10]",    "n[08-100]", "n[1-2]y[03-04]",
      "n[2-2,1]",     "n[1-3],n[2-3]", "a.b[1-2]", "n[01-1]",     "n[1-01]",   "x[1-2]-y[01-03]-z"};
  for (const std::string& e : expressions) {
    INFO(e);
    const ctorchrun::testing::CommandResult r = ctorchrun::testing::run_command(
        {"scontrol", "show", "hostnames", e}, {{"SLURM_CONF", dir.path + "/slurm.conf"}});
    REQUIRE(r.exit_code == 0);
    Hosts theirs;
    std::string line;
    for (char ch : r.output) {
      if (ch == '\n') {
        theirs.push_back(line);
        line.clear();
      } else {
        line.push_back(ch);
      }
    }
    REQUIRE(theirs.size() > 0);
    if (theirs.front().find("Invalid hostlist") != std::string::npos) {
      CHECK_THROWS_AS(expand_hostlist(e), ConfigError);
    } else {
      CHECK(expand_hostlist(e) == theirs);
    }
  }
}

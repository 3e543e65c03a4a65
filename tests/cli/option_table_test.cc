// The command line is one table (cli/option_table.h): the parser, --help and
// the README's option list all come from its rows.

#include "cli/option_table.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <set>
#include <sstream>

#include "cli/option_parser.h"
#include "tests/cli/parse_support.h"

using namespace ctorchrun;
using namespace ctorchrun::cli;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ParsedOptions parse_raw(std::vector<std::string> args,
                        const std::map<std::string, std::string>& env = {}) {
  args.insert(args.begin(), "ctorchrun");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_options(static_cast<int>(argv.size()), argv.data(), env);
}

// A value row `r` accepts.
std::string sample_value(const OptionRow& r) {
  if (!r.choices.empty()) return r.choices.back();
  switch (r.type) {
    case ValueType::kInteger:
    case ValueType::kIntegerList:
      return std::to_string(r.max);
    case ValueType::kSeconds:
      return "2.5";
    default:
      return "x";
  }
}

}  // namespace

TEST_CASE("option table: the README's option list is the table's", "[unit]") {
  const std::string readme = read_file(std::string(CTORCHRUN_SOURCE_DIR) + "/README.md");
  const std::string begin = "<!-- options table: begin -->\n", end = "<!-- options table: end -->";
  const auto b = readme.find(begin), e = readme.find(end);
  REQUIRE(b != std::string::npos);
  REQUIRE(e != std::string::npos);
  const std::string ours = readme.substr(b + begin.size(), e - b - begin.size());
  const std::string expected = options_markdown();
  if (ours != expected) {
    std::ofstream("README.options.md") << expected;
    FAIL_CHECK(
        "README.md's options table differs from cli/option_table.cc: run "
        "scripts/update_readme_options.sh (the expected table is in README.options.md in the "
        "test's working directory)");
  }
}

TEST_CASE("option table: every row is in --help and parses in each spelling and from PET_",
          "[unit]") {
  const std::string help = help_text();
  for (const OptionRow& r : option_table()) {
    INFO(r.key);
    REQUIRE(!r.long_names().empty());
    if (!r.env.empty()) {
      CHECK(r.env.front().rfind("PET_", 0) == 0);
      CHECK(help.find("[env: " + r.env.front() + "]") != std::string::npos);
    }
    std::vector<std::string> spellings = r.long_names();
    if (!r.short_name().empty()) spellings.push_back(r.short_name());
    for (const std::string& s : spellings) {
      INFO(s);
      CHECK(help.find(s) != std::string::npos);
      std::vector<std::string> args = {s};
      if (r.takes_value()) args.push_back(sample_value(r));
      args.push_back("s.py");
      ParsedOptions o = parse_raw(args);
      if (r.key == "print_completion") {
        CHECK(o.exit_now);
        continue;
      }
      CHECK(o.at(r.key).given);
      CHECK(o.at(r.key).spelled == s);
      CHECK(o.source(r.key) == s);
    }
    for (const std::string& e : r.env) {
      INFO(e);
      ParsedOptions o = parse_raw({"s.py"}, {{e, r.takes_value() ? sample_value(r) : "1"}});
      CHECK(o.at(r.key).given);
      CHECK(o.at(r.key).env_name == e);
      CHECK(o.source(r.key) == e);
    }
    ParsedOptions none = parse_raw({"s.py"});
    CHECK_FALSE(none.at(r.key).given);
    if (r.type == ValueType::kText) CHECK(none.at(r.key).text == r.default_text);
  }
}

TEST_CASE("option table: keys and spellings are unique, and the underscore spelling is there",
          "[unit]") {
  std::set<std::string> keys, names;
  for (const OptionRow& r : option_table()) {
    INFO(r.key);
    CHECK(keys.insert(r.key).second);
    bool underscore_or_single = r.key.find('_') == std::string::npos;
    for (const std::string& n : r.long_names()) {
      CHECK(names.insert(n).second);
      if (n == "--" + r.key) underscore_or_single = true;
    }
    CHECK(underscore_or_single);  // torchrun 1.13's spelling --nproc_per_node
  }
}

TEST_CASE("option table: no function in cli/ is longer than a screen", "[unit]") {
  // A function starts where a line at column 0 opens a brace at depth 0 and
  // ends at its closing "}" at column 0; tables of data are written as such.
  for (const char* file : {"command_line.cc", "option_parser.cc", "option_table.cc", "rdzv_conf.cc",
                           "slurm.cc", "ctorchrun_main.cc", "ctorch_store_main.cc", "completion.cc",
                           "man_page.cc", "man_page_main.cc"}) {
    const std::string text = read_file(std::string(CTORCHRUN_SOURCE_DIR) + "/cli/" + file);
    REQUIRE(!text.empty());
    std::stringstream ss(text);
    std::string line, head;
    int number = 0, start = 0;
    bool in_function = false;
    while (std::getline(ss, line)) {
      ++number;
      const bool top = !line.empty() && line[0] != ' ' && line[0] != '/' && line[0] != '#' &&
                       line.rfind("namespace", 0) != 0 && line.rfind("}  // namespace", 0) != 0;
      if (!in_function && top && line.find('(') != std::string::npos && head.empty()) {
        head = line;
        start = number;
      }
      if (!in_function && !head.empty() && !line.empty() && line.back() == '{') in_function = true;
      if (!in_function && !head.empty() && !line.empty() && line.back() == ';') head.clear();
      if (in_function && line == "}") {
        INFO(file << ":" << start << ": " << head);
        CHECK(number - start + 1 <= 60);
        in_function = false;
        head.clear();
      }
    }
  }
}

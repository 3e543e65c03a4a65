// The manual pages (cli/man_page.h): ctorchrun(1) names every option of the
// table, as --help does, and ctorch-store(1) every option of its --help.

#include "cli/man_page.h"

#include <catch2/catch.hpp>
#include <string>

#include "cli/option_table.h"

namespace ctorchrun::cli {
namespace {

TEST_CASE("man page: ctorchrun(1) names every spelling of every option of the table", "[unit]") {
  const std::string page = ctorchrun_man_page();
  REQUIRE(page.rfind(".TH CTORCHRUN 1 ", 0) == 0);
  size_t items = 0;
  for (const OptionRow& r : option_table()) {
    for (const std::string& name : r.long_names()) {
      INFO(name);
      CHECK(page.find("\\fB" + roff_escape(name) + "\\fR") != std::string::npos);
    }
    if (!r.short_name().empty())
      CHECK(page.find("\\fB" + roff_escape(r.short_name()) + "\\fR") != std::string::npos);
    for (const std::string& env : r.env) CHECK(page.find(env) != std::string::npos);
  }
  for (size_t at = page.find("\n.TP\n"); at != std::string::npos; at = page.find("\n.TP\n", at + 1))
    ++items;
  CHECK(items == option_table().size() + 2);  // and -h/--help, --version
  CHECK(page.find("\\fB\\-\\-version\\fR") != std::string::npos);
}

TEST_CASE("man page: ctorchrun(1) carries --help's exit codes and variables", "[unit]") {
  const std::string page = ctorchrun_man_page();
  CHECK(page.find(".SH \"EXIT STATUS\"\n") != std::string::npos);
  CHECK(page.find("TORCHELASTIC_RESTART_COUNT") != std::string::npos);
  CHECK(page.find("rdzv_conf") != std::string::npos);
  CHECK(page.find("\n.SH OPTIONS\n") < page.find("\n.SH DETAILS\n"));
}

TEST_CASE("man page: roff_escape keeps a line from being read as a request", "[unit]") {
  CHECK(roff_escape("--nproc_per_node") == "\\-\\-nproc_per_node");
  CHECK(roff_escape(".hidden") == "\\&.hidden");
  CHECK(roff_escape("'quoted") == "\\&'quoted");
  CHECK(roff_escape("a\\b") == "a\\eb");
  CHECK(roff_escape("plain text") == "plain text");
}

TEST_CASE("man page: a page from CLI11's --help, help2man-like", "[unit]") {
  const std::string help =
      "tool: serves things over TCP.\n"
      "More words about it.\n"
      "\n"
      "Exit codes: 0 stopped, 2 usage error.\n"
      "Usage: build/bin/tool [OPTIONS]\n"
      "\n"
      "Options:\n"
      "  -h,--help                   Print this help message and exit\n"
      "  --port INT:INT in [0 - 65535]=29500\n"
      "                              port to listen on\n"
      "  --host TEXT=0.0.0.0         address to bind\n"
      "  --fail-rank INT:NONNEGATIVE the rank that fails\n";
  const std::string page = man_page_from_help("tool", help);
  CHECK(page.rfind(".TH TOOL 1 ", 0) == 0);
  CHECK(page.find(".SH NAME\ntool \\- serves things over TCP\n") != std::string::npos);
  CHECK(page.find(".SH SYNOPSIS\ntool [OPTIONS]\n") != std::string::npos);
  CHECK(page.find("More words about it.") != std::string::npos);
  CHECK(page.find(".SH \"EXIT STATUS\"\nExit codes: 0 stopped, 2 usage error.\n") !=
        std::string::npos);
  CHECK(page.find(".TP\n\\fB\\-h,\\-\\-help\\fR\nPrint this help message and exit\n") !=
        std::string::npos);
  CHECK(page.find(".TP\n\\fB\\-\\-port\\fR INT:INT in [0 \\- 65535]=29500\nport to listen on\n") !=
        std::string::npos);
  CHECK(page.find(".TP\n\\fB\\-\\-host\\fR TEXT=0.0.0.0\naddress to bind\n") != std::string::npos);
  // A name as wide as CLI11's column: one space before the description.
  CHECK(page.find(".TP\n\\fB\\-\\-fail\\-rank\\fR INT:NONNEGATIVE\nthe rank that fails\n") !=
        std::string::npos);
}

}  // namespace
}  // namespace ctorchrun::cli

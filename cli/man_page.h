#pragma once

// Manual pages (roff, man(7)) for the installed commands, made at build time
// by the ctorchrun-man generator (cli/man_page_main.cc):
//  - ctorchrun(1) from the option table (cli/option_table.h), the same rows
//    --help and --print-completion are made from, so that a new row is in
//    all three at once, and from --help's text after the options;
//  - ctorch-store(1), help2man-like, from its CLI11 --help.

#include <string>
#include <string_view>

namespace ctorchrun::cli {

// ctorchrun(1).
std::string ctorchrun_man_page();

// A page for `name` from what `name --help` prints (CLI11's layout: a
// description whose first line is "NAME: summary.", "Usage: ...", then
// "Options:" with one option per line, its description after two spaces or
// on the lines below).
std::string man_page_from_help(const std::string& name, const std::string& help);

// `text` safe in a roff line: backslashes written \e, hyphens \- (so that
// options copy and search as typed), a line that starts with '.' or '\''
// protected by \&.
std::string roff_escape(std::string_view text);

}  // namespace ctorchrun::cli

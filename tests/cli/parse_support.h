#pragma once
// parse_command_line as the launcher calls it, for the command-line tests:
// argv[0] is prepended and CTORCHRUN_PYTHON defaults to Debian's torch.

#include <map>
#include <string>
#include <vector>

#include "cli/command_line.h"

namespace ctorchrun::testing {

inline cli::ParseOutcome parse(std::vector<std::string> args,
                               std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "ctorchrun");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  if (!env.count("CTORCHRUN_PYTHON")) env["CTORCHRUN_PYTHON"] = "/usr/bin/python3";
  return cli::parse_command_line(static_cast<int>(argv.size()), argv.data(), env);
}

}  // namespace ctorchrun::testing

#pragma once

// torchrun's command line, parsed into a LaunchConfig.

#include <map>
#include <string>
#include <vector>

#include "agent/launch_config.h"

namespace ctorchrun::cli {

struct ParseOutcome {
  enum class Kind { kRun, kExit } kind = Kind::kRun;
  agent::LaunchConfig config;
  int exit_code = 0;                  // kExit: 0 after --help/--version, 2 after a usage error
  std::string message;                // kExit: what to print (help text, or the one-line error)
  std::vector<std::string> notices;   // kRun: one-time notices (torchrun's OMP_NUM_THREADS one)
  std::vector<std::string> warnings;  // kRun: one line each, to log (unknown --rdzv_conf keys)
  std::vector<std::string> infos;     // kRun: one line each, to log at info (what Slurm gave)
};

// Parses argv as torchrun does (cli/option_parser.h reads it through the
// option table of cli/option_table.h) and decides what the values mean: the
// membership, the rendezvous backend and its endpoint, --rdzv_conf (checked
// against the table in cli/rdzv_conf.h), what Slurm gives, the program and
// the workers' environment. `env` is the launcher's environment (an empty
// PET_ variable counts as unset). Never throws for bad input: a usage error
// is a kExit outcome with code 2 and a one-line message.
ParseOutcome parse_command_line(int argc, const char* const* argv,
                                const std::map<std::string, std::string>& env);

// Number of GPUs visible on this machine, counted without linking CUDA
// (CUDA_VISIBLE_DEVICES narrows it, as CUDA does).
int count_gpus(const std::map<std::string, std::string>& env);

}  // namespace ctorchrun::cli

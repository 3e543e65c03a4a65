#pragma once

// /proc/<pid>/stat read totally: the fields after the command name (which may
// hold spaces and parentheses), never an exception. The base of the agent's
// and the workers' views of a process's state.

#include <sys/types.h>

#include <optional>
#include <string>

namespace ctorchrun::worker {

struct ProcStat {
  char state = '?';  // R, S, D, Z, T, t, X, I...
  pid_t ppid = 0;
  pid_t pgrp = 0;
  pid_t session = 0;
  unsigned long long utime = 0;  // clock ticks
  unsigned long long stime = 0;
  unsigned long long starttime = 0;
};

// Parses the text of a stat file; nullopt for anything else.
std::optional<ProcStat> parse_stat(const std::string& text);

// `proc_root`/<pid>/stat, parsed; nullopt when the process is gone or the
// file unreadable.
std::optional<ProcStat> read_stat(pid_t pid, const std::string& proc_root = "/proc");

}  // namespace ctorchrun::worker

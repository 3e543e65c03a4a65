#pragma once

// One place that reads a process's state from /proc and signals it through a
// pidfd: /proc/<pid>/stat parsed totally (the command name may hold spaces
// and parentheses), never an exception, and the pidfd system calls where the
// C library has no wrappers. Used by the launcher, the agent and the
// collectives alike.

#include <sys/types.h>

#include <optional>
#include <string>

namespace ctorchrun::procfs {

struct Stat {
  char state = '?';  // R, S, D, Z, T, t, X, I...
  pid_t ppid = 0;
  pid_t pgrp = 0;
  pid_t session = 0;
  unsigned long long utime = 0;  // clock ticks of the process
  unsigned long long stime = 0;
  unsigned long long cutime = 0;  // of its reaped children
  unsigned long long cstime = 0;
  unsigned long long starttime = 0;  // 0 when the line ends before it
};

// Parses the text of a stat file, which must reach the cstime field (the
// 17th); nullopt for anything else.
std::optional<Stat> parse_stat(const std::string& text);

// `proc_root`/<pid>/stat, parsed; nullopt when the process is gone or the
// file unreadable.
std::optional<Stat> read_stat(pid_t pid, const std::string& proc_root = "/proc");

// Alive and not a zombie (an exited child not yet reaped stays a zombie).
bool running(pid_t pid, const std::string& proc_root = "/proc");

// pidfd_open(2) and pidfd_send_signal(2): -1 with errno (ENOSYS where the
// kernel or the headers lack them).
int pidfd_open(pid_t pid);
int pidfd_send_signal(int pidfd, int sig);

}  // namespace ctorchrun::procfs

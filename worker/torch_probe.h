#pragma once

// Which torch a worker's Python would import, learned without importing it:
// the agent sets the environment variables that torch version reads (torch
// 2.2 deprecated NCCL_ASYNC_ERROR_HANDLING and warns on every NCCL rank when
// it is set; torch 1.13 reads only that name).

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <utility>

namespace ctorchrun::worker {

// Runs `python -c "...importlib.metadata.version('torch')"` (the installed
// package's metadata, read in about 50 ms; importing torch takes seconds)
// with `env` as its whole environment (its PATH finds `python` when that is a
// bare name), stdin and stderr on /dev/null. Returns the version text
// ("2.6.0+debian"), or nullopt when Python does not start, has no torch, or
// has not answered within `timeout` (it is then killed). Blocks at most
// `timeout` plus the time to reap a killed process. Never throws for what
// the child does; thread-safe (the child is reaped by pid, never by
// waitpid(-1), and stays in this process's session).
std::optional<std::string> installed_torch_version(const std::string& python,
                                                   const std::map<std::string, std::string>& env,
                                                   std::chrono::milliseconds timeout);

// {major, minor} of a version text ("1.13.0a0+gitunknown" -> {1, 13});
// nullopt when it does not start with two dot-separated numbers.
std::optional<std::pair<int, int>> major_minor(const std::string& version);

// The folder holding the ctorch package (its ctorch/__init__.py) that was
// built or installed with the launcher at `launcher` (the path of the
// running ctorchrun): <bin>/../python in a build tree, else
// <bin>/../lib/ctorchrun/python once installed; nullopt when neither has it.
std::optional<std::string> ctorch_package_dir(const std::string& launcher);

}  // namespace ctorchrun::worker

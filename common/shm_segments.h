#pragma once

// The names of libctorch_dist's shared-memory segments, shared with the
// agent that cleans up after its workers: "ctdist.<pid namespace>.<creator
// pid>.<job>.<group>.<random>" in /dev/shm (or $CTORCHRUN_DIST_SHM_DIR). A
// creator's pid means something only within its pid namespace, so the name
// carries both.

#include <sys/types.h>

#include <string>
#include <vector>

namespace ctorchrun::shm_segments {

inline constexpr const char* kPrefix = "ctdist.";

// This process's pid namespace ("4026531836" of "pid:[4026531836]"; "0" when
// unreadable).
std::string pid_namespace();

// "ctdist.<this pid namespace>.<pid>.": how the names of `pid`'s segments start.
std::string prefix_of(pid_t pid);

// The folder of the segments: `shm_dir_setting` (CTORCHRUN_DIST_SHM_DIR's
// value) or /dev/shm.
std::string folder(const std::string& shm_dir_setting);

// Removes from `dir` the segments the processes `pids` (of this pid
// namespace) created, and nothing else; the number removed.
int remove_created_by(const std::vector<pid_t>& pids, const std::string& dir);

}  // namespace ctorchrun::shm_segments

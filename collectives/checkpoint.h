#pragma once

// Checkpoint helpers: "restart from the last checkpoint" in a few lines.
//
//   dist::save_checkpoint(dir, epoch, bytes, /*keep_last=*/3);   // rank 0
//   if (auto ckpt = dist::load_latest_checkpoint(dir)) resume(ckpt->step, ckpt->payload);
//
// Files are DIR/ckpt-<step, 12 digits>.ctckpt, laid out as
//   "CTCKPT01" | step (int64 LE) | payload size (uint64 LE) | payload |
//   SHA-256 of everything before it (32 bytes)
// A file is valid when it is complete, its checksum matches and its header
// names the step its file name does. Invalid files (torn, truncated,
// corrupted by a disk, a copy or a user) are skipped, never loaded.
//
// Durability contract. A save creates the missing directories of DIR, each
// followed by an fsync of its parent; writes DIR/.tmp-<pid>-<host>-<name>,
// fsyncs it, renames it to its final name and fsyncs DIR; only then prunes.
//   - Once save_checkpoint has returned, the checkpoint survives a process
//     crash, a kernel crash and a power loss.
//   - A crash of the process, of the kernel or of the power during a save
//     leaves the checkpoints the directory held before, or the new one
//     (complete and valid) with them: never neither, and never a partial
//     file under a checkpoint name. Pruning starts once the new one is
//     durable, so a crash during it leaves the new one and at least keep_last
//     valid ones; after a power loss, files it had removed may come back
//     (they are valid; the next save prunes them again).
//   - It may leave a partial temporary file; the next save_checkpoint or
//     load_latest_checkpoint on the same host removes it once the process
//     that wrote it is dead and no one holds its flock (files of other hosts
//     are theirs to remove: DIR may be on a shared file system; names without
//     a host, from older versions, are left alone).
//   - What it rests on: storage that honours fsync (no volatile write cache
//     that acknowledges a flush it has not done) and a file system on which a
//     rename is atomic. Damage done after the fact (a failing disk) is not
//     prevented, only detected: such a file fails its checksum and is skipped.
//
// Pruning (keep_last > 0): after the new checkpoint is durable, the save keeps
// the keep_last valid checkpoints of highest step, and always the one it just
// wrote, and removes the other valid ones. It never removes an invalid file
// (look at it, or remove it yourself) and never counts one, so when keep_last
// valid checkpoints existed they still do. Each file is read to verify it
// about once per process and version of the file, not at every save.
//
// Writers: one process per directory. The first save to DIR takes an flock
// on DIR/.ctckpt-lock and keeps it until the process exits or calls
// release_checkpoint_lock(DIR); a save from another process meanwhile throws
// InvalidArgument (a ConfigError) naming the holder (host and pid); a forked child is another
// process. Readers take no lock. Saves within one process are serialized;
// loads may run from any thread.
//
// Throws IoError when a file cannot be written, synced or renamed.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorchrun::dist {

struct Checkpoint {
  int64_t step = 0;
  std::string payload;
  std::string path;
};

// What a load into the caller's buffer read.
struct CheckpointInfo {
  int64_t step = 0;
  uint64_t size = 0;  // payload bytes written to the buffer
  std::string path;
};

// The final path of the checkpoint of `step` in `dir`.
std::string checkpoint_path(const std::string& dir, int64_t step);

// Saves durably (creating `dir` and its missing parents), then prunes when
// keep_last > 0 (see above). Returns the path written.
std::string save_checkpoint(const std::string& dir, int64_t step, std::string_view payload,
                            int keep_last = 0);

// Reads and verifies one file; nullopt (and `why`, when given, says what is
// wrong) if it is missing, truncated, torn or corrupted. The checksum is
// verified while reading: memory use is the payload and a 1 MiB buffer.
std::optional<Checkpoint> load_checkpoint(const std::string& path, std::string* why = nullptr);

// The same, reading the payload straight into `buffer` (`capacity` bytes);
// a payload larger than `capacity` is rejected before anything is read. On
// nullopt the buffer may hold part of the rejected file.
std::optional<CheckpointInfo> load_checkpoint(const std::string& path, void* buffer,
                                              size_t capacity, std::string* why = nullptr);

// The steps of the checkpoint files in `dir`, ascending, valid or not.
std::vector<int64_t> list_checkpoints(const std::string& dir);

// The valid checkpoint of highest step, skipping (with a warning on the
// "coll" logger) every invalid one; nullopt if there is none. Removes this
// host's temporary files of saves whose process is dead.
std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir);

// The same into the caller's buffer, as load_checkpoint(path, buffer, ...).
std::optional<CheckpointInfo> load_latest_checkpoint(const std::string& dir, void* buffer,
                                                     size_t capacity);

// Gives up this process's writer lock on `dir` (taken by its first save), so
// that another process may write there. A save here takes it again.
void release_checkpoint_lock(const std::string& dir);

// ---- For tests only; not a stable API. ----
namespace detail {
// Called by save_checkpoint after each step that changes the file system,
// with the path it touched: "mkdir", "fsync-dir", "create", "write" (each
// write call), "fsync", "rename", "close", "unlink" (pruning). A test records
// the sequence, or ends the process there to simulate a crash. nullptr: none.
using CheckpointEventHook = void (*)(const char* event, const std::string& path);
void set_checkpoint_event_hook(CheckpointEventHook hook);
}  // namespace detail

}  // namespace ctorchrun::dist

#include "collectives/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "collectives/sha256.h"
#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::dist {
namespace {

constexpr char kMagic[8] = {'C', 'T', 'C', 'K', 'P', 'T', '0', '1'};
constexpr size_t kHeader = 24;
constexpr size_t kTrailer = 32;
constexpr size_t kChunk = size_t{1} << 20;
constexpr const char* kNamePrefix = "ckpt-";
constexpr const char* kNameSuffix = ".ctckpt";
constexpr const char* kTempPrefix = ".tmp-";
constexpr const char* kLockName = ".ctckpt-lock";

std::atomic<detail::CheckpointEventHook> g_hook{nullptr};

void event(const char* what, const std::string& path) {
  if (auto hook = g_hook.load()) hook(what, path);
}

// A file's identity and version: a file verified once needs no second read
// while these stay the same.
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileId& o) const {
    return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns &&
           ctime_ns == o.ctime_ns;
  }
};

std::mutex g_save_mutex;   // one save at a time in this process
std::mutex g_state_mutex;  // guards the three below
// A writer lock: the flocked lock file, and the process that took it (a
// forked child inherits the entry and the descriptor, but not the right to
// write: it is another process).
struct HeldLock {
  int fd = -1;
  pid_t owner = 0;
};
// Directory (device, inode) -> the writer lock this process holds on it.
std::map<std::pair<dev_t, ino_t>, HeldLock> g_locks;
// Names of the temporary files this process's save is writing.
std::set<std::string> g_writing;
// A checkpoint file known valid: its identity when verified, its step, and
// when (wall clock, ns) it was verified.
struct Verified {
  FileId id;
  int64_t step = 0;
  int64_t at_ns = 0;
};
std::map<std::string, Verified> g_verified;

int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// File times are coarse (a clock tick): a file rewritten in place within the
// tick of its verification keeps its identity. As git does for its index, a
// verification is trusted only when the file's mtime was well before it.
constexpr int64_t kRacyNs = int64_t{2} * 1000000000;

void remember_valid(const std::string& path, const FileId& id, int64_t step) {
  std::lock_guard<std::mutex> lock(g_state_mutex);
  g_verified[path] = Verified{id, step, now_ns()};
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw IoError("checkpoint: " + what + " '" + path + "' failed: " + std::strerror(errno));
}

void put_u64(std::string* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t get_u64(const char* in) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  }
  return value;
}

std::optional<FileId> file_id(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  FileId id;
  id.dev = st.st_dev;
  id.ino = st.st_ino;
  id.size = st.st_size;
  id.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  id.ctime_ns = int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  return id;
}

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail("write of", path);
    }
    data += n;
    size -= static_cast<size_t>(n);
    event("write", path);
  }
}

// Reads up to `size` bytes; fewer only at the end of the file; -1 on error.
ssize_t read_full(int fd, char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::read(fd, data + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_fail("open for fsync of", path);
  if (::fsync(fd) != 0) {
    ::close(fd);
    io_fail("fsync of", path);
  }
  ::close(fd);
  event("fsync-dir", path);
}

// "a/b/c" -> "a/b", "a" -> ".", "/a" -> "/".
std::string parent_of(const std::string& path) {
  const size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  const size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  const size_t parent_end = path.find_last_not_of('/', slash);
  if (parent_end == std::string::npos) return "/";
  return path.substr(0, parent_end + 1);
}

// mkdir -p, each new directory made durable by an fsync of its parent.
void make_dirs(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return;
    errno = ENOTDIR;
    io_fail("mkdir of", dir);
  }
  if (errno != ENOENT) io_fail("stat of", dir);
  const std::string parent = parent_of(dir);
  if (parent != dir) make_dirs(parent);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) io_fail("mkdir of", dir);
  event("mkdir", dir);
  fsync_dir(parent);
}

std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = kNamePrefix;
  const std::string suffix = kNameSuffix;
  if (name.size() <= prefix.size() + suffix.size()) return std::nullopt;
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return std::nullopt;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(digits);
}

// This host's name as it appears in temporary file names: characters other
// than letters, digits, '.', '-' and '_' become '_'.
const std::string& host_name() {
  static const std::string name = [] {
    char buffer[256] = {};
    if (::gethostname(buffer, sizeof buffer - 1) != 0 || buffer[0] == '\0') {
      return std::string("unknown-host");
    }
    std::string out = buffer;
    for (char& c : out) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '-' || c == '_';
      if (!ok) c = '_';
    }
    return out;
  }();
  return name;
}

// The pid and host of a temporary file name .tmp-<pid>-<host>-ckpt-<step>.ctckpt;
// the host is empty for the names of older versions (.tmp-<pid>-ckpt-...).
std::optional<std::pair<long, std::string>> temp_owner(const std::string& name) {
  const std::string prefix = kTempPrefix;
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  size_t at = prefix.size();
  const size_t digits_end = name.find_first_not_of("0123456789", at);
  if (digits_end == std::string::npos || digits_end == at || digits_end - at > 9 ||
      name[digits_end] != '-') {
    return std::nullopt;
  }
  const long pid = std::stol(name.substr(at, digits_end - at));
  const size_t tail = name.rfind(std::string("-") + kNamePrefix);
  if (tail == std::string::npos || tail < digits_end || !step_of(name.substr(tail + 1))) {
    return std::nullopt;
  }
  if (tail == digits_end) return std::make_pair(pid, std::string());
  return std::make_pair(pid, name.substr(digits_end + 1, tail - digits_end - 1));
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// Removes the temporary files in `dir` that this host's saves left when they
// died: the host is ours, the pid is not alive (or is ours, and not saving),
// and nobody holds the file's flock (a writer does while it writes).
void sweep_temps(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    auto owner = temp_owner(name);
    if (!owner || owner->second != host_name()) continue;
    {
      std::lock_guard<std::mutex> lock(g_state_mutex);
      if (g_writing.count(name) != 0) continue;
    }
    if (owner->first != static_cast<long>(::getpid()) && process_alive(owner->first)) continue;
    stale.push_back(dir + "/" + name);
  }
  ::closedir(d);
  for (const auto& path : stale) {
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::unlink(path.c_str()) == 0) {
      get_logger("coll")->info("removed {}, left by a save that died", path);
    }
    ::close(fd);
  }
}

// Takes this process's writer lock on `dir` unless it holds it already;
// true when it took it now. Throws ConfigError when another process holds it.
bool hold_writer_lock(const std::string& dir) {
  struct stat dir_stat {};
  if (::stat(dir.c_str(), &dir_stat) != 0) io_fail("stat of", dir);
  const auto key = std::make_pair(dir_stat.st_dev, dir_stat.st_ino);
  std::lock_guard<std::mutex> lock(g_state_mutex);
  // Forget the locks of directories removed since (their lock file is gone)
  // and those a parent process took (closing our copy of the descriptor
  // leaves the parent's lock alone).
  for (auto it = g_locks.begin(); it != g_locks.end();) {
    struct stat st {};
    if (it->second.owner != ::getpid() || ::fstat(it->second.fd, &st) != 0 || st.st_nlink == 0) {
      ::close(it->second.fd);
      it = g_locks.erase(it);
    } else {
      ++it;
    }
  }
  if (g_locks.count(key) != 0) return false;
  const std::string path = dir + "/" + kLockName;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  // Another user's lock file: a read-only descriptor locks it too (locally).
  if (fd < 0 && errno == EACCES) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) io_fail("create of", path);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      char buffer[512];
      ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
      ::close(fd);
      std::string holder = n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      if (holder.empty()) holder = "a process that has not written its name yet";
      throw InvalidArgument("checkpoint: another process writes '" + dir + "' (" + holder +
                            ", holding the flock on " + path +
                            "); one process may write a checkpoint directory");
    }
    get_logger("coll")->warn(
        "checkpoint: cannot flock {} ({}): a second writer of {} would go undetected", path,
        std::strerror(errno), dir);
  }
  const std::string me = "host " + host_name() + " pid " + std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    get_logger("coll")->warn("checkpoint: cannot write the holder into {}: {}", path,
                             std::strerror(errno));
  }
  g_locks[key] = HeldLock{fd, ::getpid()};
  return true;
}

struct Header {
  int64_t step = 0;
  uint64_t size = 0;
};

// Says where the payload of `size` bytes goes; false rejects the file.
using Placer = std::function<bool(uint64_t size, char** dest)>;

// Reads `path` and verifies it while streaming: the payload goes where
// `place` says, 1 MiB at a time, or, with no `place`, is only hashed.
std::optional<Header> read_checked(const std::string& path, std::string* why, const Placer& place) {
  auto reject = [&](const std::string& reason) -> std::optional<Header> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return reject(std::string("cannot open: ") + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return reject(std::string("cannot stat: ") + std::strerror(errno));
  const uint64_t file_size = st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;
  if (file_size < kHeader + kTrailer) {
    return reject("truncated: " + std::to_string(file_size) + " bytes");
  }
  char header[kHeader];
  ssize_t n = read_full(fd, header, kHeader);
  if (n < 0) return reject(std::string("read failed: ") + std::strerror(errno));
  if (static_cast<size_t>(n) < kHeader) return reject("truncated while being read");
  if (std::memcmp(header, kMagic, sizeof kMagic) != 0) return reject("bad magic");
  const uint64_t size = get_u64(header + 16);
  if (size != file_size - kHeader - kTrailer) {
    return reject("truncated or torn: the header promises " + std::to_string(size) +
                  " payload bytes, the file holds " +
                  std::to_string(file_size - kHeader - kTrailer));
  }
  char* dest = nullptr;
  std::vector<char> scratch;
  if (place) {
    if (!place(size, &dest)) return std::nullopt;
  } else {
    scratch.resize(static_cast<size_t>(std::min<uint64_t>(size, kChunk)));
  }
  Sha256 hash;
  hash.update(header, kHeader);
  for (uint64_t done = 0; done < size;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kChunk, size - done));
    char* at = place ? dest + done : scratch.data();
    n = read_full(fd, at, want);
    if (n < 0) return reject(std::string("read failed: ") + std::strerror(errno));
    if (static_cast<size_t>(n) < want) return reject("truncated while being read");
    hash.update(at, want);
    done += want;
  }
  unsigned char trailer[kTrailer];
  n = read_full(fd, reinterpret_cast<char*>(trailer), kTrailer);
  if (n < 0) return reject(std::string("read failed: ") + std::strerror(errno));
  if (static_cast<size_t>(n) < kTrailer) return reject("truncated while being read");
  const auto digest = hash.finish();
  if (std::memcmp(digest.data(), trailer, kTrailer) != 0) {
    return reject("checksum mismatch (corrupted)");
  }
  return Header{static_cast<int64_t>(get_u64(header + 8)), size};
}

// Whether `path` is a valid checkpoint of `step`; read about once per
// version of the file (see kRacyNs).
bool is_valid(const std::string& path, int64_t step) {
  const auto id = file_id(path);
  if (!id) return false;
  {
    std::lock_guard<std::mutex> lock(g_state_mutex);
    auto it = g_verified.find(path);
    if (it != g_verified.end() && it->second.id == *id && it->second.step == step &&
        id->mtime_ns + kRacyNs < it->second.at_ns) {
      return true;
    }
  }
  auto header = read_checked(path, nullptr, {});
  if (!header || header->step != step) return false;
  if (file_id(path) == id) remember_valid(path, *id, step);
  return true;
}

// Keeps the keep_last valid checkpoints of highest step and `written`;
// removes the other valid ones, never an invalid one.
void prune(const std::string& dir, int64_t written, int keep_last) {
  auto steps = list_checkpoints(dir);
  int kept = 0;
  bool removed = false;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string path = checkpoint_path(dir, *it);
    if (*it == written) {
      ++kept;
      continue;
    }
    if (!is_valid(path, *it)) continue;
    if (kept < keep_last) {
      ++kept;
      continue;
    }
    if (::unlink(path.c_str()) != 0) {
      // The new checkpoint is in place: a file left over is no reason to fail.
      if (errno != ENOENT) {
        get_logger("coll")->warn("checkpoint: cannot remove {}: {}", path, std::strerror(errno));
      }
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(g_state_mutex);
      g_verified.erase(path);
    }
    event("unlink", path);
    removed = true;
  }
  if (removed) fsync_dir(dir);
}

template <typename Result, typename Load>
std::optional<Result> load_latest(const std::string& dir, const Load& load) {
  sweep_temps(dir);
  auto steps = list_checkpoints(dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string path = checkpoint_path(dir, *it);
    std::string why;
    std::optional<Result> loaded = load(path, &why);
    if (loaded && loaded->step == *it) return loaded;
    if (loaded) why = "its header says step " + std::to_string(loaded->step);
    get_logger("coll")->warn("skipping checkpoint {}: {}", path, why);
  }
  return std::nullopt;
}

}  // namespace

namespace detail {
void set_checkpoint_event_hook(CheckpointEventHook hook) { g_hook.store(hook); }
}  // namespace detail

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%012lld", static_cast<long long>(step));
  return dir + "/" + kNamePrefix + digits + kNameSuffix;
}

std::string save_checkpoint(const std::string& dir, int64_t step, std::string_view payload,
                            int keep_last) {
  if (step < 0) throw ConfigError("checkpoint: the step must not be negative");
  std::lock_guard<std::mutex> saving(g_save_mutex);
  make_dirs(dir);
  // This process's first save here: whoever created `dir`, its entry is made
  // durable before a checkpoint is put in it.
  if (hold_writer_lock(dir)) {
    try {
      fsync_dir(parent_of(dir));
    } catch (const IoError& e) {  // a parent we may not read: durable if we made it
      get_logger("coll")->warn("{}", e.what());
    }
  }
  sweep_temps(dir);

  std::string header(kMagic, sizeof kMagic);
  put_u64(&header, static_cast<uint64_t>(step));
  put_u64(&header, payload.size());
  Sha256 hash;
  hash.update(header);
  hash.update(payload);
  const auto digest = hash.finish();

  const std::string final_path = checkpoint_path(dir, step);
  const std::string temp_name = kTempPrefix + std::to_string(::getpid()) + "-" + host_name() + "-" +
                                final_path.substr(dir.size() + 1);
  const std::string temp_path = dir + "/" + temp_name;
  {
    std::lock_guard<std::mutex> lock(g_state_mutex);
    g_writing.insert(temp_name);
  }
  struct Unmark {
    const std::string& name;
    ~Unmark() {
      std::lock_guard<std::mutex> lock(g_state_mutex);
      g_writing.erase(name);
    }
  } unmark{temp_name};

  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_fail("create of", temp_path);
  // Held until the file has its final name: a sweeper that can take it knows
  // no one is writing the file.
  (void)::flock(fd, LOCK_EX | LOCK_NB);
  event("create", temp_path);
  try {
    write_all(fd, header.data(), header.size(), temp_path);
    write_all(fd, payload.data(), payload.size(), temp_path);
    write_all(fd, reinterpret_cast<const char*>(digest.data()), digest.size(), temp_path);
    if (::fsync(fd) != 0) io_fail("fsync of", temp_path);
    event("fsync", temp_path);
    if (::rename(temp_path.c_str(), final_path.c_str()) != 0) io_fail("rename into", final_path);
    event("rename", final_path);
  } catch (...) {
    ::close(fd);
    ::unlink(temp_path.c_str());
    throw;
  }
  ::close(fd);  // the data is synced: close has nothing left to report
  event("close", final_path);
  fsync_dir(dir);
  if (auto id = file_id(final_path)) remember_valid(final_path, *id, step);
  if (keep_last > 0) prune(dir, step, keep_last);
  return final_path;
}

std::optional<Checkpoint> load_checkpoint(const std::string& path, std::string* why) {
  Checkpoint out;
  auto header = read_checked(path, why, [&](uint64_t size, char** dest) {
    out.payload.resize(static_cast<size_t>(size));
    *dest = out.payload.data();
    return true;
  });
  if (!header) return std::nullopt;
  out.step = header->step;
  out.path = path;
  return out;
}

std::optional<CheckpointInfo> load_checkpoint(const std::string& path, void* buffer,
                                              size_t capacity, std::string* why) {
  auto header = read_checked(path, why, [&](uint64_t size, char** dest) {
    if (size > capacity) {
      if (why != nullptr) {
        *why = "the payload of " + std::to_string(size) + " bytes does not fit the buffer of " +
               std::to_string(capacity);
      }
      return false;
    }
    *dest = static_cast<char*>(buffer);
    return true;
  });
  if (!header) return std::nullopt;
  CheckpointInfo info;
  info.step = header->step;
  info.size = header->size;
  info.path = path;
  return info;
}

std::vector<int64_t> list_checkpoints(const std::string& dir) {
  std::vector<int64_t> steps;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return steps;
  while (dirent* entry = ::readdir(d)) {
    if (auto step = step_of(entry->d_name)) steps.push_back(*step);
  }
  ::closedir(d);
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir) {
  return load_latest<Checkpoint>(
      dir, [](const std::string& path, std::string* why) { return load_checkpoint(path, why); });
}

std::optional<CheckpointInfo> load_latest_checkpoint(const std::string& dir, void* buffer,
                                                     size_t capacity) {
  return load_latest<CheckpointInfo>(dir, [&](const std::string& path, std::string* why) {
    return load_checkpoint(path, buffer, capacity, why);
  });
}

void release_checkpoint_lock(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return;
  std::lock_guard<std::mutex> lock(g_state_mutex);
  auto it = g_locks.find(std::make_pair(st.st_dev, st.st_ino));
  if (it == g_locks.end()) return;
  if (it->second.owner == ::getpid()) (void)::ftruncate(it->second.fd, 0);
  ::close(it->second.fd);
  g_locks.erase(it);
}

}  // namespace ctorchrun::dist

#include "collectives/shm_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "collectives/call_signature.h"
#include "collectives/gloo_backend.h"
#include "collectives/hier_backend.h"
#include "collectives/op_queue.h"
#include "collectives/reduce_kernels.h"
#include "common/error.h"
#include "common/log.h"
#include "common/procfs.h"
#include "common/shm_segments.h"

namespace ctorchrun::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kNamePrefix = shm_segments::kPrefix;  // the agent removes them too
constexpr uint32_t kMagic = 0x4d485343;                     // "CSHM"
constexpr size_t kPage = 4096;
// 1 MiB: a rank's share of a chunk and its reduction stay in a core's L2
// (2.2-2.7x the busbw of 4 MiB chunks from 2 to 16 MiB at two ranks on the
// benchmark VM, quiet; bench/RESULTS.md).
constexpr size_t kDefaultChunk = size_t{1} << 20;
// A hierarchical all_reduce's piece: each is one gloo call between hosts.
constexpr size_t kDefaultPiece = size_t{4} << 20;
constexpr size_t kMinChunk = size_t{64} << 10;
constexpr size_t kDefaultSegment = size_t{32} << 20;  // fits Docker's default /dev/shm (64 MiB)
constexpr milliseconds kSlice{50};  // futex sleep, and so failure detection, granularity
// reduce_by_cma reads a peer's share in pieces of this size: three stay in L2.
constexpr size_t kCmaPiece = size_t{256} << 10;

std::string env_text(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

// `text` as a decimal count of at most 15 digits (no sign, no spaces);
// nullopt when it is anything else. std::stoull alone takes " 5" and "-1".
std::optional<size_t> decimal_count(const std::string& text) {
  if (text.empty() || text.size() > 15 ||
      text.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return static_cast<size_t>(std::stoull(text));
}

// A size setting `name` in whole pages, when set; ConfigError when it is not
// a byte count from 64 KiB to 64 MiB.
std::optional<size_t> page_bytes_setting(const char* name) {
  const std::string text = env_text(name);
  if (text.empty()) return std::nullopt;
  const auto value = decimal_count(text);
  if (!value || *value < kMinChunk || *value > (64u << 20)) {
    throw ConfigError(std::string(name) + "='" + text +
                      "' must be a byte count from 65536 to 67108864");
  }
  return *value / kPage * kPage;
}

// The segment's chunk (CTORCHRUN_DIST_SHM_CHUNK), when set.
std::optional<size_t> chunk_setting() { return page_bytes_setting("CTORCHRUN_DIST_SHM_CHUNK"); }

// Bytes of one rank's buffer (two per rank): CTORCHRUN_DIST_SHM_CHUNK, else
// kDefaultChunk, less when `ranks` would make the segment larger than
// 32 MiB.
size_t chunk_bytes(int ranks) {
  if (auto set = chunk_setting()) return *set;
  const size_t fit = kDefaultSegment / (2 * static_cast<size_t>(ranks)) / kPage * kPage;
  return std::max(kMinChunk, std::min(kDefaultChunk, fit));
}

// What a rank tells its group at set-up, one line and its cma_probe():
// "<1|0> <piece> <identity>\n<probe>". Parsed totally: a malformed view
// reads as a rank that wants no shared memory (every rank parses the same
// views, so all decide alike).
struct HostView {
  bool shm = false;      // this rank wants shared memory
  size_t piece = 0;      // its hierarchical all_reduce piece (rank 0's holds)
  std::string identity;  // its host_identity()
  std::string probe = "nocma malformed set-up record";
};

std::string format_view(bool shm, size_t piece, const std::string& identity,
                        const std::string& probe) {
  return std::string(shm ? "1 " : "0 ") + std::to_string(piece) + " " + identity + "\n" + probe;
}

HostView parse_view(const std::string& text) {
  HostView view;
  const size_t end = text.find('\n');
  const std::string line = text.substr(0, end);
  const size_t space = line.find(' ', 2);
  if (line.size() < 2 || (line[0] != '0' && line[0] != '1') || line[1] != ' ' ||
      space == std::string::npos) {
    return view;
  }
  const auto piece = decimal_count(line.substr(2, space - 2));
  if (!piece) return view;
  view.shm = line[0] == '1';
  view.piece = *piece;
  view.identity = line.substr(space + 1);
  if (end != std::string::npos) view.probe = text.substr(end + 1);
  return view;
}

// How long a waiting rank spins (and yields) before it sleeps on the futex:
// CTORCHRUN_DIST_SHM_SPIN_US, default 1000. A futex wake-up costs tens of
// microseconds on a loaded machine; a spinning peer answers in one.
// ConfigError unless it is a count of microseconds up to kMaxSpinUs: a
// longer spin only burns a core, and the spin ends at the call's deadline
// anyway.
constexpr size_t kMaxSpinUs = 100'000;
std::chrono::microseconds spin_time() {
  const std::string text = env_text("CTORCHRUN_DIST_SHM_SPIN_US");
  if (text.empty()) return std::chrono::microseconds(1000);
  const auto value = decimal_count(text);
  if (!value || *value > kMaxSpinUs) {
    throw ConfigError("CTORCHRUN_DIST_SHM_SPIN_US='" + text +
                      "' must be a count of microseconds from 0 to " + std::to_string(kMaxSpinUs));
  }
  return std::chrono::microseconds(static_cast<int64_t>(*value));
}

// CTORCHRUN_DIST_SHM_CMA: "1" lets a group of one host read its peers'
// buffers with process_vm_readv where it can, "0" (the default) keeps every
// byte in the segment.
bool cma_switch() {
  const std::string text = env_text("CTORCHRUN_DIST_SHM_CMA");
  if (text == "1") return true;
  if (text.empty() || text == "0") return false;
  throw ConfigError("CTORCHRUN_DIST_SHM_CMA='" + text + "' must be 0 (off) or 1 (on)");
}

// The sizes of all_reduce that go by cross-memory attach:
// CTORCHRUN_DIST_SHM_CMA_MIN and _MAX (bytes; rank 0's hold), else
// kShmCmaBytes and kShmCmaMaxBytes, or none in groups of more than
// kShmCmaRanks.
size_t cma_bytes(const char* name, size_t fallback) {
  const std::string text = env_text(name);
  if (text.empty()) return fallback;
  const auto value = decimal_count(text);
  if (!value) throw ConfigError(std::string(name) + "='" + text + "' must be a byte count");
  return *value;
}

std::atomic<uint64_t> g_cma_calls{0};

// A word of this process that peers read at set-up to learn whether
// process_vm_readv works between them: its address and value go out with
// the host exchange. Static, so a late reader never reads freed memory.
const uint64_t& probe_word() {
  static const uint64_t word = [] {
    std::random_device random;
    return (static_cast<uint64_t>(random()) << 32 | random()) | 1;
  }();
  return word;
}

// "cma <pid> <address> <value>" when this rank can be read, else
// "nocma <why>". Lets any process of this user attach first: with Yama's
// ptrace_scope 1 only ancestors could (EINVAL: no Yama, nothing to do).
std::string cma_probe(bool wanted) {
  if (!wanted) return "nocma off";
  static const int error = [] {
    return ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0 || errno == EINVAL ? 0 : errno;
  }();
  if (error != 0) return "nocma prctl(PR_SET_PTRACER): " + std::string(std::strerror(error));
  const uint64_t& word = probe_word();
  std::ostringstream text;
  text << "cma " << ::getpid() << " " << reinterpret_cast<uintptr_t>(&word) << " " << word;
  return text.str();
}

// Where segments live: /dev/shm (shm_open's), or CTORCHRUN_DIST_SHM_DIR
// (tests point it at a directory of their own).
std::string shm_dir() {
  std::string dir = env_text("CTORCHRUN_DIST_SHM_DIR");
  return dir.empty() ? "/dev/shm" : dir;
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Pids mean the same only within their namespace (common/shm_segments.h).
std::string pid_namespace() { return shm_segments::pid_namespace(); }

// Equal on two ranks when they can share a segment and each other's pids.
std::string host_identity(const std::string& dir) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  struct stat st {};
  const bool has_dir = ::stat(dir.c_str(), &st) == 0;
  return std::string(host) + "|" + first_line("/proc/sys/kernel/random/boot_id") + "|" +
         (has_dir ? std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) : "nodir") + "|" +
         pid_namespace();
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The job's name as it may appear in a file name.
std::string job_tag() {
  std::string tag;
  for (char c : env_text("TORCHELASTIC_RUN_ID")) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_';
    if (ok && tag.size() < 24) tag += c;
  }
  return tag.empty() ? "nojob" : tag;
}

std::string hex(uint64_t v, int digits) {
  static const char* k = "0123456789abcdef";
  std::string s(static_cast<size_t>(digits), '0');
  for (int i = digits - 1; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = k[v & 15];
  return s;
}

int open_segment(const std::string& dir, const std::string& name, int flags) {
  if (dir == "/dev/shm") return ::shm_open(("/" + name).c_str(), flags, 0600);
  return ::open((dir + "/" + name).c_str(), flags | O_CLOEXEC | O_NOFOLLOW, 0600);
}

void unlink_segment(const std::string& dir, const std::string& name) {
  if (dir == "/dev/shm") {
    ::shm_unlink(("/" + name).c_str());
  } else {
    ::unlink((dir + "/" + name).c_str());
  }
}

std::string errno_text(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, milliseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000) * 1000000L;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futex words are plain 32-bit integers");

// The segment's layout:
//   page 0:      Header
//   then:        RankControl[ranks] (each on cache lines of its own)
//   page-aligned: buffer(r, p) for rank r, parity p: 2 x ranks x chunk bytes
// A zero-filled segment is the initial state of every field but magic,
// ranks and chunk, which rank 0 writes before publishing the name.
struct Header {
  uint32_t magic;
  uint32_t ranks;
  uint64_t chunk;
  alignas(64) std::atomic<uint32_t> wake_seq;  // futex word: bumped when a sleeper may go on
  std::atomic<uint32_t> waiters;               // ranks in or going into futex_wait
  alignas(64) std::atomic<uint32_t> failed;    // 0, or 1 + the first rank whose op failed
};

struct RankControl {
  alignas(64) std::atomic<uint32_t> arrived;  // barriers this rank has entered
  alignas(64) std::atomic<uint32_t> closed;   // the rank destroyed its group
  detail::Signature sig[2];                   // its current call, by parity
  // Its output buffer (address in its process, bytes) during an all_reduce
  // by cross-memory attach, written with the call's signature.
  uint64_t cma_address;
  uint64_t cma_bytes;
};

struct Layout {
  size_t control = 0;
  size_t data = 0;
  size_t total = 0;
  Layout(int ranks, size_t chunk) {
    control = kPage;
    const size_t end = control + static_cast<size_t>(ranks) * sizeof(RankControl);
    data = (end + kPage - 1) / kPage * kPage;
    total = data + 2 * static_cast<size_t>(ranks) * chunk;
  }
};

// A mapped segment; unmapped on destruction.
struct Mapping {
  uint8_t* base = nullptr;
  size_t size = 0;
  int ranks = 0;
  size_t chunk = 0;
  std::vector<int> pids;  // of every rank, from the set-up exchange
  bool cma = false;       // every rank can read every other's memory (process_vm_readv)
  size_t cma_min = 0;     // rank 0's kShmCmaBytes or CTORCHRUN_DIST_SHM_CMA_MIN
  size_t cma_max = 0;     // rank 0's kShmCmaMaxBytes or CTORCHRUN_DIST_SHM_CMA_MAX
  ~Mapping() {
    if (base != nullptr) ::munmap(base, size);
  }
};

std::unique_ptr<Mapping> map_segment(const std::string& dir, const std::string& name, int ranks,
                                     size_t chunk, bool create) {
  const Layout layout(ranks, chunk);
  const int fd = open_segment(dir, name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR);
  if (fd < 0) throw IoError(errno_text("cannot open " + dir + "/" + name, errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  if (create) {
    // Reserve the pages now: on a full tmpfs a plain ftruncate succeeds and
    // the first touch of a missing page is a SIGBUS.
    const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.total));
    if (error != 0) {
      throw IoError(errno_text(
          "cannot reserve " + std::to_string(layout.total) + " bytes for " + dir + "/" + name,
          error));
    }
  } else {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != layout.total) {
      throw IoError(dir + "/" + name + " does not have the size this rank expects (" +
                    std::to_string(layout.total) + " bytes); do all ranks run the same library?");
    }
  }
  void* base =
      ::mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) throw IoError(errno_text("cannot map " + dir + "/" + name, errno));
  auto mapping = std::make_unique<Mapping>();
  mapping->base = static_cast<uint8_t*>(base);
  mapping->size = layout.total;
  mapping->ranks = ranks;
  mapping->chunk = chunk;
  if (create) {
    auto* header = new (mapping->base) Header{};
    header->magic = kMagic;
    header->ranks = static_cast<uint32_t>(ranks);
    header->chunk = chunk;
    for (int r = 0; r < ranks; ++r) {
      new (mapping->base + layout.control + static_cast<size_t>(r) * sizeof(RankControl))
          RankControl{};
    }
  } else {
    const auto* header = reinterpret_cast<const Header*>(mapping->base);
    if (header->magic != kMagic || header->ranks != static_cast<uint32_t>(ranks) ||
        header->chunk != chunk) {
      throw IoError(dir + "/" + name + " is not this group's segment");
    }
  }
  return mapping;
}

// Logs `message` the first time `logged` is passed: what it reports is a
// property of the machine, not of one group.
void log_once(std::atomic<bool>& logged, spdlog::level::level_enum level,
              const std::string& message) {
  if (!logged.exchange(true)) get_logger("coll")->log(level, "{} (logged once)", message);
}

void warn_fallback_once(const std::string& why) {
  static std::atomic<bool> logged{false};
  log_once(
      logged, spdlog::level::warn,
      "shared-memory collectives unavailable, this process uses gloo over TCP instead: " + why);
}

std::vector<std::string> exchange(store::Store& store, const std::string& key, int rank, int size,
                                  const std::string& value, Clock::time_point deadline) {
  store.set(key + "/" + std::to_string(rank), value);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key + "/" + std::to_string(r));
  const auto left =
      std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(1));
  try {
    store.wait(keys, left);
  } catch (const TimeoutError&) {
    std::string missing;
    for (int r = 0; r < size; ++r) {
      if (!store.check({keys[static_cast<size_t>(r)]})) {
        missing += (missing.empty() ? "" : ",") + std::to_string(r);
      }
    }
    throw TimeoutError("shared-memory set-up of rank " + std::to_string(rank) + "/" +
                       std::to_string(size) + " timed out: rank(s) " + missing +
                       " never reached it (key " + key + ")");
  }
  return store.multi_get(keys);
}

// Whether this rank can read every peer's memory with process_vm_readv:
// "cma", else why not. `probes`: each rank's cma_probe(), from the host
// exchange. A peer that cannot be read says why in its own answer.
std::string cma_check(const std::vector<std::string>& probes, int rank) {
  const std::string& mine = probes[static_cast<size_t>(rank)];
  if (mine.rfind("cma ", 0) != 0) return mine.size() > 6 ? mine.substr(6) : "no probe";
  for (size_t r = 0; r < probes.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    std::istringstream in(probes[r]);
    std::string tag;
    long pid = 0;
    uintptr_t address = 0;
    uint64_t value = 0;
    if (!(in >> tag >> pid >> address >> value) || tag != "cma") continue;
    uint64_t got = 0;
    iovec local{&got, sizeof got};
    iovec remote{reinterpret_cast<void*>(address), sizeof got};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof got)) {
      return "process_vm_readv of rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
             ") failed: " + (n < 0 ? std::strerror(errno) : "short read");
    }
    if (got != value) {
      return "process_vm_readv of rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
             ") read another value than it published";
    }
  }
  return "cma";
}

// Logs once per process why a group of one host copies through the
// segment only; the segment path works, so it is no warning.
void info_no_cma_once(const std::string& why) {
  static std::atomic<bool> logged{false};
  log_once(logged, spdlog::level::info,
           "single-copy shared-memory all_reduce (cross-memory attach) unavailable, large "
           "all_reduce copies through the segment instead: " +
               why);
}

// Makes, maps and unlinks the group's segment (see the header). Returns
// null, with `why` set, when any rank cannot take part. `probes`: each
// rank's cma_probe(), from the host exchange; `cma_sizes`: this rank's
// "<min> <max>" of cma_bytes() (rank 0's hold).
std::unique_ptr<Mapping> set_up_segment(const BackendContext& context, const std::string& dir,
                                        Clock::time_point deadline, std::string& why,
                                        const std::vector<std::string>& probes,
                                        const std::string& cma_sizes) {
  store::Store& store = *context.store;
  const int rank = context.rank;
  const int size = context.size;
  size_t chunk = rank == 0 ? chunk_bytes(size) : 0;
  std::string name;
  std::unique_ptr<Mapping> mapping;
  std::string error;
  if (rank == 0) {
    sweep_stale_segments(dir);
    std::random_device random;
    name = std::string(kNamePrefix) + pid_namespace() + "." + std::to_string(::getpid()) + "." +
           job_tag() + "." + hex(fnv1a(context.group_key), 16) + "." + hex(random(), 8);
    // A tmpfs too full for the segment: halve the chunk down to 64 KiB.
    for (;;) {
      try {
        mapping = map_segment(dir, name, size, chunk, true);
        error.clear();
        break;
      } catch (const Error& e) {
        error = e.what();
        unlink_segment(dir, name);
      }
      if (chunk / 2 < kMinChunk) break;
      chunk = chunk / 2 / kPage * kPage;
    }
    store.set("shm/name", error.empty() ? std::to_string(chunk) + " " + name : "!" + error);
    if (!error.empty()) {
      why = "rank 0 could not create the segment: " + error;
      return nullptr;
    }
  } else {
    const auto left = std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()),
                               milliseconds(1));
    try {
      store.wait({"shm/name"}, left);
    } catch (const TimeoutError&) {
      throw TimeoutError("shared-memory set-up of rank " + std::to_string(rank) + "/" +
                         std::to_string(size) + " timed out waiting for rank 0's segment");
    }
    name = store.get("shm/name");
    if (!name.empty() && name[0] == '!') {
      why = "rank 0 could not create the segment: " + name.substr(1);
      return nullptr;
    }
    // "<chunk> <name>": rank 0's chunk size holds for every rank.
    const size_t space = name.find(' ');
    chunk = static_cast<size_t>(std::strtoull(name.c_str(), nullptr, 10));
    name = space == std::string::npos ? name : name.substr(space + 1);
    try {
      mapping = map_segment(dir, name, size, chunk, false);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  // Every rank says whether it mapped the segment, and whether it can read
  // its peers' memory (then "cma", else "-" and why not); then rank 0
  // unlinks it, whatever the answers, so that nothing outlives the set-up.
  std::vector<std::string> answers;
  try {
    std::string answer = "!" + error;
    if (error.empty()) {
      const std::string cma = cma_check(probes, rank);
      answer = "ok " + std::to_string(::getpid()) + " " + cma_sizes + " " +
               (cma == "cma" ? cma : "-" + cma);
    }
    answers = exchange(store, "shm/mapped", rank, size, answer, deadline);
  } catch (...) {
    if (rank == 0) unlink_segment(dir, name);
    throw;
  }
  if (rank == 0) unlink_segment(dir, name);
  for (int r = 0; r < size; ++r) {
    const std::string& a = answers[static_cast<size_t>(r)];
    if (a.rfind("ok ", 0) != 0) {
      why = "rank " + std::to_string(r) +
            " could not map the segment: " + (a.empty() ? a : a.substr(1));
      return nullptr;
    }
    std::istringstream in(a.substr(3));
    int pid = 0;
    size_t their_min = 0;
    size_t their_max = 0;
    in >> pid >> their_min >> their_max;
    std::string cma;
    std::getline(in >> std::ws, cma);
    mapping->pids.push_back(pid);
    if (r == 0) {
      mapping->cma = true;
      mapping->cma_min = their_min;
      mapping->cma_max = their_max;
    }
    if (cma != "cma" && mapping->cma) {
      mapping->cma = false;
      // Switched off on purpose: nothing to say.
      if (cma != "-off") info_no_cma_once("rank " + std::to_string(r) + ": " + cma.substr(1));
    }
  }
  return mapping;
}

class ShmBackend : public Backend {
 public:
  ShmBackend(const BackendContext& context, std::unique_ptr<Mapping> mapping,
             std::unique_ptr<Backend> gloo)
      : rank_(context.rank),
        size_(context.size),
        check_calls_(context.check_calls),
        mapping_(std::move(mapping)),
        gloo_(std::move(gloo)),
        chunk_(mapping_->chunk),
        layout_(size_, chunk_) {
    header_ = reinterpret_cast<Header*>(mapping_->base);
    for (int r = 0; r < size_; ++r) {
      const int pid = mapping_->pids[static_cast<size_t>(r)];
      int fd = -1;
      if (pid != ::getpid()) fd = procfs::pidfd_open(pid);
      pidfds_.push_back(fd);
    }
  }

  ~ShmBackend() override {
    queue_.stop();
    // Peers still waiting for this rank fail now instead of at their deadline.
    control(rank_).closed.store(1, std::memory_order_seq_cst);
    wake();
    for (int fd : pidfds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  std::string name() const override { return "gloo"; }
  std::string transport() const override { return "shm"; }

  WorkHandle run(const Op& op, bool async) override {
    if (op.type == OpType::kSend || op.type == OpType::kRecv) return gloo_->run(op, async);
    return queue_.run(op, async, describe(op, "shm", rank_, size_));
  }

 private:
  // What one op needs while it runs.
  struct Call {
    const Op& op;
    const std::string& what;
    detail::Signature sig;
    Clock::time_point deadline;
    bool checked = false;
  };

  void execute(const Op& op, uint32_t tag, const PromiseWork& work) {
    if (!broken_.empty()) {
      throw IoError(work.description() + " cannot run: " + broken_ +
                    "; this group is unusable, exit so the launcher can restart the job");
    }
    Call call{op, work.description(), detail::signature_of(op, tag), deadline_of(op)};
    try {
      switch (op.type) {
        case OpType::kAllReduce:
        case OpType::kReduce:
          reduce_all(call, op.type == OpType::kAllReduce);
          return;
        case OpType::kBroadcast:
          broadcast(call);
          return;
        case OpType::kAllGather:
          all_gather(call);
          return;
        case OpType::kReduceScatter:
          reduce_scatter(call);
          return;
        case OpType::kBarrier:
        case OpType::kGather:
        case OpType::kScatter:
        case OpType::kAllToAll:
          step(call, [](int) {});
          if (op.type != OpType::kBarrier) {
            Op rest = op;
            rest.deadline = call.deadline;  // one deadline for both steps
            gloo_->run(rest, false);
          }
          return;
        case OpType::kSend:
        case OpType::kRecv:
          break;
      }
    } catch (const InvalidArgument&) {
      throw;  // every rank saw the same calls: still in step, still usable
    } catch (const std::exception& e) {
      // Not only ours: a failed allocation leaves the peers out of step too.
      if (broken_.empty()) broken_ = e.what();
      fail_group();
      throw;
    }
    CTORCHRUN_CHECK(false, "shm backend: operation routed to the wrong path");
  }

  RankControl& control(int r) {
    return *reinterpret_cast<RankControl*>(mapping_->base + layout_.control +
                                           static_cast<size_t>(r) * sizeof(RankControl));
  }
  uint8_t* buffer(int r, int parity) {
    return mapping_->base + layout_.data + (static_cast<size_t>(r) * 2 + parity) * chunk_;
  }

  void wake() {
    header_->wake_seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&header_->wake_seq);
  }

  void fail_group() {
    uint32_t none = 0;
    header_->failed.compare_exchange_strong(none, static_cast<uint32_t>(rank_ + 1));
    wake();
  }

  bool peer_gone(int r) {
    if (control(r).closed.load(std::memory_order_seq_cst) != 0) return true;
    const int fd = pidfds_[static_cast<size_t>(r)];
    if (fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      return ::poll(&p, 1, 0) > 0;
    }
    const int pid = mapping_->pids[static_cast<size_t>(r)];
    return pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH;
  }

  std::string missing_ranks(uint32_t k) {
    std::string text;
    for (int r = 0; r < size_; ++r) {
      if (static_cast<int32_t>(control(r).arrived.load(std::memory_order_seq_cst) - k) < 0) {
        text += (text.empty() ? "" : ",") + std::to_string(r);
      }
    }
    return text;
  }

  // Enters barrier number ++barriers_ and waits until every rank has.
  void barrier(Call& call) {
    const uint32_t k = ++barriers_;
    control(rank_).arrived.store(k, std::memory_order_seq_cst);
    if (header_->waiters.load(std::memory_order_seq_cst) != 0) wake();
    auto all_in = [&] {
      for (int r = 0; r < size_; ++r) {
        if (static_cast<int32_t>(control(r).arrived.load(std::memory_order_seq_cst) - k) < 0) {
          return false;
        }
      }
      return true;
    };
    // Spin for spin_, then sleep. With more ranks than cores, yield every
    // few microseconds so that a peer sharing this core runs (Open MPI's
    // yield_when_idle when oversubscribed); otherwise a yield only hands
    // the core to unrelated work.
    //
    // The spin adapts: each wait that ends in the spin doubles the next
    // one's budget (up to spin_), each that has to sleep quarters it (down
    // to 10 us). On a loaded host the kernel may put a rank woken from the
    // futex on the core of the rank that woke it; that rank's full spin
    // then only keeps the other from running, and every call cost the
    // whole spin (1 ms at 4 B, two ranks, load average 20).
    if (all_in()) return;
    const auto spin_end = std::min(Clock::now() + spin_now_, call.deadline);
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (all_in()) {
          spin_now_ = std::min(spin_, spin_now_ * 2 + std::chrono::microseconds(1));
          return;
        }
        cpu_relax();
      }
      if (Clock::now() >= spin_end) break;
      if (oversubscribed_) ::sched_yield();
    }
    spin_now_ = std::max(std::min(spin_, std::chrono::microseconds(10)), spin_now_ / 4);
    auto next_check = Clock::now();
    for (;;) {
      header_->waiters.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seq = header_->wake_seq.load(std::memory_order_seq_cst);
      const bool done = all_in();
      const auto now = Clock::now();
      if (!done && header_->failed.load(std::memory_order_seq_cst) == 0 && now < call.deadline) {
        futex_wait(&header_->wake_seq, seq,
                   std::clamp(std::chrono::duration_cast<milliseconds>(call.deadline - now),
                              milliseconds(1), kSlice));
      }
      header_->waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (done || all_in()) return;
      const uint32_t failed = header_->failed.load(std::memory_order_seq_cst);
      if (failed != 0) {
        throw IoError(call.what + " failed: rank " + std::to_string(failed - 1) +
                      "'s collective failed (a peer died, hung or timed out)" + hint());
      }
      if (Clock::now() >= next_check) {
        for (int r = 0; r < size_; ++r) {
          if (r == rank_ ||
              static_cast<int32_t>(control(r).arrived.load(std::memory_order_seq_cst) - k) >= 0) {
            continue;
          }
          if (peer_gone(r)) {
            throw IoError(call.what + " failed: rank " + std::to_string(r) + " (pid " +
                          std::to_string(mapping_->pids[static_cast<size_t>(r)]) + ") " +
                          (control(r).closed.load() != 0 ? "destroyed its process group"
                                                         : "exited or was killed") +
                          " in the middle of it" + hint());
          }
        }
        next_check = Clock::now() + kSlice;
      }
      if (Clock::now() >= call.deadline) {
        throw TimeoutError(call.what + " timed out after " +
                           std::to_string(call.op.timeout.count()) + " ms waiting for rank(s) " +
                           missing_ranks(k) + " in shared memory" + hint());
      }
    }
  }

  static std::string hint() {
    return "; this group is unusable, exit so the launcher can restart the job";
  }

  // One step over the buffers of parity p: `write(p)` fills this rank's
  // buffer, a barrier, the call check on the op's first step, `read(p)`.
  // A buffer is written again two steps later, after a barrier every rank
  // entered once done reading it.
  template <typename Write, typename Read>
  void step(Call& call, Write write, Read read) {
    const int p = parity_;
    write(p);
    if (!call.checked) control(rank_).sig[p] = call.sig;
    barrier(call);
    if (!call.checked) {
      call.checked = true;
      if (check_calls_) {
        std::vector<detail::Signature> all(static_cast<size_t>(size_));
        for (int r = 0; r < size_; ++r) all[static_cast<size_t>(r)] = control(r).sig[p];
        parity_ ^= 1;  // in step on every rank, whatever follows
        detail::check_same_calls(all, rank_, call.what);
        parity_ ^= 1;
      }
    }
    read(p);
    parity_ ^= 1;
  }
  template <typename Write>
  void step(Call& call, Write write) {
    step(call, write, [](int) {});
  }

  // Reads `len` bytes at `remote` in rank r's process into `local`
  // (process_vm_readv, looping over short reads). A peer that exited, or
  // whose memory is no longer there, is the barrier's IoError.
  void peer_read(Call& call, int r, void* local, uint64_t remote, size_t len) {
    const int pid = mapping_->pids[static_cast<size_t>(r)];
    auto* to = static_cast<uint8_t*>(local);
    while (len > 0) {
      iovec l{to, len};
      iovec rm{reinterpret_cast<void*>(static_cast<uintptr_t>(remote)), len};
      const ssize_t n = ::process_vm_readv(pid, &l, 1, &rm, 1, 0);
      if (n > 0) {
        to += n;
        remote += static_cast<uint64_t>(n);
        len -= static_cast<size_t>(n);
        continue;
      }
      const int error = n == 0 ? EFAULT : errno;
      if (error == EINTR) continue;
      // A dying process loses its memory just before its pidfd says so:
      // give its death a moment to show before calling it something else.
      const auto until = Clock::now() + kSlice;
      for (;;) {
        const uint32_t failed = header_->failed.load(std::memory_order_seq_cst);
        if (failed != 0) {
          throw IoError(call.what + " failed: rank " + std::to_string(failed - 1) +
                        "'s collective failed (a peer died, hung or timed out)" + hint());
        }
        if (peer_gone(r)) {
          throw IoError(call.what + " failed: rank " + std::to_string(r) + " (pid " +
                        std::to_string(pid) + ") " +
                        (control(r).closed.load() != 0 ? "destroyed its process group"
                                                       : "exited or was killed") +
                        " in the middle of it" + hint());
        }
        if (Clock::now() >= until) break;
        std::this_thread::sleep_for(milliseconds(1));
      }
      throw IoError(call.what + " failed: cannot read rank " + std::to_string(r) +
                    "'s buffer (pid " + std::to_string(pid) +
                    ") by cross-memory attach: " + std::strerror(error) + hint());
    }
  }

  uint8_t* scratch(int slot) {
    if (scratch_.empty()) scratch_.resize(3 * kCmaPiece);
    return scratch_.data() + static_cast<size_t>(slot) * kCmaPiece;
  }

  // all_reduce (and reduce) by cross-memory attach: every rank publishes its
  // buffer; rank r reduces elements [lo(r), lo(r + 1)) in rank order as the
  // chunked path does (its own in place, each peer's read a piece at a time
  // into a scratch that stays in cache); then those that need the result
  // read every other share straight from its owner's buffer. Three barriers.
  void reduce_by_cma(Call& call, bool root, detail::ReduceFn fn) {
    const Op& op = call.op;
    const size_t es = element_size(op.output.dtype);
    const size_t bytes = op.output.bytes();
    const size_t n = op.output.count;
    auto* out = static_cast<uint8_t*>(op.output.data);
    auto lo = [&](int r) { return n * static_cast<size_t>(r) / static_cast<size_t>(size_) * es; };
    step(
        call,
        [&](int) {
          control(rank_).cma_address = reinterpret_cast<uintptr_t>(out);
          control(rank_).cma_bytes = bytes;
        },
        [&](int) {
          std::vector<uint64_t> address(static_cast<size_t>(size_));
          for (int r = 0; r < size_; ++r) {
            // Only when calls are not checked can they differ here.
            if (control(r).cma_bytes != bytes) {
              throw IoError(call.what + " failed: rank " + std::to_string(r) + "'s buffer has " +
                            std::to_string(control(r).cma_bytes) + " bytes, this rank's " +
                            std::to_string(bytes) + hint());
            }
            address[static_cast<size_t>(r)] = control(r).cma_address;
          }
          ++g_cma_calls;
          const size_t mine = lo(rank_);
          const size_t mine_len = lo(rank_ + 1) - mine;
          const size_t piece = kCmaPiece / es * es;
          for (size_t off = 0; off < mine_len; off += piece) {
            const size_t len = std::min(piece, mine_len - off);
            const size_t at = mine + off;
            uint8_t* dst = out + at;
            // Ranks 0 and 1 read their own elements in place (the first
            // step may write where it reads); later ranks keep theirs aside,
            // as the chain has written over them by the time it reads them.
            if (rank_ >= 2) std::memcpy(scratch(2), dst, len);
            auto source = [&](int r, int slot) -> const uint8_t* {
              if (r == rank_) return rank_ < 2 ? dst : scratch(2);
              peer_read(call, r, scratch(slot), address[static_cast<size_t>(r)] + at, len);
              return scratch(slot);
            };
            const uint8_t* a = source(0, 0);
            const uint8_t* b = source(1, 1);
            fn(dst, a, b, len / es);
            for (int r = 2; r < size_; ++r) fn(dst, dst, source(r, 0), len / es);
          }
          barrier(call);  // every share is reduced
          if (root) {
            for (int r = 0; r < size_; ++r) {
              if (r == rank_) continue;
              peer_read(call, r, out + lo(r), address[static_cast<size_t>(r)] + lo(r),
                        lo(r + 1) - lo(r));
            }
          }
          barrier(call);  // no one reads this rank's buffer any more
        });
  }

  static void copy(void* to, const void* from, size_t bytes) {
    if (bytes > 0 && to != from) std::memcpy(to, from, bytes);
  }

  // dst[0, n) = buffer(0) op buffer(1) op ... at byte offset `at`, in rank order.
  void reduce_ranks(uint8_t* dst, int p, size_t at, size_t n, detail::ReduceFn fn) {
    if (n == 0) return;
    fn(dst, buffer(0, p) + at, buffer(1, p) + at, n);
    for (int r = 2; r < size_; ++r) fn(dst, dst, buffer(r, p) + at, n);
  }

  // all_reduce (every rank gets the result) and reduce (the root does).
  void reduce_all(Call& call, bool everyone) {
    const Op& op = call.op;
    const DataType dtype = op.output.dtype;
    const size_t es = element_size(dtype);
    const size_t bytes = op.output.bytes();
    auto* data = static_cast<uint8_t*>(op.output.data);
    const auto fn = detail::reduce_function(dtype, op.reduce);
    const bool root = everyone || rank_ == op.peer;
    const bool flat = bytes <= kShmFlatBytes;
    const size_t per_step = chunk_ / es * es;
    if (mapping_->cma && bytes > 0 && bytes >= mapping_->cma_min && bytes <= mapping_->cma_max) {
      reduce_by_cma(call, root, fn);
      if (op.reduce == ReduceOp::kAverage && root) {
        detail::divide_in_place(op.output.data, op.output.count, dtype, size_);
      }
      return;
    }
    size_t off = 0;
    do {
      const size_t len = std::min(bytes - off, per_step);
      const size_t n = len / es;
      uint8_t* out = data + off;
      if (flat) {
        step(
            call, [&](int p) { copy(buffer(rank_, p), out, len); },
            [&](int p) {
              if (root) reduce_ranks(out, p, 0, n, fn);
            });
      } else {
        // Reduce-scatter: rank r reduces elements [lo(r), lo(r + 1)) of the
        // chunk, in rank order, into its own buffer and the shared one; then
        // the ranks that need the result copy every share. A rank copies in
        // only the shares others reduce and reads its own from its buffer
        // (ranks 0 and 1: the first reduction step may write where it
        // reads); ranks from 2 copy theirs in too, as the chain has written
        // over it by the time it reads it. At two ranks that moves 4.5 bytes
        // a byte of the message instead of 5.5.
        auto lo = [&](int r) { return n * static_cast<size_t>(r) / static_cast<size_t>(size_); };
        const size_t mine = lo(rank_) * es;
        const size_t mine_len = (lo(rank_ + 1) - lo(rank_)) * es;
        const bool own_in_place = rank_ < 2;
        step(
            call,
            [&](int p) {
              for (int r = 0; r < size_; ++r) {
                if (r == rank_ && own_in_place) continue;
                const size_t at = lo(r) * es;
                copy(buffer(rank_, p) + at, out + at, (lo(r + 1) - lo(r)) * es);
              }
            },
            [&](int p) {
              auto source = [&](int r) -> const uint8_t* {
                return r == rank_ && own_in_place ? out + mine : buffer(r, p) + mine;
              };
              if (mine_len > 0) {
                fn(out + mine, source(0), source(1), mine_len / es);
                for (int r = 2; r < size_; ++r)
                  fn(out + mine, out + mine, source(r), mine_len / es);
              }
              copy(buffer(rank_, p) + mine, out + mine, mine_len);
              barrier(call);
              if (!root) return;
              for (int r = 0; r < size_; ++r) {
                if (r == rank_) continue;
                const size_t at = lo(r) * es;
                copy(out + at, buffer(r, p) + at, (lo(r + 1) - lo(r)) * es);
              }
            });
      }
      off += len;
    } while (off < bytes);
    if (op.reduce == ReduceOp::kAverage && root && op.output.count > 0) {
      detail::divide_in_place(op.output.data, op.output.count, dtype, size_);
    }
  }

  void broadcast(Call& call) {
    const Op& op = call.op;
    const size_t bytes = op.output.bytes();
    auto* data = static_cast<uint8_t*>(op.output.data);
    const int root = op.peer;
    size_t off = 0;
    do {
      const size_t len = std::min(bytes - off, chunk_);
      step(
          call,
          [&](int p) {
            if (rank_ == root) copy(buffer(rank_, p), data + off, len);
          },
          [&](int p) {
            if (rank_ != root) copy(data + off, buffer(root, p), len);
          });
      off += len;
    } while (off < bytes);
  }

  void all_gather(Call& call) {
    const Op& op = call.op;
    const size_t bytes = op.input.bytes();  // per rank
    const auto* in = static_cast<const uint8_t*>(op.input.data);
    auto* out = static_cast<uint8_t*>(op.output.data);
    size_t off = 0;
    do {
      const size_t len = std::min(bytes - off, chunk_);
      step(
          call, [&](int p) { copy(buffer(rank_, p), in + off, len); },
          [&](int p) {
            for (int r = 0; r < size_; ++r) {
              copy(out + static_cast<size_t>(r) * bytes + off, buffer(r, p), len);
            }
          });
      off += len;
    } while (off < bytes);
  }

  void reduce_scatter(Call& call) {
    const Op& op = call.op;
    const DataType dtype = op.output.dtype;
    const size_t es = element_size(dtype);
    const size_t bytes = op.output.bytes();  // per rank
    const auto* in = static_cast<const uint8_t*>(op.input.data);
    auto* out = static_cast<uint8_t*>(op.output.data);
    const auto fn = detail::reduce_function(dtype, op.reduce);
    // A step carries one piece for every rank.
    const size_t piece = std::max(es, chunk_ / static_cast<size_t>(size_) / es * es);
    size_t off = 0;
    do {
      const size_t len = std::min(bytes - off, piece);
      step(
          call,
          [&](int p) {
            for (int r = 0; r < size_; ++r) {
              copy(buffer(rank_, p) + static_cast<size_t>(r) * len,
                   in + static_cast<size_t>(r) * bytes + off, len);
            }
          },
          [&](int p) {
            reduce_ranks(out + off, p, static_cast<size_t>(rank_) * len, len / es, fn);
          });
      off += len;
    } while (off < bytes);
    if (op.reduce == ReduceOp::kAverage && op.output.count > 0) {
      detail::divide_in_place(op.output.data, op.output.count, dtype, size_);
    }
  }

  const int rank_;
  const int size_;
  const bool check_calls_;
  std::unique_ptr<Mapping> mapping_;
  std::unique_ptr<Backend> gloo_;  // gather, scatter, all_to_all, send, recv
  const size_t chunk_;
  const Layout layout_;
  const std::chrono::microseconds spin_ = spin_time();
  const bool oversubscribed_ = size_ > static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  std::chrono::microseconds spin_now_ = spin_;  // the adaptive budget, at most spin_
  Header* header_ = nullptr;
  std::vector<int> pidfds_;       // -1: none (this process, or no pidfd_open)
  std::vector<uint8_t> scratch_;  // reduce_by_cma's pieces, made on first use
  // Touched only by the thread running the group's current op.
  uint32_t barriers_ = 0;
  int parity_ = 0;
  std::string broken_;  // why the group is unusable; empty while it is usable
  // Last: its thread runs execute(), which uses everything above.
  OpQueue queue_{
      [this](const Op& op, uint32_t tag, const PromiseWork& work) { execute(op, tag, work); }};
};

}  // namespace

uint64_t shm_cma_calls() { return g_cma_calls.load(); }

int sweep_stale_segments(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  const std::string ours = std::string(kNamePrefix) + pid_namespace() + ".";
  int removed = 0;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name.rfind(ours, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + ours.size(), nullptr, 10);
    if (pid <= 0 || pid > INT_MAX) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH &&
        ::unlinkat(::dirfd(d), name.c_str(), 0) == 0) {
      ++removed;
    }
  }
  ::closedir(d);
  if (removed > 0) {
    get_logger("coll")->info("removed {} stale shared-memory segment(s) of dead processes from {}",
                             removed, dir);
  }
  return removed;
}

std::unique_ptr<Backend> create_host_backend(const BackendContext& context) {
  // Read first, so that a bad value fails every rank alike, at once.
  const bool cma = cma_switch();
  spin_time();
  chunk_setting();
  // A hierarchical all_reduce's piece (rank 0's holds on every rank): a
  // setting of its own, not the segment's chunk.
  const size_t piece = page_bytes_setting("CTORCHRUN_DIST_HIER_PIECE").value_or(kDefaultPiece);
  const size_t cma_min = cma_bytes("CTORCHRUN_DIST_SHM_CMA_MIN", kShmCmaBytes);
  const size_t cma_max =
      cma_bytes("CTORCHRUN_DIST_SHM_CMA_MAX", context.size <= kShmCmaRanks ? kShmCmaMaxBytes : 0);
  const std::string cma_sizes = std::to_string(cma_min) + " " + std::to_string(cma_max);
  // A rank that would send nothing by cross-memory attach (a group of more
  // than kShmCmaRanks by default) opens its memory to no one: it answers
  // "off" and the group goes without.
  const bool cma_wanted = cma && context.shm && cma_max > 0 && cma_max >= cma_min;
  if (context.device.type != DeviceType::kCpu || context.size <= 1) {
    return create_gloo_backend(context);
  }
  const auto deadline = Clock::now() + context.timeout;
  const std::string dir = shm_dir();
  const std::string identity = host_identity(dir);
  std::vector<HostView> views;
  for (const auto& text :
       exchange(*context.store, "shm/host", context.rank, context.size,
                format_view(context.shm, piece, identity, cma_probe(cma_wanted)), deadline)) {
    views.push_back(parse_view(text));
  }
  bool wanted = true;
  bool one_host = true;
  std::vector<std::string> probes;
  for (const auto& view : views) {
    probes.push_back(view.probe);
    wanted = wanted && view.shm && view.piece > 0;
    one_host = one_host && view.identity == identity;
  }
  std::unique_ptr<Mapping> mapping;
  if (wanted && one_host) {
    std::string why;
    mapping = set_up_segment(context, dir, deadline, why, probes, cma_sizes);
    if (!mapping) warn_fallback_once(why);
  } else if (wanted) {
    // Several hosts: shared memory within each, gloo between them
    // (collectives/hier_backend.h), unless every host has one rank.
    // Every rank cuts a large all_reduce in rank 0's pieces.
    std::vector<std::string> hosts;
    for (const auto& v : views) hosts.push_back(v.identity);
    if (auto hier = create_hier_backend(context, hosts, views[0].piece, deadline)) return hier;
  }
  BackendContext rest = context;
  rest.timeout =
      std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(1));
  if (!mapping) return create_gloo_backend(rest);
  rest.check_calls = false;  // the shared-memory path checks every collective
  auto gloo = create_gloo_backend(rest);
  return std::make_unique<ShmBackend>(context, std::move(mapping), std::move(gloo));
}

}  // namespace ctorchrun::dist

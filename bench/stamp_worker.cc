// stamp_worker: a worker for the launch benchmarks, run with --no_python.
//
//   stamp_worker DIR FAIL_RANK
//
// Writes DIR/start_<attempt>_<rank> with the wall-clock time (ns) it started.
// In attempt 0, rank FAIL_RANK writes DIR/fail_<rank> with the time and exits
// 1 at once; the other ranks of attempt 0 sleep until stopped. In later
// attempts every rank exits 0. FAIL_RANK -1: nobody fails, everyone exits 0.

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

long long now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1'000'000'000LL + ts.tv_nsec;
}

void stamp(const std::string& path, long long t) {
  std::string s = std::to_string(t) + "\n";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::exit(70);
  if (::write(fd, s.data(), s.size()) != static_cast<ssize_t>(s.size())) std::exit(70);
  ::close(fd);
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  long long t = now_ns();
  if (argc != 3) {
    std::fprintf(stderr, "usage: stamp_worker DIR FAIL_RANK\n");
    return 2;
  }
  std::string dir = argv[1];
  int fail_rank = std::atoi(argv[2]);
  int rank = env_int("RANK");
  int attempt = env_int("TORCHELASTIC_RESTART_COUNT");
  stamp(dir + "/start_" + std::to_string(attempt) + "_" + std::to_string(rank), t);
  if (fail_rank < 0 || attempt > 0) return 0;
  if (rank == fail_rank) {
    stamp(dir + "/fail_" + std::to_string(rank), now_ns());
    return 1;
  }
  sleep(60);
  return 0;
}

// ctorch-etcd-failover-bench: what an etcd leader's loss costs a writer that
// uses our own client. One EtcdStore (keys under /ctorchrun-failover-bench/)
// on the members given, one set() every --interval-ms (start to start; the
// next starts at once when one takes longer), each bounded by the client's
// --read-timeout-ms.
//
//   ctorch-etcd-failover-bench --endpoints HOST:PORT,HOST:PORT,... --kill-file PATH
//                              [--interval-ms 20] [--read-timeout-ms 2000]
//                              [--after-writes 25] [--max-seconds 60]
//
// After 10 successful writes it prints "READY" (flushed). Whoever kills the
// leader then writes the kill's time, seconds since the epoch on this host's
// clock (as Python's time.time()), into --kill-file (atomically: written
// elsewhere and renamed). The program keeps every write's start, end and
// outcome, and stops once --after-writes writes started after the kill have
// succeeded, or after --max-seconds. It then prints one JSON line:
//   first_ok_after_kill_s  end of the first successful write that started at
//                          or after the kill, minus the kill's time;
//   failed_after_kill      writes that failed and ended after the kill;
//   failed_before_kill     writes that failed before it (0 expected);
//   in_flight_at_kill      the write running at the kill: its outcome and
//                          its end minus the kill's time;
//   max_latency_after_kill_ms, writes_after_kill, first_error.
// Exit 0 with a successful write after the kill, 1 without, 2 usage error.

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "etcd/client.h"
#include "etcd/etcd_store.h"

using namespace ctorchrun;
using std::chrono::milliseconds;

namespace {

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Write {
  double start = 0;
  double end = 0;
  bool ok = false;
  std::string error;  // why it failed (cut to 400 bytes)
};

// The kill's time from the file, once it holds a number.
std::optional<double> read_kill_time(const std::string& path) {
  std::ifstream in(path);
  double t = 0;
  if (in && (in >> t) && t > 0) return t;
  return std::nullopt;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ctorch-etcd-failover-bench: an etcd leader's loss seen by a writer on our client"};
  std::string endpoints;
  std::string kill_file;
  int interval_ms = 20;
  int read_timeout_ms = 2000;
  int after_writes = 25;
  double max_seconds = 60;
  app.add_option("--endpoints", endpoints, "etcd members HOST:PORT[,...]")->required();
  app.add_option("--kill-file", kill_file, "file that receives the kill's time (epoch seconds)")
      ->required();
  app.add_option("--interval-ms", interval_ms, "start-to-start period of the writes")
      ->check(CLI::Range(1, 10000));
  app.add_option("--read-timeout-ms", read_timeout_ms, "the client's read timeout")
      ->check(CLI::Range(10, 600000));
  app.add_option("--after-writes", after_writes, "successful writes after the kill before stopping")
      ->check(CLI::Range(1, 100000));
  app.add_option("--max-seconds", max_seconds, "stop after this long in any case")
      ->check(CLI::Range(1.0, 3600.0));
  CLI11_PARSE(app, argc, argv);

  const auto members = split(endpoints);
  std::shared_ptr<etcd::EtcdClient> client;
  try {
    client = std::make_shared<etcd::EtcdClient>(members, milliseconds(read_timeout_ms));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ctorch-etcd-failover-bench: %s\n", e.what());
    return 2;
  }
  etcd::EtcdStore store(client, "/ctorchrun-failover-bench/");

  std::vector<Write> writes;
  writes.reserve(1 << 16);
  std::optional<double> kill_t;
  int ok_total = 0;
  bool ready = false;
  const auto period = milliseconds(interval_ms);
  const auto begin = std::chrono::steady_clock::now();
  const auto stop_at = begin + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(max_seconds));
  auto next = begin;
  for (long i = 0; std::chrono::steady_clock::now() < stop_at && i < 10'000'000; ++i) {
    std::this_thread::sleep_until(next);
    next += period;
    if (next < std::chrono::steady_clock::now()) next = std::chrono::steady_clock::now();
    Write w;
    w.start = wall_now();
    try {
      store.set("w", std::to_string(i));
      w.ok = true;
    } catch (const std::exception& e) {
      w.error = std::string(e.what()).substr(0, 400);
    }
    w.end = wall_now();
    writes.push_back(w);
    if (w.ok && ++ok_total == 10 && !ready) {
      ready = true;
      std::printf("READY\n");
      std::fflush(stdout);
    }
    if (!kill_t) kill_t = read_kill_time(kill_file);
    if (kill_t) {
      int ok_after = 0;
      for (const auto& x : writes) ok_after += x.ok && x.start >= *kill_t;
      if (ok_after >= after_writes) break;
    }
  }
  if (!kill_t) kill_t = read_kill_time(kill_file);

  nlohmann::json out;
  out["endpoints"] = members;
  out["interval_ms"] = interval_ms;
  out["read_timeout_ms"] = read_timeout_ms;
  out["writes"] = writes.size();
  if (!kill_t) {
    out["status"] = "no kill time in " + kill_file;
    std::printf("%s\n", out.dump().c_str());
    return 1;
  }
  const double t0 = *kill_t;
  out["kill_t"] = t0;
  int failed_before = 0, failed_after = 0, after = 0;
  double max_latency = 0;
  std::optional<double> first_ok;
  for (const auto& w : writes) {
    if (w.end < t0) {
      failed_before += !w.ok;
      continue;
    }
    if (w.start < t0) {
      out["in_flight_at_kill"] = {{"ok", w.ok}, {"end_after_kill_s", w.end - t0}};
    }
    ++after;
    failed_after += !w.ok;
    if (!w.ok && !out.contains("first_error")) out["first_error"] = w.error;
    max_latency = std::max(max_latency, w.end - w.start);
    if (w.ok && w.start >= t0 && !first_ok) first_ok = w.end - t0;
  }
  out["writes_after_kill"] = after;
  out["failed_after_kill"] = failed_after;
  out["failed_before_kill"] = failed_before;
  out["max_latency_after_kill_ms"] = max_latency * 1000;
  if (first_ok) {
    out["status"] = "ok";
    out["first_ok_after_kill_s"] = *first_ok;
  } else {
    out["status"] = "no successful write after the kill";
  }
  std::printf("%s\n", out.dump().c_str());
  return first_ok ? 0 : 1;
}

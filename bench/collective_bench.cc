// ctorch-collective-bench: nccl-tests-style timing of libctorch_dist
// collectives, run under ctorchrun:
//
//   ctorchrun --nproc_per_node=2 --no_python build/bin/ctorch-collective-bench --op all_reduce
//   --min-bytes 4 --max-bytes 256M [--json]
//
// Sizes double from --min-bytes to --max-bytes. "bytes" follows nccl-tests:
// the buffer for all_reduce, broadcast and reduce; the whole output for
// all_gather; the whole input for reduce_scatter; the whole buffer for
// all_to_all. time_us is the mean over --iters calls of the slowest rank;
// algbw = bytes / time; busbw = algbw x the op's nccl-tests factor
// (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
// broadcast, reduce 1). After the timed calls, one call on known inputs is
// checked on every rank; any wrong element makes the exit code 1.
// --backend nccl times device buffers on cuda:LOCAL_RANK (each call blocks
// until the device has finished it).

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "examples/device_staging.h"

namespace dist = ctorchrun::dist;

namespace {

uint64_t parse_size(const std::string& text) {
  size_t used = 0;
  const uint64_t value = std::stoull(text, &used);
  const std::string unit = text.substr(used);
  if (unit.empty() || unit == "B") return value;
  if (unit == "K" || unit == "KiB") return value << 10;
  if (unit == "M" || unit == "MiB") return value << 20;
  if (unit == "G" || unit == "GiB") return value << 30;
  throw CLI::ValidationError("size", "unknown unit in '" + text + "' (B, K, M, G)");
}

struct Shape {
  size_t in = 0;   // elements of the input (0: in place)
  size_t out = 0;  // elements of the output / in-place buffer
};

Shape shape_of(const std::string& op, size_t count, size_t world) {
  if (op == "all_gather") return {count / world, count / world * world};
  if (op == "reduce_scatter") return {count / world * world, count / world};
  if (op == "all_to_all") return {count / world * world, count / world * world};
  return {0, count};
}

double bus_factor(const std::string& op, double n) {
  if (op == "all_reduce") return 2 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return (n - 1) / n;
  return 1;
}

// The buffers the timed calls use: the host vectors, or device copies.
struct Buffers {
  dist::Buffer in;
  dist::Buffer out;
};

void run_op(dist::ProcessGroup& pg, const std::string& op, const Buffers& buffers) {
  const dist::Buffer& ib = buffers.in;
  const dist::Buffer& ob = buffers.out;
  if (op == "all_reduce") {
    pg.all_reduce(ob);
  } else if (op == "broadcast") {
    pg.broadcast(ob, 0);
  } else if (op == "reduce") {
    pg.reduce(ob, 0);
  } else if (op == "all_gather") {
    pg.all_gather(ib, ob);
  } else if (op == "reduce_scatter") {
    pg.reduce_scatter(ib, ob);
  } else {
    pg.all_to_all(ib, ob);
  }
}

// Fills with small integers (exact in float) and returns the wrong elements
// after one call.
int64_t check(dist::ProcessGroup& pg, const std::string& op, std::vector<float>& in,
              std::vector<float>& out, const Buffers& buffers) {
  const int rank = pg.rank();
  const int n = pg.size();
  auto value = [](int r, size_t i) { return static_cast<float>(r + 1 + static_cast<int>(i % 5)); };
  for (size_t i = 0; i < in.size(); ++i) in[i] = value(rank, i);
  for (size_t i = 0; i < out.size(); ++i) out[i] = value(rank, i);
  const bool on_device = buffers.out.device.type != dist::DeviceType::kCpu;
  if (on_device) {
    ctorchrun::tools::upload(buffers.in, in.data());
    ctorchrun::tools::upload(buffers.out, out.data());
  }
  run_op(pg, op, buffers);
  if (on_device) {
    ctorchrun::tools::download(out.data(), buffers.out);
  }
  int64_t wrong = 0;
  const size_t per = n > 0 ? out.size() / static_cast<size_t>(n) : 0;
  for (size_t i = 0; i < out.size(); ++i) {
    float expect = 0;
    if (op == "all_reduce" || (op == "reduce" && rank == 0)) {
      for (int r = 0; r < n; ++r) expect += value(r, i);
    } else if (op == "broadcast") {
      expect = value(0, i);
    } else if (op == "reduce") {
      continue;
    } else if (op == "all_gather") {
      expect = value(static_cast<int>(i / per), i % per);
    } else if (op == "reduce_scatter") {
      for (int r = 0; r < n; ++r) expect += value(r, static_cast<size_t>(rank) * out.size() + i);
    } else {  // all_to_all: slice j of rank i -> slice i of rank j
      const size_t source = i / per;
      expect = value(static_cast<int>(source), static_cast<size_t>(rank) * per + i % per);
    }
    if (out[i] != expect) ++wrong;
  }
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ctorch-collective-bench: time libctorch_dist collectives (run under ctorchrun)"};
  std::string backend = "gloo";
  std::string op = "all_reduce";
  std::string min_text = "4";
  std::string max_text = "64M";
  int iters = 0;
  int warmup = -1;
  bool json = false;
  app.add_option("--backend", backend, "gloo or nccl")->default_val("gloo");
  app.add_option("--op", op, "the collective")
      ->check(CLI::IsMember(
          {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"}))
      ->default_val("all_reduce");
  app.add_option("--min-bytes", min_text, "smallest size (B, K, M, G suffixes)")->default_val("4");
  app.add_option("--max-bytes", max_text, "largest size")->default_val("64M");
  app.add_option("--iters", iters, "timed calls per size (default: by size, 5 to 1000)");
  app.add_option("--warmup", warmup, "untimed calls per size (default: iters / 10, at least 2)");
  app.add_flag("--json", json, "one JSON object per size instead of the table");
  CLI11_PARSE(app, argc, argv);

  try {
    const uint64_t min_bytes = parse_size(min_text);
    const uint64_t max_bytes = parse_size(max_text);
    ctorchrun::tools::register_gpu_backends();
    dist::InitOptions options;
    options.backend = backend;
    if (backend == "nccl") options.device = {dist::DeviceType::kCuda, -1};
    auto pg = dist::init_process_group(options);
    const auto world = static_cast<size_t>(pg->size());
    if (pg->rank() == 0 && !json) {
      std::printf("# ctorch-collective-bench: %s, backend %s, %zu ranks, float32\n", op.c_str(),
                  backend.c_str(), world);
      std::printf("#%12s %12s %10s %10s %10s %7s\n", "size (B)", "count", "time (us)", "algbw GB/s",
                  "busbw GB/s", "#wrong");
    }
    int64_t total_wrong = 0;
    for (uint64_t bytes = std::max<uint64_t>(min_bytes, 4); bytes <= max_bytes; bytes *= 2) {
      const Shape shape = shape_of(op, bytes / sizeof(float), world);
      if (shape.out == 0) continue;  // too small to give every rank an element
      std::vector<float> in(shape.in), out(shape.out);
      Buffers buffers{dist::make_buffer(in.data(), in.size()),
                      dist::make_buffer(out.data(), out.size())};
      std::unique_ptr<ctorchrun::tools::DeviceMemory> din, dout;
      if (pg->device().type != dist::DeviceType::kCpu) {
        din = std::make_unique<ctorchrun::tools::DeviceMemory>(pg->device(), in.size() * 4);
        dout = std::make_unique<ctorchrun::tools::DeviceMemory>(pg->device(), out.size() * 4);
        buffers = {din->buffer(in.size(), dist::DataType::kFloat32),
                   dout->buffer(out.size(), dist::DataType::kFloat32)};
      }
      const size_t real_bytes = std::max(shape.in, shape.out) * sizeof(float);
      const int n_iters =
          iters > 0
              ? iters
              : static_cast<int>(std::clamp<uint64_t>((uint64_t{1} << 30) / real_bytes, 5, 1000));
      const int n_warmup = warmup >= 0 ? warmup : std::max(2, n_iters / 10);
      for (int i = 0; i < n_warmup; ++i) run_op(*pg, op, buffers);
      pg->barrier();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < n_iters; ++i) run_op(*pg, op, buffers);
      const auto stop = std::chrono::steady_clock::now();
      double time_us = std::chrono::duration<double, std::micro>(stop - start).count() / n_iters;
      ctorchrun::tools::staged(
          dist::make_buffer(&time_us, 1), pg->device(),
          [&](const dist::Buffer& b) { pg->all_reduce(b, dist::ReduceOp::kMax); });
      int64_t wrong = check(*pg, op, in, out, buffers);
      ctorchrun::tools::staged(dist::make_buffer(&wrong, 1), pg->device(),
                               [&](const dist::Buffer& b) { pg->all_reduce(b); });
      total_wrong += wrong;
      const double algbw = static_cast<double>(real_bytes) / time_us / 1e3;
      const double busbw = algbw * bus_factor(op, static_cast<double>(world));
      if (pg->rank() != 0) continue;
      if (json) {
        nlohmann::json row = {{"op", op},           {"bytes", real_bytes}, {"world", world},
                              {"time_us", time_us}, {"algbw_GBps", algbw}, {"busbw_GBps", busbw},
                              {"backend", backend}, {"dtype", "float32"},  {"iters", n_iters},
                              {"wrong", wrong}};
        std::cout << row.dump() << std::endl;
      } else {
        std::printf(" %12zu %12zu %10.2f %10.3f %10.3f %7lld\n", real_bytes,
                    std::max(shape.in, shape.out), time_us, algbw, busbw,
                    static_cast<long long>(wrong));
        std::fflush(stdout);
      }
    }
    pg->barrier();
    if (total_wrong != 0) {
      std::cerr << "ctorch-collective-bench: " << total_wrong << " wrong elements\n";
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ctorch-collective-bench: " << e.what() << "\n";
    return 1;
  }
}

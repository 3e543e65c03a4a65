// ctorch-train-example: a data-parallel trainer in plain C++ on libctorch_dist.
//
//   ctorchrun --nproc_per_node=3 --max_restarts=1 --no_python build/bin/ctorch-train-example
//   --workdir /tmp/run --epochs 5 --fail-once-at-epoch 3
//
// The model is a linear regression on synthetic data that is a pure function
// of the sample's global index, so any rank can produce any sample. Each step
// takes a global batch of consecutive indices; rank r computes the samples
// whose index is r modulo the world size. Per-sample gradients are rounded to
// fixed point (int64) before they are summed and all-reduced: integer sums do
// not depend on their order, so the parameters, and the digest, are
// bit-identical whatever the world size, across runs, restarts and a resume
// at another world size.
//
// Epochs count from 0; after each, rank 0 saves a checkpoint in --workdir;
// on start, rank 0 loads the latest valid one and broadcasts it. Rank 1 exits
// with code 3 at the start of --fail-once-at-epoch when
// TORCHELASTIC_RESTART_COUNT is 0 (--fail-rank R picks another rank). Rank 0 writes
// --workdir/result.json: digest (SHA-256 hex of the final parameters' bytes),
// world, attempt, start_epoch, epochs.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "collectives/checkpoint.h"
#include "collectives/process_group.h"
#include "collectives/sha256.h"
#include "common/error.h"
#include "examples/device_staging.h"

namespace dist = ctorchrun::dist;

namespace {

constexpr int kFeatures = 32;
constexpr int kParams = kFeatures + 1;  // weights and bias
constexpr int64_t kSamplesPerEpoch = 4096;
constexpr int64_t kBatch = 64;
constexpr double kLearningRate = 0.05;
constexpr double kFixedPoint = 1 << 24;  // gradient resolution 2^-24
constexpr uint64_t kSeed = 0x5eed2024;

// SplitMix64: a counter-based generator, so sample i needs no state.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

double uniform(uint64_t a, uint64_t b) {  // in [-1, 1)
  return static_cast<double>(mix(kSeed ^ mix(a * 1315423911ULL + b)) >> 11) * 0x1.0p-52 - 1.0;
}

struct Sample {
  double x[kFeatures];
  double y;
};

Sample sample(int64_t index) {
  Sample s{};
  double y = 0.5;
  for (int j = 0; j < kFeatures; ++j) {
    s.x[j] = uniform(static_cast<uint64_t>(index), static_cast<uint64_t>(j));
    y += s.x[j] * (0.1 * (j % 7) - 0.3);
  }
  s.y = y + 0.01 * uniform(static_cast<uint64_t>(index), 1000);
  return s;
}

std::string params_bytes(const std::vector<double>& params) {
  return std::string(reinterpret_cast<const char*>(params.data()), params.size() * sizeof(double));
}

void write_result(const std::string& workdir, const nlohmann::json& result) {
  const std::string path = workdir + "/result.json";
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp);
    out << result.dump() << "\n";
    if (!out) throw ctorchrun::IoError("cannot write " + temp);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0)
    throw ctorchrun::IoError("cannot rename " + temp);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ctorch-train-example: a deterministic data-parallel trainer on libctorch_dist"};
  std::string workdir;
  int epochs = 0;
  int fail_at = -1;
  int fail_rank = 1;
  std::string backend = "gloo";
  app.add_option("--workdir", workdir, "checkpoints and result.json")->required();
  app.add_option("--epochs", epochs, "epochs to train in total")
      ->required()
      ->check(CLI::PositiveNumber);
  app.add_option("--fail-once-at-epoch", fail_at,
                 "--fail-rank exits with code 3 at the start of this epoch on attempt 0");
  app.add_option("--fail-rank", fail_rank,
                 "the rank --fail-once-at-epoch fails (default 1: nothing fails at world size 1; "
                 "0 lets a one-rank job, as on one GPU, crash and resume)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--backend", backend, "process group backend: gloo, or nccl (on cuda:LOCAL_RANK)")
      ->default_val("gloo");
  CLI11_PARSE(app, argc, argv);

  try {
    ctorchrun::tools::register_gpu_backends();
    dist::InitOptions options;
    options.backend = backend;
    if (backend == "nccl") options.device = {dist::DeviceType::kCuda, -1};
    auto pg = dist::init_process_group(options);
    // With nccl the parameters and gradients are broadcast and reduced in
    // device memory; the arithmetic stays on the host, so both backends train
    // the same model bit for bit.
    const dist::Device device = pg->device();
    auto on_device = [&](const dist::Buffer& host, const auto& op) {
      ctorchrun::tools::staged(host, device, op);
    };
    const int rank = pg->rank();
    const int world = pg->size();
    const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    const int attempt = restart != nullptr ? std::atoi(restart) : 0;

    // Resume: rank 0 reads the latest valid checkpoint and broadcasts it, so
    // the ranks agree even without a shared file system.
    std::vector<double> params(kParams, 0.0);
    int64_t start_epoch = 0;
    if (rank == 0) {
      if (auto ckpt = dist::load_latest_checkpoint(workdir)) {
        if (ckpt->payload.size() != params.size() * sizeof(double)) {
          throw ctorchrun::ConfigError("checkpoint " + ckpt->path + " holds another model");
        }
        std::memcpy(params.data(), ckpt->payload.data(), ckpt->payload.size());
        start_epoch = ckpt->step + 1;
      }
    }
    auto broadcast = [&](const dist::Buffer& b) { pg->broadcast(b, 0); };
    on_device(dist::make_buffer(&start_epoch, 1), broadcast);
    on_device(dist::make_buffer(params.data(), params.size()), broadcast);
    if (rank == 0) {
      std::cerr << "ctorch-train-example: world " << world << " attempt " << attempt
                << " starting at epoch " << start_epoch << " of " << epochs << "\n";
    }

    std::vector<int64_t> grad(kParams);
    for (int64_t epoch = start_epoch; epoch < epochs; ++epoch) {
      if (epoch == fail_at && rank == fail_rank && attempt == 0) {
        std::cerr << "ctorch-train-example: rank " << rank << " fails at the start of epoch "
                  << epoch << " (--fail-once-at-epoch)\n";
        std::cerr.flush();
        std::_Exit(3);
      }
      for (int64_t first = 0; first < kSamplesPerEpoch; first += kBatch) {
        std::fill(grad.begin(), grad.end(), 0);
        for (int64_t i = first; i < first + kBatch; ++i) {
          if (i % world != rank) continue;
          const Sample s = sample(epoch * kSamplesPerEpoch + i);
          double prediction = params[kFeatures];
          for (int j = 0; j < kFeatures; ++j) prediction += params[j] * s.x[j];
          const double error = prediction - s.y;  // d(error^2 / 2)
          for (int j = 0; j < kFeatures; ++j) {
            grad[j] += std::llround(error * s.x[j] * kFixedPoint);
          }
          grad[kFeatures] += std::llround(error * kFixedPoint);
        }
        on_device(dist::make_buffer(grad.data(), grad.size()),
                  [&](const dist::Buffer& b) { pg->all_reduce(b); });
        for (int j = 0; j < kParams; ++j) {
          params[j] -= kLearningRate * (static_cast<double>(grad[j]) / kFixedPoint) / kBatch;
        }
      }
      if (rank == 0) dist::save_checkpoint(workdir, epoch, params_bytes(params), 3);
      pg->barrier();
    }

    if (rank == 0) {
      const std::string bytes = params_bytes(params);
      nlohmann::json result = {{"digest", dist::sha256_hex(bytes.data(), bytes.size())},
                               {"world", world},
                               {"attempt", attempt},
                               {"start_epoch", start_epoch},
                               {"epochs", epochs}};
      write_result(workdir, result);
      std::cout << result.dump() << std::endl;
    }
    pg->barrier();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ctorch-train-example: " << e.what() << "\n";
    return 1;
  }
}

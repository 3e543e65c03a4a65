// Uses the installed headers and library: a process group of one, the store
// client, the checkpoint helpers.
#include <iostream>
#include <memory>
#include <vector>

#include "collectives/dist.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"

int main(int argc, char** argv) {
  namespace dist = ctorchrun::dist;
  if (argc != 2) return 2;
  auto store = std::make_shared<ctorchrun::store::PrefixStore>(
      "user", std::make_shared<ctorchrun::store::HashStore>());
  store->set("k", "v");
  dist::InitOptions options;
  options.rank = 0;
  options.world_size = 1;
  options.store = store;
  auto pg = dist::init_process_group(options);
  std::vector<float> grad = {1.0f, 2.0f};
  pg->all_reduce(dist::make_buffer(grad.data(), grad.size()), dist::ReduceOp::kAverage);
  dist::save_checkpoint(argv[1], 7, "state");
  auto latest = dist::load_latest_checkpoint(argv[1]);
  if (!latest || latest->step != 7 || latest->payload != "state" || store->get("k") != "v") {
    std::cerr << "consumer: wrong results\n";
    return 1;
  }
  std::cout << "consumer: ok" << std::endl;
  return 0;
}

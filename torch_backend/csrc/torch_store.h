#pragma once

// TorchStore: torch's c10d::Store (the prefixed store that
// init_process_group and new_group hand a backend) seen as a store::Store,
// so that libctorch_dist's groups keep their keys in the job's store under
// the torch group's own prefix.
//
// torch 1.13's store has no multi_get, multi_set or append: they are built
// here from get, set and compare_set (append is a compare-and-set loop, so
// concurrent appends to one key never lose each other). Tallies use the
// portable layout (store/store.h).
//
// Errors: torch's store throws c10::Error (DistStoreError on 2.x); a
// message that speaks of a timeout becomes a TimeoutError, any other an
// IoError, each naming the operation and key. Thread safety: as torch's
// store (TCPStore serialises its requests). interrupt() does nothing: calls
// end at their timeouts.

#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "store/store.h"

namespace ctorchrun::torch_backend {

class TorchStore : public store::Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store);

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  void append(const std::string& key, const std::string& value) override;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  int64_t tally_add(const std::string& key, const std::string& entry) override;
  int64_t tally_count(const std::string& key) override;
  std::vector<std::string> tally_entries(const std::string& key) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace ctorchrun::torch_backend

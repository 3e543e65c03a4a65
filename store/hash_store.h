#pragma once

// HashStore: an in-memory Store for one process (tests, single-node use).
// Same semantics as the TCP store; thread-safe; waits use a condition variable.

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/store.h"

namespace ctorchrun::store {

class HashStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  void append(const std::string& key, const std::string& value) override;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  int64_t tally_add(const std::string& key, const std::string& entry) override {
    return portable_tally::add(*this, key, entry);
  }
  int64_t tally_count(const std::string& key) override { return portable_tally::count(*this, key); }
  std::vector<std::string> tally_entries(const std::string& key) override {
    return portable_tally::entries(*this, key);
  }

 private:
  // Waits with mutex_ held (through `lock`) until every key exists.
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout);

  std::mutex mutex_;
  std::condition_variable changed_;
  std::unordered_map<std::string, std::string> map_;
};

}  // namespace ctorchrun::store

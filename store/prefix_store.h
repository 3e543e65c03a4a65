#pragma once

// PrefixStore: a view of another Store under a prefix, joined exactly as
// torch's c10d PrefixStore joins: prefix + "/" + key, always one '/' inserted
// (PrefixStore("a/") maps "k" to "a//k"). num_keys() is the whole store's.
// Shares ownership of the store it wraps; as thread-safe as that store.

#include <memory>
#include <string>
#include <vector>

#include "store/store.h"

namespace ctorchrun::store {

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

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
    return store_->tally_add(join(key), entry);
  }
  int64_t tally_count(const std::string& key) override { return store_->tally_count(join(key)); }
  std::vector<std::string> tally_entries(const std::string& key) override {
    return store_->tally_entries(join(key));
  }
  void interrupt() noexcept override { store_->interrupt(); }

  const std::string& prefix() const { return prefix_; }
  // The key the wrapped store sees for `key`.
  std::string join(const std::string& key) const { return prefix_ + "/" + key; }

 private:
  std::vector<std::string> join_all(const std::vector<std::string>& keys) const;

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace ctorchrun::store

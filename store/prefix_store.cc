#include "store/prefix_store.h"

#include <utility>

namespace ctorchrun::store {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : prefix_(std::move(prefix)), store_(std::move(store)) {
  timeout_ = store_->timeout();
}

std::vector<std::string> PrefixStore::join_all(const std::vector<std::string>& keys) const {
  std::vector<std::string> joined;
  joined.reserve(keys.size());
  for (const auto& k : keys) joined.push_back(join(k));
  return joined;
}

void PrefixStore::set(const std::string& key, const std::string& value) {
  store_->set(join(key), value);
}

std::string PrefixStore::get(const std::string& key) {
  // The wrapped store's own get() would use its timeout; ours may differ.
  std::string k = join(key);
  store_->wait({k}, timeout_);
  return store_->get(k);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return store_->add(join(key), delta);
}

std::string PrefixStore::compare_set(const std::string& key, const std::string& expected,
                                     const std::string& desired) {
  return store_->compare_set(join(key), expected, desired);
}

void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  store_->wait(join_all(keys), timeout);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  return store_->check(join_all(keys));
}

int64_t PrefixStore::num_keys() { return store_->num_keys(); }

bool PrefixStore::delete_key(const std::string& key) { return store_->delete_key(join(key)); }

void PrefixStore::append(const std::string& key, const std::string& value) {
  store_->append(join(key), value);
}

std::vector<std::string> PrefixStore::multi_get(const std::vector<std::string>& keys) {
  auto joined = join_all(keys);
  store_->wait(joined, timeout_);
  return store_->multi_get(joined);
}

void PrefixStore::multi_set(const std::vector<std::string>& keys,
                            const std::vector<std::string>& values) {
  store_->multi_set(join_all(keys), values);
}

}  // namespace ctorchrun::store

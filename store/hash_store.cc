#include "store/hash_store.h"

#include "common/error.h"
#include "store/protocol.h"
#include "store/store_errors.h"

namespace ctorchrun::store {

void HashStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    map_[key] = value;
  }
  changed_.notify_all();
}

std::string HashStore::get(const std::string& key) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, {key}, timeout_);
  return map_.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key);
    int64_t current = 0;
    if (it != map_.end()) {
      auto parsed = protocol::parse_int64_like_stoll(it->second);
      if (!parsed) throw Error(detail::non_integer_message(key, it->second));
      current = *parsed;
    }
    if (__builtin_add_overflow(current, delta, &result)) {
      throw Error("add('" + key + "', " + std::to_string(delta) + ") overflows int64");
    }
    map_[key] = std::to_string(result);
  }
  changed_.notify_all();
  return result;
}

std::string HashStore::compare_set(const std::string& key, const std::string& expected,
                                   const std::string& desired) {
  std::string result;
  bool stored = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      if (expected.empty()) {
        map_.emplace(key, desired);
        stored = true;
        result = desired;
      } else {
        result = expected;
      }
    } else if (it->second == expected) {
      it->second = desired;
      stored = true;
      result = desired;
    } else {
      result = it->second;
    }
  }
  if (stored) changed_.notify_all();
  return result;
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, keys, timeout);
}

void HashStore::wait_locked(std::unique_lock<std::mutex>& lock,
                            const std::vector<std::string>& keys,
                            std::chrono::milliseconds timeout) {
  auto all_present = [&] {
    for (const auto& k : keys) {
      if (map_.find(k) == map_.end()) return false;
    }
    return true;
  };
  if (!changed_.wait_for(lock, timeout, all_present)) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (map_.find(k) == map_.end()) missing.push_back(k);
    }
    throw TimeoutError(detail::wait_timeout_message("in-memory store", missing, timeout));
  }
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& k : keys) {
    if (map_.find(k) == map_.end()) return false;
  }
  return true;
}

int64_t HashStore::num_keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(map_.size());
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return map_.erase(key) > 0;
}

void HashStore::append(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    map_[key] += value;
  }
  changed_.notify_all();
}

std::vector<std::string> HashStore::multi_get(const std::vector<std::string>& keys) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, keys, timeout_);
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& k : keys) values.push_back(map_.at(k));
  return values;
}

void HashStore::multi_set(const std::vector<std::string>& keys,
                          const std::vector<std::string>& values) {
  detail::check_multi_set_sizes(keys, values);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < keys.size(); ++i) map_[keys[i]] = values[i];
  }
  changed_.notify_all();
}

}  // namespace ctorchrun::store

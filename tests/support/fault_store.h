#pragma once

// FaultStore: a store::Store that forwards to another and, on command, fails,
// delays or counts chosen calls (LevelDB's fault-injection Env idea). For
// tests of code that must survive a misbehaving store without sleeping
// through real timeouts. Thread-safe.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "store/store.h"

namespace ctorchrun::testing {

class FaultStore : public store::Store {
 public:
  enum class Op {
    kSet,
    kGet,
    kAdd,
    kCompareSet,
    kWait,
    kCheck,
    kNumKeys,
    kDelete,
    kAppend,
    kMultiGet,
    kMultiSet,
    kTallyAdd,
    kTallyRead
  };

  explicit FaultStore(std::shared_ptr<store::Store> inner) : inner_(std::move(inner)) {}

  // The next `n` calls of `op` throw IoError (n < 0: every call, until cleared).
  void fail(Op op, int n = -1) {
    std::lock_guard<std::mutex> lock(mutex_);
    failures_[op] = n;
  }
  // Every call of every operation throws IoError while `on`.
  void fail_all(bool on) { fail_all_ = on; }
  // Each call of `op` first sleeps `d`.
  void delay(Op op, std::chrono::milliseconds d) {
    std::lock_guard<std::mutex> lock(mutex_);
    delays_[op] = d;
  }
  // Every key a call named, in order (keys of every operation).
  std::vector<std::string> keys_seen() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return keys_;
  }
  void clear_keys_seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    keys_.clear();
  }

  void set(const std::string& key, const std::string& value) override {
    before(Op::kSet, {key});
    inner_->set(key, value);
  }
  std::string get(const std::string& key) override {
    before(Op::kGet, {key});
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    before(Op::kAdd, {key});
    return inner_->add(key, delta);
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    before(Op::kCompareSet, {key});
    return inner_->compare_set(key, expected, desired);
  }
  using store::Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    before(Op::kWait, keys);
    inner_->wait(keys, timeout);
  }
  bool check(const std::vector<std::string>& keys) override {
    before(Op::kCheck, keys);
    return inner_->check(keys);
  }
  int64_t num_keys() override {
    before(Op::kNumKeys, {});
    return inner_->num_keys();
  }
  bool delete_key(const std::string& key) override {
    before(Op::kDelete, {key});
    return inner_->delete_key(key);
  }
  void append(const std::string& key, const std::string& value) override {
    before(Op::kAppend, {key});
    inner_->append(key, value);
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    before(Op::kMultiGet, keys);
    return inner_->multi_get(keys);
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    before(Op::kMultiSet, keys);
    inner_->multi_set(keys, values);
  }
  int64_t tally_add(const std::string& key, const std::string& entry) override {
    before(Op::kTallyAdd, {key});
    return inner_->tally_add(key, entry);
  }
  int64_t tally_count(const std::string& key) override {
    before(Op::kTallyRead, {key});
    return inner_->tally_count(key);
  }
  std::vector<std::string> tally_entries(const std::string& key) override {
    before(Op::kTallyRead, {key});
    return inner_->tally_entries(key);
  }

 private:
  void before(Op op, const std::vector<std::string>& keys) {
    std::chrono::milliseconds d{0};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      keys_.insert(keys_.end(), keys.begin(), keys.end());
      if (auto it = delays_.find(op); it != delays_.end()) d = it->second;
    }
    if (d.count() > 0) std::this_thread::sleep_for(d);
    if (fail_all_) throw IoError("injected failure (every call)");
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = failures_.find(op);
    if (it == failures_.end() || it->second == 0) return;
    if (it->second > 0) --it->second;
    throw IoError("injected failure");
  }

  std::shared_ptr<store::Store> inner_;
  mutable std::mutex mutex_;
  std::map<Op, int> failures_;
  std::map<Op, std::chrono::milliseconds> delays_;
  std::atomic<bool> fail_all_{false};
  std::vector<std::string> keys_;
};

}  // namespace ctorchrun::testing

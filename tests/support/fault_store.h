#pragma once

// FaultStore: a store::Store that forwards to another and, on command, fails,
// delays or counts chosen calls, or deletes the keys a call named right after
// it (LevelDB's fault-injection Env idea). For
// tests of code that must survive a misbehaving store without sleeping
// through real timeouts. Thread-safe.
//
// BoundKeyStore: the keys one connection binds to itself (store/protocol.h's
// BIND_KEYS) over any Store, for tests without a TCP server: kill() does what
// the server does when the connection closes. Used by one thread at a time.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "store/protocol.h"
#include "store/store.h"

namespace ctorchrun::testing {

// What a waiting read (get, multi_get, wait) of a missing key throws when a
// FaultStore refuses such reads: the caller would have waited for the key up
// to the store's timeout. A TimeoutError, as the wait would end.
class WouldWaitError : public TimeoutError {
 public:
  explicit WouldWaitError(const std::string& key)
      : TimeoutError("a waiting read of the missing key '" + key +
                     "' (it would wait for the store's timeout)"),
        key_(key) {}
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

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
  // The next `n` calls of `op` whose key contains `key_part` (empty: any key)
  // reach the inner store, and then throw IoError: the answer is lost after
  // the write applied (a connection that drops before the reply).
  void lose_answer(Op op, int n = 1, std::string key_part = "") {
    std::lock_guard<std::mutex> lock(mutex_);
    lost_answers_[op] = {n, std::move(key_part)};
  }
  // How many answers were lost so far.
  int answers_lost() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return answers_lost_;
  }
  // While `on`, a get, multi_get or wait naming a key the inner store lacks
  // throws WouldWaitError at once instead of waiting: for single-threaded
  // simulations, where nobody could create the key meanwhile.
  void refuse_waiting_reads(bool on) { refuse_waiting_reads_ = on; }
  // The keys that waiting reads (get, multi_get) were refused for so far:
  // reads that would have waited for a key the inner store lacked.
  std::vector<std::string> refused_reads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return refused_reads_;
  }
  // The next `n` calls of `op` naming a key that contains `key_part` reach
  // the inner store, and then those keys are deleted there: a peer that
  // tidies them away between this call and the caller's next one.
  void vanish_after(Op op, std::string key_part, int n = 1) {
    std::lock_guard<std::mutex> lock(mutex_);
    vanish_[op] = {n, std::move(key_part)};
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
    after(Op::kSet, {key});
  }
  std::string get(const std::string& key) override {
    before(Op::kGet, {key});
    return after(Op::kGet, {key}, inner_->get(key));
  }
  int64_t add(const std::string& key, int64_t delta) override {
    before(Op::kAdd, {key});
    return after(Op::kAdd, {key}, inner_->add(key, delta));
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    before(Op::kCompareSet, {key});
    return after(Op::kCompareSet, {key}, inner_->compare_set(key, expected, desired));
  }
  using store::Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    before(Op::kWait, keys);
    inner_->wait(keys, timeout);
    after(Op::kWait, keys);
  }
  bool check(const std::vector<std::string>& keys) override {
    before(Op::kCheck, keys);
    return after(Op::kCheck, keys, inner_->check(keys));
  }
  int64_t num_keys() override {
    before(Op::kNumKeys, {});
    return after(Op::kNumKeys, {}, inner_->num_keys());
  }
  bool delete_key(const std::string& key) override {
    before(Op::kDelete, {key});
    return after(Op::kDelete, {key}, inner_->delete_key(key));
  }
  void append(const std::string& key, const std::string& value) override {
    before(Op::kAppend, {key});
    inner_->append(key, value);
    after(Op::kAppend, {key});
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    before(Op::kMultiGet, keys);
    return after(Op::kMultiGet, keys, inner_->multi_get(keys));
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    before(Op::kMultiSet, keys);
    inner_->multi_set(keys, values);
    after(Op::kMultiSet, keys);
  }
  int64_t tally_add(const std::string& key, const std::string& entry) override {
    before(Op::kTallyAdd, {key});
    return after(Op::kTallyAdd, {key}, inner_->tally_add(key, entry));
  }
  int64_t tally_count(const std::string& key) override {
    before(Op::kTallyRead, {key});
    return after(Op::kTallyRead, {key}, inner_->tally_count(key));
  }
  std::vector<std::string> tally_entries(const std::string& key) override {
    before(Op::kTallyRead, {key});
    return after(Op::kTallyRead, {key}, inner_->tally_entries(key));
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
    if (refuse_waiting_reads_ && (op == Op::kGet || op == Op::kMultiGet || op == Op::kWait)) {
      for (const auto& k : keys) {
        if (inner_->check({k})) continue;
        if (op != Op::kWait) {
          std::lock_guard<std::mutex> lock(mutex_);
          refused_reads_.push_back(k);
        }
        throw WouldWaitError(k);
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = failures_.find(op);
    if (it == failures_.end() || it->second == 0) return;
    if (it->second > 0) --it->second;
    throw IoError("injected failure");
  }
  // The call reached the inner store: its answer may be lost now.
  void after(Op op, const std::vector<std::string>& keys) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto v = vanish_.find(op); v != vanish_.end() && v->second.first != 0) {
      bool named = false;
      for (const auto& k : keys) {
        if (k.find(v->second.second) == std::string::npos) continue;
        named = true;
        inner_->delete_key(k);
      }
      if (named && v->second.first > 0) --v->second.first;
    }
    auto it = lost_answers_.find(op);
    if (it == lost_answers_.end() || it->second.first == 0) return;
    const std::string& part = it->second.second;
    if (!part.empty() && std::none_of(keys.begin(), keys.end(), [&](const std::string& k) {
          return k.find(part) != std::string::npos;
        })) {
      return;
    }
    if (it->second.first > 0) --it->second.first;
    ++answers_lost_;
    throw IoError("injected failure: the answer was lost after the call applied");
  }
  template <typename T>
  T after(Op op, const std::vector<std::string>& keys, T result) {
    after(op, keys);
    return result;
  }

  std::shared_ptr<store::Store> inner_;
  mutable std::mutex mutex_;
  std::map<Op, int> failures_;
  std::map<Op, std::chrono::milliseconds> delays_;
  std::map<Op, std::pair<int, std::string>> lost_answers_;  // (count, key part)
  std::map<Op, std::pair<int, std::string>> vanish_;        // (count, key part)
  std::vector<std::string> refused_reads_;
  int answers_lost_ = 0;
  std::atomic<bool> fail_all_{false};
  std::atomic<bool> refuse_waiting_reads_{false};
  std::vector<std::string> keys_;
};

class BoundKeyStore : public store::Store {
 public:
  explicit BoundKeyStore(std::shared_ptr<store::Store> inner) : inner_(std::move(inner)) {}

  // The connection closes: every bound key that still exists is deleted and
  // its gone marker (key + kGoneSuffix) set to "1". Later calls throw IoError.
  void kill() {
    if (closed_) return;
    closed_ = true;
    for (const auto& k : bound_) {
      if (inner_->delete_key(k)) inner_->set(k + store::protocol::kGoneSuffix, "1");
    }
    bound_.clear();
  }
  // The keys bound now, in the order they were created.
  const std::vector<std::string>& bound() const { return bound_; }

  void set(const std::string& key, const std::string& value) override {
    creating(key, [&] { inner_->set(key, value); });
  }
  std::string get(const std::string& key) override { return open()->get(key); }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t r = 0;
    creating(key, [&] { r = inner_->add(key, delta); });
    return r;
  }
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    std::string r;
    creating(key, [&] { r = inner_->compare_set(key, expected, desired); });
    return r;
  }
  using store::Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    open()->wait(keys, timeout);
  }
  bool check(const std::vector<std::string>& keys) override { return open()->check(keys); }
  int64_t num_keys() override { return open()->num_keys(); }
  bool delete_key(const std::string& key) override {
    // Deleting a bound key unbinds it: no marker when the connection closes.
    bound_.erase(std::remove(bound_.begin(), bound_.end(), key), bound_.end());
    return open()->delete_key(key);
  }
  void append(const std::string& key, const std::string& value) override {
    creating(key, [&] { inner_->append(key, value); });
  }
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    return open()->multi_get(keys);
  }
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    if (keys.size() != values.size())
      throw ConfigError("multi_set: keys and values differ in size");
    for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
  }
  int64_t tally_add(const std::string& key, const std::string& entry) override {
    return store::portable_tally::add(*this, key, entry);
  }
  int64_t tally_count(const std::string& key) override {
    return store::portable_tally::count(*this, key);
  }
  std::vector<std::string> tally_entries(const std::string& key) override {
    return store::portable_tally::entries(*this, key);
  }

 private:
  store::Store* open() {
    if (closed_) throw IoError("the connection is closed");
    return inner_.get();
  }
  // A key this call creates is bound, and its stale gone marker deleted.
  template <typename Fn>
  void creating(const std::string& key, Fn&& fn) {
    const bool existed = open()->check({key});
    fn();
    if (existed || !inner_->check({key})) return;
    bound_.push_back(key);
    inner_->delete_key(key + store::protocol::kGoneSuffix);
  }

  std::shared_ptr<store::Store> inner_;
  bool closed_ = false;
  std::vector<std::string> bound_;
};

}  // namespace ctorchrun::testing

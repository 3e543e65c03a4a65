#include "torch_backend/csrc/torch_store.h"

#include <utility>

#include "common/error.h"

namespace ctorchrun::torch_backend {
namespace {

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

// Runs one call of torch's store, turning its exceptions into ours.
template <typename F>
auto call(const char* what, const std::string& key, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    const std::string context =
        std::string("torch store ") + what + " '" + key + "' failed: " + message;
    if (message.find("imeout") != std::string::npos ||
        message.find("timed out") != std::string::npos) {
      throw TimeoutError(context);
    }
    throw IoError(context);
  }
}

}  // namespace

TorchStore::TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {
  set_timeout(store_->getTimeout());
}

void TorchStore::set(const std::string& key, const std::string& value) {
  call("set", key, [&] { store_->set(key, bytes(value)); });
}

std::string TorchStore::get(const std::string& key) {
  // torch's get waits its store's own timeout; ours is timeout().
  wait({key}, timeout());
  return call("get", key, [&] { return text(store_->get(key)); });
}

int64_t TorchStore::add(const std::string& key, int64_t delta) {
  return call("add", key, [&] { return store_->add(key, delta); });
}

std::string TorchStore::compare_set(const std::string& key, const std::string& expected,
                                    const std::string& desired) {
  return call("compare_set", key,
              [&] { return text(store_->compareSet(key, bytes(expected), bytes(desired))); });
}

void TorchStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  call("wait", keys.empty() ? std::string() : keys.front(), [&] { store_->wait(keys, timeout); });
}

bool TorchStore::check(const std::vector<std::string>& keys) {
  return call("check", keys.empty() ? std::string() : keys.front(),
              [&] { return store_->check(keys); });
}

int64_t TorchStore::num_keys() {
  return call("num_keys", "", [&] { return store_->getNumKeys(); });
}

bool TorchStore::delete_key(const std::string& key) {
  return call("delete_key", key, [&] { return store_->deleteKey(key); });
}

void TorchStore::append(const std::string& key, const std::string& value) {
  // compare_set with an empty expected value creates a missing key; a lost
  // race returns what another writer stored, and the loop tries again on it.
  // Bounded: each round, some writer's append went in.
  std::string current = store::read_if_present(*this, key).value_or("");
  for (;;) {
    const std::string desired = current + value;
    const std::string now = compare_set(key, current, desired);
    if (now == desired) return;
    current = now;
  }
}

std::vector<std::string> TorchStore::multi_get(const std::vector<std::string>& keys) {
  wait(keys, timeout());  // once for all: then each key is there to read
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (const auto& key : keys) {
    values.push_back(call("get", key, [&] { return text(store_->get(key)); }));
  }
  return values;
}

void TorchStore::multi_set(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw ConfigError("multi_set: " + std::to_string(keys.size()) + " keys but " +
                      std::to_string(values.size()) + " values");
  }
  for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
}

int64_t TorchStore::tally_add(const std::string& key, const std::string& entry) {
  return store::portable_tally::add(*this, key, entry);
}

int64_t TorchStore::tally_count(const std::string& key) {
  return store::portable_tally::count(*this, key);
}

std::vector<std::string> TorchStore::tally_entries(const std::string& key) {
  return store::portable_tally::entries(*this, key);
}

}  // namespace ctorchrun::torch_backend

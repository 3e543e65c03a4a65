#include "store/store.h"

#include "common/error.h"

namespace ctorchrun::store {

std::optional<std::string> read_if_present(Store& store, const std::string& key) {
  // No record, roster or marker of ours starts with a NUL byte.
  static constexpr char kMarker[] = "\0ctorchrun:absent\0";
  static const std::string kAbsent(kMarker, sizeof kMarker - 1);
  std::string v = store.compare_set(key, kAbsent, kAbsent);
  if (v == kAbsent) return std::nullopt;
  return v;
}

}  // namespace ctorchrun::store

namespace ctorchrun::store::portable_tally {

int64_t add(Store& store, const std::string& key, const std::string& entry) {
  if (entry.find(',') != std::string::npos)
    throw ConfigError("a tally entry holds no ',' (key '" + key + "')");
  // The entry goes first: whoever reads count N finds N entries listed.
  if (!entry.empty()) store.append(key, entry + ",");
  return store.add(key + kCountSuffix, 1);
}

int64_t count(Store& store, const std::string& key) { return store.add(key + kCountSuffix, 0); }

std::vector<std::string> entries(Store& store, const std::string& key) {
  if (!store.check({key})) return {};
  const std::string raw = store.get(key);
  std::vector<std::string> out;
  size_t at = 0;
  while (at < raw.size()) {
    size_t comma = raw.find(',', at);
    if (comma == std::string::npos) comma = raw.size();
    out.push_back(raw.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

}  // namespace ctorchrun::store::portable_tally

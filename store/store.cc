#include "store/store.h"

#include "common/error.h"

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

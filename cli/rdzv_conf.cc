#include "cli/rdzv_conf.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "common/error.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::cli {

namespace {

using agent::LaunchConfig;

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Bounds as written in --help: whole numbers without a fraction.
std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

std::string range_text(const RdzvConfKey& k) {
  if (k.type == RdzvConfType::kBool) return "true/false (torch)";
  return std::string(k.min_exclusive ? "(" : "[") + number_text(k.min) + ", " + number_text(k.max) +
         "]";
}

const char* type_text(RdzvConfType t) {
  switch (t) {
    case RdzvConfType::kSeconds:
      return "seconds";
    case RdzvConfType::kInteger:
      return "integer";
    case RdzvConfType::kBool:
      return "bool";
  }
  return "";
}

std::vector<RdzvConfKey> make_table() {
  const store::ServerOptions server;  // the hosted store's defaults, written once there
  static const std::string key_bytes = std::to_string(server.limits.max_key_bytes);
  static const std::string value_bytes = std::to_string(server.limits.max_value_bytes);
  static const std::string keys_per_op = std::to_string(server.limits.max_keys_per_op);
  static const std::string connections = std::to_string(server.max_connections);
  constexpr double kMaxBytes = 1ull << 32;  // 4 GiB: one value held in memory
  return {
      {"timeout", RdzvConfType::kSeconds, 0, false, kMaxSeconds, "900", "static",
       "how long the rendezvous waits for every node",
       [](LaunchConfig& c, double v) { c.rdzv_timeout = seconds_to_ms(v); }},
      {"join_timeout", RdzvConfType::kSeconds, 0, false, kMaxSeconds, "600", "c10d, etcd-v3",
       "how long a node waits to join a round",
       [](LaunchConfig& c, double v) { c.join_timeout = seconds_to_ms(v); }},
      {"last_call_timeout", RdzvConfType::kSeconds, 0, false, kMaxSeconds, "30", "c10d, etcd-v3",
       "extra wait for late nodes once min nodes have joined",
       [](LaunchConfig& c, double v) { c.last_call_timeout = seconds_to_ms(v); }},
      {"close_timeout", RdzvConfType::kSeconds, 0, false, kMaxSeconds, "30", "c10d, etcd-v3",
       "wait for a closed rendezvous to be seen by every node",
       [](LaunchConfig& c, double v) { c.close_timeout = seconds_to_ms(v); }},
      {"read_timeout", RdzvConfType::kSeconds, 0, false, kMaxSeconds, "60", "c10d, etcd-v3",
       "bound on one operation on the rendezvous store",
       [](LaunchConfig& c, double v) { c.read_timeout = seconds_to_ms(v); }},
      {"is_host", RdzvConfType::kBool, 0, false, 1, "from the endpoint", "c10d",
       "whether this node hosts the rendezvous store",
       [](LaunchConfig& c, double v) { c.is_host = v != 0; }},
      {"keep_alive_interval", RdzvConfType::kSeconds, 0, true, kMaxSeconds, "5",
       "static, c10d, etcd-v3", "seconds between a node's heartbeats",
       [](LaunchConfig& c, double v) { c.keep_alive_interval = seconds_to_ms(v); }},
      {"keep_alive_max_attempt", RdzvConfType::kInteger, 1, false, 1'000'000, "3",
       "static, c10d, etcd-v3", "heartbeats missed before a node is lost",
       [](LaunchConfig& c, double v) { c.keep_alive_max_attempt = static_cast<int>(v); }},
      {"node_timeout", RdzvConfType::kSeconds, 0, true, kMaxSeconds, "interval*attempts",
       "static, c10d, etcd-v3",
       "silence after which a node is lost (overrides the two keep_alive keys)",
       [](LaunchConfig& c, double v) { c.node_timeout = seconds_to_ms(v); }},
      {"store_max_key_bytes", RdzvConfType::kInteger, 1, false, 16 << 20, key_bytes.c_str(),
       "static, c10d, etcd-v3", "longest key the hosted store accepts",
       [](LaunchConfig& c, double v) { c.store_max_key_bytes = static_cast<uint64_t>(v); }},
      {"store_max_value_bytes", RdzvConfType::kInteger, 1, false, kMaxBytes, value_bytes.c_str(),
       "static, c10d, etcd-v3", "longest value the hosted store accepts",
       [](LaunchConfig& c, double v) { c.store_max_value_bytes = static_cast<uint64_t>(v); }},
      {"store_max_request_bytes", RdzvConfType::kInteger, 1, false, 2 * kMaxBytes, "the store's",
       "static, c10d, etcd-v3", "largest request the hosted store accepts (>= key + value limits)",
       [](LaunchConfig& c, double v) { c.store_max_request_bytes = static_cast<uint64_t>(v); }},
      {"store_max_keys_per_op", RdzvConfType::kInteger, 1, false, 16 << 20, keys_per_op.c_str(),
       "static, c10d, etcd-v3", "most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET",
       [](LaunchConfig& c, double v) { c.store_max_keys_per_op = static_cast<uint64_t>(v); }},
      {"store_max_connections", RdzvConfType::kInteger, 1, false, 1 << 20, connections.c_str(),
       "static, c10d, etcd-v3", "most client connections the hosted store keeps open",
       [](LaunchConfig& c, double v) { c.store_max_connections = static_cast<uint64_t>(v); }},
  };
}

bool parse_integer(const std::string& text, double* value) {
  long long n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return false;
  *value = static_cast<double>(n);
  return true;
}

bool parse_bool(const std::string& text, double* value) {
  const std::string v = lower(text);
  if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y") {
    *value = 1;
    return true;
  }
  if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n") {
    *value = 0;
    return true;
  }
  return false;
}

bool in_range(const RdzvConfKey& k, double v) {
  return (k.min_exclusive ? v > k.min : v >= k.min) && v <= k.max;
}

bool backend_reads(const RdzvConfKey& k, const std::string& backend) {
  std::stringstream ss(k.backends);
  std::string b;
  while (std::getline(ss, b, ',')) {
    if (trim(b) == backend) return true;
  }
  return false;
}

// Quotes a shell would have removed: a Kubernetes args: array or a YAML file
// hands --rdzv_conf='k=v,...' over with them. One pair of matching quotes
// around the whole text, a key or a value is dropped.
std::string unquote(std::string s) {
  s = trim(s);
  if (s.size() >= 2 && (s.front() == '\'' || s.front() == '"') && s.back() == s.front()) {
    s = trim(s.substr(1, s.size() - 2));
  }
  return s;
}

// "KEY=VALUE,KEY=VALUE" as (key, value) pairs in the order first given, a
// later value of a key winning; empty items are skipped.
std::vector<std::pair<std::string, std::string>> split_pairs(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> pairs;
  std::stringstream ss(unquote(text));
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (trim(item).empty()) continue;
    auto eq = item.find('=');
    std::string key = unquote(item.substr(0, eq));
    if (eq == std::string::npos || key.empty()) {
      throw ConfigError("--rdzv_conf: '" + item + "' is not KEY=VALUE");
    }
    std::string value = unquote(item.substr(eq + 1));
    auto same = std::find_if(pairs.begin(), pairs.end(), [&](auto& p) { return p.first == key; });
    if (same == pairs.end()) {
      pairs.emplace_back(key, value);
    } else {
      same->second = value;
    }
  }
  return pairs;
}

// A value of a table key, checked against its type and range.
double parse_value(const RdzvConfKey& k, const std::string& value) {
  double v = 0;
  bool ok = false;
  switch (k.type) {
    case RdzvConfType::kSeconds:
      ok = parse_seconds(value, k.min, k.min_exclusive, k.max, &v);
      break;
    case RdzvConfType::kInteger:
      ok = parse_integer(value, &v) && in_range(k, v);
      break;
    case RdzvConfType::kBool:
      ok = parse_bool(value, &v);
      break;
  }
  if (!ok) {
    std::string expected =
        k.type == RdzvConfType::kBool
            ? "a boolean (1, true, t, yes, y or 0, false, f, no, n)"
            : std::string(k.type == RdzvConfType::kSeconds ? "decimal seconds" : "an integer") +
                  " in " + range_text(k);
    throw ConfigError("--rdzv_conf " + std::string(k.name) + "='" + value + "': expected " +
                      expected);
  }
  return v;
}

// etcd-v3's key prefix.
void apply_etcd_prefix(const std::string& value, agent::LaunchConfig* config) {
  if (value.empty() || value[0] != '/' || value.size() > 256 ||
      value.find_first_of(" \t\n") != std::string::npos) {
    throw ConfigError("--rdzv_conf etcd_prefix='" + value +
                      "': expected a key prefix starting with '/' (at most 256 characters, "
                      "no blanks)");
  }
  config->etcd_prefix =
      value.size() > 1 && value.back() == '/' ? value.substr(0, value.size() - 1) : value;
}

// torch 2.x's c10d reads store_type: tcp (its default) or file (a FileStore
// at a path given as the endpoint). Every store ctorchrun hosts or joins is a
// TCP store, so tcp is taken silently by every backend.
void check_store_type(const std::string& value) {
  const std::string t = lower(value);
  if (t == "file") {
    throw ConfigError(
        "--rdzv_conf store_type=file: ctorchrun's rendezvous store is a TCP store at "
        "--rdzv_endpoint HOST:PORT; torch's file store is not supported (give tcp or leave "
        "store_type out)");
  }
  if (t != "tcp") {
    throw ConfigError("--rdzv_conf store_type='" + value +
                      "': expected tcp (torch's file store is not supported)");
  }
}

// etcd-v3's TLS keys, under torch's names and the other usual spellings; the
// command line checks them against the endpoints' schemes.
void apply_tls_key(const std::string& key, const std::string& value, agent::LaunchConfig* config) {
  std::string* file = nullptr;
  if (key == "cacert" || key == "ca_cert") file = &config->etcd_cacert;
  if (key == "cert" || key == "ssl_cert") file = &config->etcd_cert;
  if (key == "key" || key == "ssl_cert_key") file = &config->etcd_key;
  if (file) {
    if (value.empty()) {
      throw ConfigError("--rdzv_conf " + key + "='': expected the path of a PEM file");
    }
    *file = value;
    return;
  }
  const std::string p = lower(value);
  if (p != "http" && p != "https") {
    throw ConfigError("--rdzv_conf protocol='" + value + "': expected http or https");
  }
  config->etcd_protocol = p;
}

// The text keys, which are not in the table: true when `key` is one of them.
// etcd-v3's keys under another backend are a warning, their values unchecked.
bool apply_text_key(const std::string& key, const std::string& value, const std::string& backend,
                    agent::LaunchConfig* config, std::vector<std::string>* warnings) {
  if (key == "store_type") {
    check_store_type(value);
    return true;
  }
  static const char* const kEtcdKeys[] = {"etcd_prefix", "protocol", "cacert", "ca_cert",
                                          "cert",        "ssl_cert", "key",    "ssl_cert_key"};
  if (std::find(std::begin(kEtcdKeys), std::end(kEtcdKeys), key) == std::end(kEtcdKeys)) {
    return false;
  }
  if (backend != "etcd-v3") {
    warnings->push_back("--rdzv_conf: key '" + key + "' is read by the etcd-v3 backend, not by " +
                        backend + "; ignored");
  } else if (key == "etcd_prefix") {
    apply_etcd_prefix(value, config);
  } else {
    apply_tls_key(key, value, config);
  }
  return true;
}

// The hosted store's request cap holds at least one largest key and value.
void check_request_limit(const agent::LaunchConfig& config) {
  if (!config.store_max_request_bytes) return;
  const store::ServerOptions server;
  uint64_t key_limit = config.store_max_key_bytes.value_or(server.limits.max_key_bytes);
  uint64_t value_limit = config.store_max_value_bytes.value_or(server.limits.max_value_bytes);
  if (*config.store_max_request_bytes < key_limit + value_limit) {
    throw ConfigError(
        "--rdzv_conf store_max_request_bytes=" + std::to_string(*config.store_max_request_bytes) +
        ": must be at least store_max_key_bytes + store_max_value_bytes (" +
        std::to_string(key_limit + value_limit) + ")");
  }
}

}  // namespace

const std::vector<RdzvConfKey>& rdzv_conf_keys() {
  static const std::vector<RdzvConfKey> table = make_table();
  return table;
}

bool parse_seconds(const std::string& text, double min, bool min_exclusive, double max,
                   double* seconds) {
  double d = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return false;
  if (!std::isfinite(d) || (min_exclusive ? !(d > min) : !(d >= min)) || d > max) return false;
  *seconds = d;
  return true;
}

std::chrono::milliseconds seconds_to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

void apply_rdzv_conf(const std::string& text, const std::string& backend,
                     agent::LaunchConfig* config, std::vector<std::string>* warnings) {
  bool node_timeout_given = false;
  for (const auto& [key, value] : split_pairs(text)) {
    config->rdzv_conf[key] = value;
    if (apply_text_key(key, value, backend, config, warnings)) continue;
    const auto& table = rdzv_conf_keys();
    auto k = std::find_if(table.begin(), table.end(),
                          [&](const RdzvConfKey& e) { return key == e.name; });
    if (k == table.end()) {
      std::string known;
      for (const auto& e : table) known += std::string(known.empty() ? "" : ", ") + e.name;
      warnings->push_back("--rdzv_conf: unknown key '" + key + "' ignored (known: " + known + ")");
      continue;
    }
    if (key == "timeout" && (backend == "c10d" || backend == "etcd-v3")) {
      warnings->push_back(
          "--rdzv_conf: key 'timeout' is the static backend's; under c10d, join_timeout says how "
          "long a node waits for a round to include it; ignored");
      continue;
    }
    if (!backend_reads(*k, backend)) {
      const bool several = std::string(k->backends).find(',') != std::string::npos;
      warnings->push_back("--rdzv_conf: key '" + key + "' is read by the " + k->backends +
                          (several ? " backends" : " backend") + ", not by " + backend +
                          "; ignored");
      continue;
    }
    k->apply(*config, parse_value(*k, value));
    if (key == "node_timeout") node_timeout_given = true;
  }
  if (!node_timeout_given) {
    config->node_timeout = config->keep_alive_interval * config->keep_alive_max_attempt;
  }
  check_request_limit(*config);
}

std::string rdzv_conf_help() {
  std::string out =
      "--rdzv_conf=KEY=VALUE,... keys. Seconds are decimal; booleans are 1/true/t/yes/y or\n"
      "0/false/f/no/n; a bad value ends the launch (exit 2); an unknown key, or one the\n"
      "backend does not read, is a warning. Quotes a shell would have removed (a Kubernetes\n"
      "args: entry --rdzv_conf='join_timeout=5,timeout=5') are dropped: one pair of matching\n"
      "' or \" around the whole value, a key or a value.\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %-24s %-8s %-20s %-18s %-8s %s\n", "key", "type", "range",
                "default", "backends", "meaning");
  out += line;
  for (const auto& k : rdzv_conf_keys()) {
    std::snprintf(line, sizeof line, "  %-24s %-8s %-20s %-18s %-8s %s\n", k.name,
                  type_text(k.type), range_text(k).c_str(), k.default_text, k.backends, k.help);
    out += line;
  }
  // The text keys of the etcd backend (read by the CLI, not in the table).
  struct TextRow {
    const char *name, *type, *range, *default_text, *backends, *help;
  };
  static const TextRow text_rows[] = {
      {"store_type", "text", "tcp", "tcp", "all",
       "torch 2.x's key, taken silently: every store is TCP (file is exit 2)"},
      {"etcd_prefix", "text", "starts with /", "/ctorchrun", "etcd-v3",
       "where the rendezvous keys live in etcd"},
      {"protocol", "text", "http, https", "from the endpoints", "etcd-v3",
       "https: TLS with the members (as https:// endpoints do)"},
      {"cacert", "path", "a PEM file", "system trust store", "etcd-v3",
       "CA of the members' certificates (also ca_cert)"},
      {"cert", "path", "a PEM file", "none", "etcd-v3",
       "client certificate for mutual TLS, with key (also ssl_cert)"},
      {"key", "path", "a PEM file", "none", "etcd-v3",
       "the client certificate's key (also ssl_cert_key)"},
  };
  for (const auto& r : text_rows) {
    std::snprintf(line, sizeof line, "  %-24s %-8s %-20s %-18s %-8s %s\n", r.name, r.type, r.range,
                  r.default_text, r.backends, r.help);
    out += line;
  }
  return out;
}

}  // namespace ctorchrun::cli

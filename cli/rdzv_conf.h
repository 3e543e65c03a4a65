#pragma once

// The --rdzv_conf keys: one table of every key ctorchrun knows, with its type,
// accepted range, default and the rendezvous backends that read it. The
// command line validates KEY=VALUE pairs against it before anything starts;
// --help and the README print it.

#include <string>
#include <vector>

#include "agent/launch_config.h"

namespace ctorchrun::cli {

enum class RdzvConfType {
  kSeconds,  // decimal seconds ("2", "0.5"), stored as milliseconds
  kInteger,  // a whole number
  kBool,     // torch's set: 1/true/t/yes/y and 0/false/f/no/n, any case
};

struct RdzvConfKey {
  const char* name;
  RdzvConfType type;
  double min;
  bool min_exclusive;  // liveness keys must be > min, the others >= min
  double max;
  const char* default_text;  // as --help shows it
  const char* backends;      // the backends that read it, comma-separated
  const char* help;
  // Stores the validated value (a bool as 0 or 1) in its typed field.
  void (*apply)(agent::LaunchConfig& config, double value);
};

// Every key, in the order --help lists them.
const std::vector<RdzvConfKey>& rdzv_conf_keys();

// Parses "KEY=VALUE,KEY=VALUE" into config's typed rendezvous fields (and
// keeps the pairs as given in config->rdzv_conf). Later pairs win; empty items
// are skipped; one pair of matching quotes (' or ") around the whole text, a
// key or a value is dropped, as a shell would have. A pair that is not
// KEY=VALUE, or a value outside the type or range of a key `backend` reads,
// throws ConfigError naming the key, the value and the range. An unknown key,
// or one that `backend` does not read, adds one line to `warnings` and is
// otherwise ignored, its value unchecked. torch 2.x's store_type=tcp is taken
// silently by every backend; store_type=file (or anything else) throws.
void apply_rdzv_conf(const std::string& text, const std::string& backend,
                     agent::LaunchConfig* config, std::vector<std::string>* warnings);

// The table as text for --help: one line per key.
std::string rdzv_conf_help();

// Parses decimal seconds in [min, max] (min excluded when `min_exclusive`);
// false for anything else (text, NaN, infinity, out of range).
bool parse_seconds(const std::string& text, double min, bool min_exclusive, double max,
                   double* seconds);

// Seconds to whole milliseconds, rounded to nearest.
std::chrono::milliseconds seconds_to_ms(double seconds);

// The upper bound of every duration: one year, in seconds.
constexpr double kMaxSeconds = 31'536'000;

}  // namespace ctorchrun::cli

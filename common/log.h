#pragma once

// One named spdlog logger per layer ("cli", "agent", "rdzv", "store", "worker",
// "coll"). Libraries fetch their logger here and never configure spdlog; only
// the executables' main() sets sinks, pattern and level.

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace ctorchrun {

// Returns the logger named `name`, creating it (stderr sink, the project's
// pattern) on first use. Thread-safe.
std::shared_ptr<spdlog::logger> get_logger(const std::string& name);

// The pattern every ctorchrun logger uses.
inline constexpr const char* kLogPattern = "[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] [pid %P] %v";

// Configures logging for an executable: pattern, and the level from torchrun's
// LOGLEVEL (DEBUG, INFO, WARNING, ERROR, CRITICAL) or spdlog's SPDLOG_LEVEL.
// `default_level` applies when neither is set. Call once from main().
void setup_logging(spdlog::level::level_enum default_level);

// Makes every logger, existing and created later, write to `sink` instead of
// stderr (the launcher routes its log lines through its non-blocking console
// queue, worker/console.h). Call from main(), before threads log.
void set_log_sink(std::shared_ptr<spdlog::sinks::sink> sink);

}  // namespace ctorchrun

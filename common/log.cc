#include "common/log.h"

#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace ctorchrun {

namespace {
std::mutex g_mutex;
spdlog::level::level_enum g_level = spdlog::level::info;
std::shared_ptr<spdlog::sinks::sink> g_sink;  // null: stderr
}  // namespace

std::shared_ptr<spdlog::logger> get_logger(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto existing = spdlog::get(name)) return existing;
  // Plain (unsynchronised-colour) stderr sink: our lines never interleave with
  // worker output on stdout, and the pattern stays machine-readable.
  std::shared_ptr<spdlog::sinks::sink> sink = g_sink;
  if (!sink) sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>(name, std::move(sink));
  logger->set_pattern(kLogPattern);
  logger->set_level(g_level);
  logger->flush_on(spdlog::level::info);
  spdlog::register_logger(logger);
  return logger;
}

void setup_logging(spdlog::level::level_enum default_level) {
  spdlog::level::level_enum level = default_level;
  if (const char* env = std::getenv("LOGLEVEL")) {
    std::string v(env);
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::toupper(c); });
    if (v == "DEBUG")
      level = spdlog::level::debug;
    else if (v == "INFO")
      level = spdlog::level::info;
    else if (v == "WARNING" || v == "WARN")
      level = spdlog::level::warn;
    else if (v == "ERROR")
      level = spdlog::level::err;
    else if (v == "CRITICAL" || v == "FATAL")
      level = spdlog::level::critical;
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_level = level;
  }
  spdlog::set_pattern(kLogPattern);
  spdlog::set_level(level);
  spdlog::apply_all([level](const std::shared_ptr<spdlog::logger>& l) { l->set_level(level); });
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL overrides per logger
}

void set_log_sink(std::shared_ptr<spdlog::sinks::sink> sink) {
  sink->set_pattern(kLogPattern);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_sink = sink;
  spdlog::apply_all([&sink](const std::shared_ptr<spdlog::logger>& l) {
    l->sinks().clear();
    l->sinks().push_back(sink);
  });
}

}  // namespace ctorchrun

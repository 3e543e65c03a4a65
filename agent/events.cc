#include "agent/events.h"

#include <chrono>
#include <ctime>

#include "common/error.h"
#include "common/json_text.h"
#include "common/log.h"
#include "worker/console.h"

namespace ctorchrun::agent {

std::string rfc3339_now() {
  auto now = std::chrono::system_clock::now();
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", static_cast<int>(ms));
  return buf;
}

EventLog::EventLog(const std::string& path, std::string run_id, int node_rank, bool console)
    : run_id_(std::move(run_id)), node_rank_(node_rank), to_console_(console) {
  if (path.empty()) return;
  out_.open(path, std::ios::app);
  if (!out_) throw ConfigError("--events_file: cannot open '" + path + "' for appending");
  to_file_ = true;
}

void EventLog::emit(const std::string& event, int attempt, nlohmann::json fields) {
  if (!to_file_ && !to_console_) return;
  nlohmann::json j = {{"time", rfc3339_now()},
                      {"event", event},
                      {"run_id", run_id_},
                      {"node_rank", node_rank_},
                      {"attempt", attempt}};
  for (auto& [k, v] : fields.items()) j[k] = v;
  const std::string line = json_text::dump_record(j);
  if (to_console_) worker::Console::write(2, line + "\n");
  if (!to_file_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  out_ << line << '\n';
  out_.flush();
  if (!out_ && !failed_) {
    failed_ = true;
    get_logger("agent")->warn("writing the events file failed; further events are lost");
  }
}

}  // namespace ctorchrun::agent

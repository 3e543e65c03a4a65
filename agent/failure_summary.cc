#include "agent/failure_summary.h"

#include <signal.h>
#include <string.h>

#include <algorithm>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "worker/launcher.h"

namespace ctorchrun::agent {

using worker::signal_name;

namespace {

constexpr const char* kNoTraceback =
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html";

std::string format_time(int64_t t) {
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  localtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

std::string indent(const std::string& s) {
  std::string out;
  for (char ch : s) {
    out.push_back(ch);
    if (ch == '\n') out += "  ";
  }
  return out;
}

std::string format_one(size_t idx, const FailureRecord& f) {
  std::ostringstream os;
  os << "[" << idx << "]:\n"
     << "  time      : " << format_time(f.timestamp) << "\n"
     << "  host      : " << f.host << "\n"
     << "  rank      : " << f.rank << " (local_rank: " << f.local_rank << ")\n"
     << "  exitcode  : " << f.torch_exitcode() << " (pid: " << f.pid << ")\n"
     << "  error_file: " << (f.error_file.empty() ? "<N/A>" : f.error_file) << "\n"
     << "  traceback : " << indent(f.message);
  return os.str();
}

}  // namespace

std::string FailureRecord::cause() const {
  if (signaled) return "signal " + std::to_string(signal) + " (" + signal_name(signal) + ")";
  return "exit code " + std::to_string(exit_code);
}

std::string FailureRecord::to_json() const {
  nlohmann::json j = {{"rank", rank},
                      {"local_rank", local_rank},
                      {"node_rank", node_rank},
                      {"host", host},
                      {"pid", pid},
                      {"signaled", signaled},
                      {"exit_code", exit_code},
                      {"signal", signal},
                      {"timestamp", timestamp},
                      {"noticed_ns", noticed_ns},
                      {"error_file", error_file},
                      {"message", message},
                      {"attempt", attempt}};
  return j.dump();
}

FailureRecord FailureRecord::from_json(const std::string& json) {
  auto j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_object()) throw ProtocolError("unreadable failure record: " + json.substr(0, 200));
  FailureRecord f;
  f.rank = j.value("rank", -1);
  f.local_rank = j.value("local_rank", -1);
  f.node_rank = j.value("node_rank", -1);
  f.host = j.value("host", std::string());
  f.pid = j.value("pid", 0);
  f.signaled = j.value("signaled", false);
  f.exit_code = j.value("exit_code", 0);
  f.signal = j.value("signal", 0);
  f.timestamp = j.value("timestamp", int64_t{0});
  f.noticed_ns = j.value("noticed_ns", int64_t{0});
  f.error_file = j.value("error_file", std::string());
  f.message = j.value("message", std::string());
  f.attempt = j.value("attempt", 0);
  return f;
}

void read_error_file(const std::string& path, FailureRecord* record) {
  if (record->message.empty()) {
    record->message = record->signaled ? "Signal " + std::to_string(record->signal) + " (" +
                                             signal_name(record->signal) + ") received by PID " +
                                             std::to_string(record->pid)
                                       : kNoTraceback;
  }
  std::ifstream in(path);
  if (!in) return;
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (!j.is_object() || !j.contains("message")) return;
  record->error_file = path;
  const auto& m = j["message"];
  auto to_int = [](const nlohmann::json& v) -> int64_t {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_string()) {
      try {
        return std::stoll(v.get<std::string>());
      } catch (const std::exception&) {
      }
    }
    return 0;
  };
  if (m.is_object()) {
    std::string text = m.value("message", std::string());
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto& extra = m["extraInfo"];
      if (extra.contains("py_callstack") && extra["py_callstack"].is_string()) {
        text = extra["py_callstack"].get<std::string>();
      }
      if (extra.contains("timestamp")) {
        if (int64_t t = to_int(extra["timestamp"])) record->timestamp = t;
      }
    }
    if (!text.empty()) record->message = text;
  } else if (m.is_string()) {
    record->message = m.get<std::string>();
    if (j.contains("timestamp")) {
      if (int64_t t = to_int(j["timestamp"])) record->timestamp = t;
    }
  }
}

std::string format_failure_summary(const std::string& entrypoint_name,
                                   std::vector<FailureRecord> failures) {
  std::stable_sort(
      failures.begin(), failures.end(),
      [](const FailureRecord& a, const FailureRecord& b) { return a.earlier_than(b); });
  const std::string sep(60, '=');
  const std::string line(60, '-');
  std::ostringstream os;
  os << sep << "\n" << entrypoint_name << " FAILED\n" << line << "\nFailures:\n";
  if (failures.size() == 1) {
    os << "  <NO_OTHER_FAILURES>\n";
  } else {
    for (size_t i = 1; i < failures.size(); ++i) os << format_one(i, failures[i]) << "\n";
  }
  os << line << "\nRoot Cause (first observed failure):\n"
     << format_one(0, failures[0]) << "\n"
     << sep << "\n";
  return os.str();
}

}  // namespace ctorchrun::agent

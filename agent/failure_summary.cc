#include "agent/failure_summary.h"

#include <signal.h>
#include <string.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "common/error.h"
#include "common/json_text.h"
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

// Python's len() of a line: its code points (a byte that is not valid UTF-8
// counts as one, as Python's surrogateescape decoding makes it).
size_t code_points(const std::string& s, size_t begin, size_t end) {
  size_t n = 0;
  for (size_t i = begin; i < end; ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) ++n;
  }
  return n;
}

// The widest line of `s`, in code points.
size_t widest_line(const std::string& s) {
  size_t width = 0;
  size_t begin = 0;
  for (;;) {
    size_t end = s.find('\n', begin);
    if (end == std::string::npos) end = s.size();
    width = std::max(width, code_points(s, begin, end));
    if (end == s.size()) return width;
    begin = end + 1;
  }
}

// torch's summary, exitcode line (torch main):
//   "  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}"
// where signal_name is " (SIGSEGV)" for a signal Python names and "" otherwise:
// two spaces before a signal's name, one trailing space without one.
std::string format_one(size_t idx, const FailureRecord& f) {
  const std::string name = f.signaled ? torch_signal_name(f.signal) : "";
  std::ostringstream os;
  os << "[" << idx << "]:\n"
     << "  time      : " << format_time(f.timestamp) << "\n"
     << "  host      : " << f.host << "\n"
     << "  rank      : " << f.rank << " (local_rank: " << f.local_rank << ")\n"
     << "  exitcode  : " << f.torch_exitcode() << " (pid: " << f.pid << ") "
     << (name.empty() ? "" : " (" + name + ")") << "\n"
     << "  error_file: " << (f.error_file.empty() ? "<N/A>" : f.error_file) << "\n"
     << "  traceback : " << f.message;
  return os.str();
}

}  // namespace

std::string torch_signal_name(int sig) {
  // signal.Signals(sig).name of CPython on Linux: the canonical name of each
  // number (SIGABRT, not SIGIOT; SIGIO, not SIGPOLL), and of the real-time
  // signals only SIGRTMIN and SIGRTMAX.
  static const char* const kNames[] = {
      nullptr,     "SIGHUP",  "SIGINT",    "SIGQUIT", "SIGILL",   "SIGTRAP", "SIGABRT", "SIGBUS",
      "SIGFPE",    "SIGKILL", "SIGUSR1",   "SIGSEGV", "SIGUSR2",  "SIGPIPE", "SIGALRM", "SIGTERM",
      "SIGSTKFLT", "SIGCHLD", "SIGCONT",   "SIGSTOP", "SIGTSTP",  "SIGTTIN", "SIGTTOU", "SIGURG",
      "SIGXCPU",   "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO",   "SIGPWR",  "SIGSYS"};
  if (sig > 0 && sig < static_cast<int>(sizeof kNames / sizeof kNames[0])) return kNames[sig];
  if (sig == SIGRTMIN) return "SIGRTMIN";
  if (sig == SIGRTMAX) return "SIGRTMAX";
  return "";
}

std::string FailureRecord::cause() const {
  if (hang) return "hang";
  if (uninterruptible) return "uninterruptible sleep (D state)";
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
                      {"attempt", attempt},
                      {"hang", hang},
                      {"uninterruptible", uninterruptible}};
  return json_text::dump_record(j);
}

namespace {

// Typed fields of an untrusted JSON object: a missing key gives the default, a
// present key of the wrong type is a ProtocolError naming it.
int64_t int_field(const nlohmann::json& j, const char* key, int64_t def, const char* what) {
  auto it = j.find(key);
  if (it == j.end()) return def;
  if (!it->is_number_integer()) {
    throw ProtocolError(std::string(what) + ": key '" + key + "' is not an integer: " +
                        json_text::utf8_prefix(json_text::dump_for_people(*it), 80));
  }
  return it->get<int64_t>();
}

std::string string_field(const nlohmann::json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end()) return {};
  if (!it->is_string()) {
    throw ProtocolError(std::string(what) + ": key '" + key + "' is not a string: " +
                        json_text::utf8_prefix(json_text::dump_for_people(*it), 80));
  }
  return it->get<std::string>();
}

bool bool_field(const nlohmann::json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end()) return false;
  if (!it->is_boolean()) {
    throw ProtocolError(std::string(what) + ": key '" + key + "' is not a boolean: " +
                        json_text::utf8_prefix(json_text::dump_for_people(*it), 80));
  }
  return it->get<bool>();
}

int int32_field(const nlohmann::json& j, const char* key, int def, const char* what) {
  int64_t v = int_field(j, key, def, what);
  if (v < INT32_MIN || v > INT32_MAX) {
    throw ProtocolError(std::string(what) + ": key '" + key +
                        "' is out of range: " + std::to_string(v));
  }
  return static_cast<int>(v);
}

// A timestamp as torch writes it: an integer, or an integer in a string.
std::optional<int64_t> timestamp_of(const nlohmann::json& v) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    char* end = nullptr;
    errno = 0;
    long long t = std::strtoll(s.c_str(), &end, 10);
    if (errno == 0 && end != s.c_str() && *end == '\0') return t;
  }
  return std::nullopt;
}

}  // namespace

FailureRecord FailureRecord::from_json(const std::string& json) {
  auto j = json_text::parse_record(json);
  if (!j.is_object()) {
    throw ProtocolError("unreadable failure record: " + json_text::utf8_prefix(json, 200));
  }
  const char* what = "failure record";
  FailureRecord f;
  f.rank = int32_field(j, "rank", -1, what);
  f.local_rank = int32_field(j, "local_rank", -1, what);
  f.node_rank = int32_field(j, "node_rank", -1, what);
  f.host = string_field(j, "host", what);
  f.pid = int32_field(j, "pid", 0, what);
  f.signaled = bool_field(j, "signaled", what);
  f.exit_code = int32_field(j, "exit_code", 0, what);
  f.signal = int32_field(j, "signal", 0, what);
  f.timestamp = int_field(j, "timestamp", 0, what);
  f.noticed_ns = int_field(j, "noticed_ns", 0, what);
  f.error_file = string_field(j, "error_file", what);
  f.message = string_field(j, "message", what);
  f.attempt = int32_field(j, "attempt", 0, what);
  f.hang = bool_field(j, "hang", what);
  f.uninterruptible = bool_field(j, "uninterruptible", what);
  return f;
}

void read_error_file(const std::string& path, FailureRecord* record) {
  if (record->message.empty()) {
    // torch's own words: "Signal 11 (SIGSEGV) received by PID 7", with
    // "<N/A>" for a signal Python has no name for.
    const std::string name = torch_signal_name(record->signal);
    record->message = record->signaled ? "Signal " + std::to_string(record->signal) + " (" +
                                             (name.empty() ? "<N/A>" : name) +
                                             ") received by PID " + std::to_string(record->pid)
                                       : kNoTraceback;
  }
  std::ifstream in(path);
  if (!in) return;  // the worker wrote none: torchrun's defaults
  std::stringstream ss;
  ss << in.rdbuf();
  // Written by the user's program: any shape may come back. Whatever cannot be
  // read is named in the summary; it never stops the restart.
  auto unreadable = [&](const std::string& why) {
    record->error_file = path;
    record->message = "error file unreadable: " + path + ": " + why;
  };
  auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return unreadable("not JSON");
  if (!j.is_object() || !j.contains("message")) {
    return unreadable("not an object with a \"message\"");
  }
  const auto& m = j["message"];
  if (m.is_object()) {
    // As torch shows it: the traceback, else the message, else "<N/A>",
    // every line after the first indented by two spaces.
    std::string text = "<N/A>";
    if (auto it = m.find("message"); it != m.end()) {
      if (!it->is_string()) return unreadable("\"message\".\"message\" is not a string");
      text = it->get<std::string>();
    }
    std::optional<int64_t> ts;
    if (auto ex = m.find("extraInfo"); ex != m.end()) {
      if (!ex->is_object()) return unreadable("\"extraInfo\" is not an object");
      if (auto cs = ex->find("py_callstack"); cs != ex->end()) {
        if (!cs->is_string()) return unreadable("\"py_callstack\" is not a string");
        text = cs->get<std::string>();
      }
      if (auto t = ex->find("timestamp"); t != ex->end()) ts = timestamp_of(*t);
    }
    record->error_file = path;
    record->message = indent(text);
    if (ts && *ts) record->timestamp = *ts;
  } else if (m.is_string()) {
    // Shown as written (torch indents only the @record form); an empty one
    // leaves torch's default.
    record->error_file = path;
    if (!m.get_ref<const std::string&>().empty()) record->message = m.get<std::string>();
    if (auto t = j.find("timestamp"); t != j.end()) {
      if (auto ts = timestamp_of(*t); ts && *ts) record->timestamp = *ts;
    }
  } else {
    unreadable("\"message\" is neither a string nor an object");
  }
}

std::string format_failure_summary(const std::string& entrypoint_name,
                                   std::vector<FailureRecord> failures) {
  // As torch's ChildFailedError.format_msg: the failures numbered in rank
  // order, the root cause (the earliest) under its own heading, the others
  // above it; the rules as wide as the widest line, at most 60.
  std::stable_sort(failures.begin(), failures.end(),
                   [](const FailureRecord& a, const FailureRecord& b) { return a.rank < b.rank; });
  size_t root = 0;
  for (size_t i = 1; i < failures.size(); ++i) {
    if (failures[i].earlier_than(failures[root])) root = i;
  }
  const std::string title = entrypoint_name + " FAILED";
  size_t width = widest_line(title);
  std::string root_text;
  std::string others;
  for (size_t i = 0; i < failures.size(); ++i) {
    std::string text = format_one(i, failures[i]);
    width = std::max(width, widest_line(text));
    if (i == root) {
      root_text = std::move(text);
    } else {
      others += (others.empty() ? "" : "\n") + text;
    }
  }
  if (others.empty()) others = "  <NO_OTHER_FAILURES>";
  width = std::min<size_t>(width, 60);
  const std::string border(width, '=');
  const std::string section(width, '-');
  return border + "\n" + title + "\n" + section + "\nFailures:\n" + others + "\n" + section +
         "\nRoot Cause (first observed failure):\n" + root_text + "\n" + border + "\n";
}

}  // namespace ctorchrun::agent

#include "cli/status_view.h"

#include <boost/asio.hpp>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <vector>

#include "common/json_text.h"

namespace ctorchrun::cli {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

bool parse_agent_address(const std::string& text, std::string* host, int* port,
                         std::string* error) {
  const size_t colon = text.rfind(':');
  std::string h = colon == std::string::npos ? "" : text.substr(0, colon);
  const std::string p = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const bool digits =
      !p.empty() && p.size() <= 5 && p.find_first_not_of("0123456789") == std::string::npos;
  if (h.empty() || !digits || std::stoi(p) < 1 || std::stoi(p) > 65535) {
    *error = "'" + json_text::to_valid_utf8(json_text::utf8_prefix(text, 100)) +
             "' is not HOST:PORT (an agent's --status_port, e.g. node0:9400 or [::1]:9400)";
    return false;
  }
  *host = h;
  *port = std::stoi(p);
  return true;
}

namespace {

// The raw answer of one GET, bounded in time and size; throws
// boost::system::system_error (or std::runtime_error for the bounds).
std::string exchange(const std::string& host, int port, std::chrono::milliseconds timeout) {
  asio::io_context io;
  tcp::socket socket(io);
  tcp::resolver resolver(io);
  boost::system::error_code failure = asio::error::timed_out;
  std::string answer;
  std::array<char, 8192> chunk{};
  const std::string request = "GET /status HTTP/1.1\r\nHost: " + host +
                              "\r\nAccept: application/json\r\nConnection: close\r\n\r\n";
  std::function<void()> read = [&] {
    socket.async_read_some(asio::buffer(chunk), [&](boost::system::error_code ec, size_t n) {
      answer.append(chunk.data(), n);
      if (answer.size() > (16u << 20)) return (void)(failure = asio::error::message_size);
      if (ec == asio::error::eof) return (void)(failure = {});
      if (ec) return (void)(failure = ec);
      read();
    });
  };
  resolver.async_resolve(host, std::to_string(port), [&](auto ec, tcp::resolver::results_type r) {
    if (ec) return (void)(failure = ec);
    asio::async_connect(socket, r, [&](auto cec, const tcp::endpoint&) {
      if (cec) return (void)(failure = cec);
      asio::async_write(socket, asio::buffer(request), [&](auto wec, size_t) {
        if (wec) return (void)(failure = wec);
        read();
      });
    });
  });
  io.run_for(timeout);
  if (failure) throw boost::system::system_error(failure);
  return answer;
}

std::string shown(const std::string& raw) {
  std::string s = json_text::to_valid_utf8(json_text::utf8_prefix(raw, 200));
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return s;
}

}  // namespace

StatusReply fetch_status(const std::string& host, int port, std::chrono::milliseconds timeout) {
  StatusReply out;
  const std::string where = host + ":" + std::to_string(port);
  std::string raw;
  try {
    raw = exchange(host, port, timeout);
  } catch (const std::exception& e) {
    out.error = "no answer from " + where + ": " + e.what();
    return out;
  }
  const size_t head_end = raw.find("\r\n\r\n");
  const bool ok_line = raw.rfind("HTTP/1.1 200", 0) == 0 || raw.rfind("HTTP/1.0 200", 0) == 0;
  if (head_end == std::string::npos || !ok_line) {
    out.error = where + " answered: " + shown(raw.substr(0, raw.find("\r\n")));
    return out;
  }
  out.status = nlohmann::json::parse(raw.substr(head_end + 4), nullptr, false);
  if (out.status.is_discarded() || !out.status.is_object()) {
    out.error = where + " answered no status JSON: " + shown(raw.substr(head_end + 4));
    return out;
  }
  out.ok = true;
  return out;
}

// ---------------------------------------------------------------------------

namespace {

// A field as text: a string as is (cleaned), a number, else "?".
std::string text(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return "?";
  auto it = j.find(key);
  if (it == j.end()) return "?";
  if (it->is_string()) return shown(it->get<std::string>());
  if (it->is_number_integer()) return std::to_string(it->get<int64_t>());
  if (it->is_number()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", it->get<double>());
    return buf;
  }
  return "?";
}

double number(const nlohmann::json& j, const char* key, double fallback) {
  if (!j.is_object()) return fallback;
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

const nlohmann::json& list(const nlohmann::json& j, const char* key) {
  static const nlohmann::json empty = nlohmann::json::array();
  if (!j.is_object()) return empty;
  auto it = j.find(key);
  return it != j.end() && it->is_array() ? *it : empty;
}

std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s + "  ";
}

std::string clock_of(double t) {
  if (t <= 0) return "?";
  const std::time_t secs = static_cast<std::time_t>(t);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

void nodes_table(std::ostringstream& out, const nlohmann::json& s) {
  out << "NODE  HOST                  STATE    RANKS\n";
  for (const auto& n : list(s, "nodes")) {
    const double first = number(n, "first_rank", -1), size = number(n, "local_world_size", 0);
    const std::string ranks = first < 0 || size < 1
                                  ? "?"
                                  : std::to_string(static_cast<int64_t>(first)) + "-" +
                                        std::to_string(static_cast<int64_t>(first + size - 1));
    out << pad(text(n, "group_rank"), 4) << pad(text(n, "host"), 20) << pad(text(n, "state"), 7)
        << ranks << "\n";
  }
}

void ranks_table(std::ostringstream& out, const nlohmann::json& s) {
  out << "RANK  LOCAL  PID      STATE      STALLED  CPU(s)  RSS(MiB)\n";
  for (const auto& r : list(s, "ranks")) {
    char rss[32];
    std::snprintf(rss, sizeof rss, "%.1f", number(r, "rss_bytes", 0) / 1048576.0);
    out << pad(text(r, "rank"), 4) << pad(text(r, "local_rank"), 5) << pad(text(r, "pid"), 7)
        << pad(text(r, "state"), 9) << pad(text(r, "stalled_s") + "s", 7)
        << pad(text(r, "cpu_s"), 6) << rss << "\n";
  }
}

}  // namespace

std::string render_status(const nlohmann::json& s) {
  std::ostringstream out;
  out << "job " << text(s, "run_id") << "  backend " << text(s, "rdzv_backend") << "  state "
      << text(s, "state") << "  attempt " << text(s, "attempt") << "/" << text(s, "max_restarts")
      << "  round " << text(s, "round") << "  world " << text(s, "world_size") << "\n";
  const nlohmann::json restarts =
      s.is_object() && s.contains("restarts") ? s["restarts"] : nlohmann::json::object();
  out << "restarts: failure " << text(restarts, "failure") << ", hang " << text(restarts, "hang")
      << ", membership " << text(restarts, "membership") << ", scheduler "
      << text(restarts, "scheduler") << "   worker failures: " << text(s, "worker_failures")
      << "\n";
  nodes_table(out, s);
  ranks_table(out, s);
  const auto& failures = list(s, "failures");
  if (!failures.empty()) out << "last failures:\n";
  for (size_t i = failures.size() > 5 ? failures.size() - 5 : 0; i < failures.size(); ++i) {
    const auto& f = failures[i];
    out << "  attempt " << text(f, "attempt") << "  rank " << text(f, "rank") << " (node "
        << text(f, "node") << ", " << text(f, "host") << ")  " << text(f, "cause") << "  at "
        << clock_of(number(f, "time", 0)) << "\n";
  }
  return out.str();
}

}  // namespace ctorchrun::cli

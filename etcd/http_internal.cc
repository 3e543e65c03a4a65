#include "etcd/http_internal.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/error.hpp>
#include <limits>

#include "common/error.h"

namespace ctorchrun::etcd::detail {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using boost::system::error_code;
using tcp = asio::ip::tcp;

Endpoint parse_endpoint(const std::string& text) {
  Endpoint ep;
  ep.text = text;
  std::string port;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':')
      throw ConfigError("etcd endpoint '" + text + "' is not [addr]:port");
    ep.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || text.find(':') != colon)
      throw ConfigError("etcd endpoint '" + text +
                        "' is not host:port (write IPv6 as [addr]:port)");
    ep.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (ep.host.empty()) throw ConfigError("etcd endpoint '" + text + "' has no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    throw ConfigError("etcd endpoint '" + text + "' has no valid port");
  const unsigned long p = std::stoul(port);
  if (p == 0 || p > 65535) throw ConfigError("etcd endpoint '" + text + "' has port out of range");
  ep.port = static_cast<std::uint16_t>(p);
  return ep;
}

HttpConnection::HttpConnection() : socket_(ioc_), resolver_(ioc_) {}

HttpConnection::~HttpConnection() { close(); }

void HttpConnection::close() {
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

// Runs one asynchronous operation to completion or until the deadline. A read
// is cancelled rather than the socket closed, so that a watch may wait in
// slices on one stream; connect and write close the socket, since a half-done
// one leaves nothing worth keeping.
template <class Start>
error_code HttpConnection::run(Clock::time_point deadline, bool close_on_timeout, Start start,
                               bool& timed_out, std::size_t& bytes) {
  error_code result;
  bool done = false;
  timed_out = false;
  bytes = 0;
  ioc_.restart();
  start([&](error_code ec, std::size_t n) {
    result = ec;
    bytes = n;
    done = true;
  });
  asio::steady_timer timer(ioc_);
  timer.expires_at(deadline);
  timer.async_wait([&](error_code ec) {
    if (ec || done) return;
    timed_out = true;
    error_code ignored;
    resolver_.cancel();
    if (close_on_timeout) {
      socket_.close(ignored);
    } else {
      socket_.cancel(ignored);
    }
  });
  while (!done) {
    // Out of work with the operation pending cannot happen; if it ever did,
    // waiting on would never end.
    if (ioc_.run_one() == 0 && !done) {
      result = asio::error::operation_aborted;
      break;
    }
  }
  timer.cancel();
  ioc_.run();  // lets the cancelled timer's handler finish before the locals go
  return result;
}

StepError HttpConnection::connect(const Endpoint& endpoint, Clock::time_point deadline) {
  close();
  request_sent_ = false;
  raw_.clear();
  parser_.emplace();
  parser_->eager(true);
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  host_header_ = endpoint.text;

  std::vector<tcp::endpoint> addresses;
  error_code ec;
  const auto address = asio::ip::make_address(endpoint.host, ec);
  bool timed_out = false;
  std::size_t n = 0;
  if (!ec) {
    addresses.emplace_back(address, endpoint.port);
  } else {
    tcp::resolver::results_type results;
    ec = run(
        deadline, true,
        [&](auto handler) {
          resolver_.async_resolve(endpoint.host, std::to_string(endpoint.port),
                                  [&results, handler](error_code e, tcp::resolver::results_type r) {
                                    results = r;
                                    handler(e, 0);
                                  });
        },
        timed_out, n);
    if (timed_out) return {StepError::Kind::kTimeout, "timed out resolving " + endpoint.host};
    if (ec)
      return {StepError::Kind::kConnect, "cannot resolve " + endpoint.host + ": " + ec.message()};
    for (const auto& r : results) addresses.push_back(r.endpoint());
  }
  std::string errors;
  for (const auto& a : addresses) {
    socket_.close(ec);
    socket_.open(a.protocol(), ec);
    if (ec) {
      errors = ec.message();
      continue;
    }
    ec = run(
        deadline, true,
        [&](auto handler) { socket_.async_connect(a, [handler](error_code e) { handler(e, 0); }); },
        timed_out, n);
    if (timed_out) return {StepError::Kind::kTimeout, "connect timed out"};
    if (!ec) {
      socket_.set_option(tcp::no_delay(true), ec);
      return {};
    }
    errors = ec.message();
  }
  return {StepError::Kind::kConnect, "connect failed: " + errors};
}

StepError HttpConnection::post(const std::string& target, const std::string& body,
                               Clock::time_point deadline) {
  std::string request =
      "POST " + target + " HTTP/1.1\r\nHost: " + host_header_ +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  bool timed_out = false;
  std::size_t n = 0;
  request_sent_ = true;  // from here on, the member may have acted on it
  const error_code ec = run(
      deadline, true,
      [&](auto handler) { asio::async_write(socket_, asio::buffer(request), handler); }, timed_out,
      n);
  if (timed_out) return {StepError::Kind::kTimeout, "timed out sending the request"};
  if (ec) return {StepError::Kind::kClosed, "sending the request failed: " + ec.message()};
  return {};
}

StepError HttpConnection::read_more(Clock::time_point deadline) {
  for (;;) {
    if (parser_->is_done()) return {};
    if (!raw_.empty()) {
      error_code ec;
      const std::size_t used = parser_->put(asio::buffer(raw_), ec);
      raw_.erase(0, used);
      if (ec && ec != http::error::need_more)
        return {StepError::Kind::kProtocol, "malformed HTTP response: " + ec.message()};
      if (parser_->is_header_done() && parser_->get().body().size() > kMaxPendingBody)
        return {StepError::Kind::kProtocol,
                "response body over " + std::to_string(kMaxPendingBody) + " bytes"};
      if (used > 0) return {};
    }
    if (raw_.size() > kMaxPendingBody)
      return {StepError::Kind::kProtocol,
              "unparseable response over " + std::to_string(kMaxPendingBody) + " bytes"};
    bool timed_out = false;
    std::size_t n = 0;
    const error_code ec = run(
        deadline, false,
        [&](auto handler) { socket_.async_read_some(asio::buffer(buffer_), handler); }, timed_out,
        n);
    if (timed_out) return {StepError::Kind::kTimeout, "timed out waiting for the response"};
    if (ec == asio::error::eof) {
      error_code pec;
      if (raw_.empty() && parser_->is_header_done()) parser_->put_eof(pec);
      if (parser_->is_done()) return {};
      return {StepError::Kind::kClosed, "connection closed mid-response"};
    }
    if (ec) return {StepError::Kind::kClosed, "reading the response failed: " + ec.message()};
    raw_.append(buffer_, n);
  }
}

StepError HttpConnection::read_all(Clock::time_point deadline) {
  while (!parser_->is_done()) {
    if (auto e = read_more(deadline)) return e;
  }
  return {};
}

}  // namespace ctorchrun::etcd::detail

#include "etcd/http_internal.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/error.hpp>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "common/error.h"
#include "etcd/trust_store.h"

namespace ctorchrun::etcd::detail {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using boost::system::error_code;
using tcp = asio::ip::tcp;
namespace ssl = asio::ssl;

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

namespace {

// OpenSSL's reason for a failure (the error queue is cleared).
std::string openssl_reason(const error_code& ec) {
  std::string reason = ec ? ec.message() : "";
  ERR_clear_error();
  return reason.empty() ? "unknown OpenSSL error" : reason;
}

void check_readable(const std::string& what, const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw ConfigError("etcd TLS " + what + " '" + path +
                      "': cannot read it: " + std::strerror(errno));
}

// An end of stream without TLS's close_notify: for HTTP (whose bodies carry
// their length) the same as a plain end of stream.
bool truncated(const error_code& ec) {
  if (ec == ssl::error::stream_truncated) return true;
#ifdef SSL_R_UNEXPECTED_EOF_WHILE_READING
  if (ec.category() == asio::error::get_ssl_category() &&
      ERR_GET_REASON(static_cast<unsigned long>(ec.value())) == SSL_R_UNEXPECTED_EOF_WHILE_READING)
    return true;
#endif
  return false;
}

// The system's trusted certificates, wherever this distribution keeps them
// (etcd/trust_store.h), or SSL_CERT_FILE / SSL_CERT_DIR.
void load_system_trust(ssl::context& ctx) {
  const TrustStore store = find_trust_store(trust_env_from_process());
  if (!store.found())
    throw ConfigError(
        "etcd TLS: no trusted certificates found on this system (looked for " +
        trust_bundle_candidates().front() +
        " and the other usual places); set SSL_CERT_FILE or give --rdzv_conf cacert=FILE");
  error_code ec;
  if (!store.file.empty()) {
    ctx.load_verify_file(store.file, ec);
    if (ec)
      throw ConfigError("etcd TLS: cannot load the system's trusted certificates from '" +
                        store.file + "': " + openssl_reason(ec));
  }
  if (!store.dir.empty()) {
    ctx.add_verify_path(store.dir, ec);
    if (ec)
      throw ConfigError("etcd TLS: cannot use the certificate directory '" + store.dir +
                        "': " + openssl_reason(ec));
  }
}

}  // namespace

std::shared_ptr<ssl::context> make_tls_context(const std::string& ca_file,
                                               const std::string& cert_file,
                                               const std::string& key_file) {
  if (cert_file.empty() != key_file.empty())
    throw ConfigError("etcd TLS: a client certificate needs its key and a key its certificate (" +
                      (cert_file.empty() ? "key '" + key_file + "' without a certificate"
                                         : "certificate '" + cert_file + "' without a key") +
                      ")");
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_client);
  long options = ssl::context::default_workarounds | ssl::context::no_sslv2 |
                 ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1;
#ifdef SSL_OP_IGNORE_UNEXPECTED_EOF
  options |= SSL_OP_IGNORE_UNEXPECTED_EOF;
#endif
  ctx->set_options(options);
  ctx->set_verify_mode(ssl::verify_peer);
  error_code ec;
  if (ca_file.empty()) {
    load_system_trust(*ctx);
  } else {
    check_readable("cacert", ca_file);
    ctx->load_verify_file(ca_file, ec);
    if (ec)
      throw ConfigError("etcd TLS cacert '" + ca_file +
                        "': not a PEM CA certificate: " + openssl_reason(ec));
  }
  if (!cert_file.empty()) {
    check_readable("cert", cert_file);
    check_readable("key", key_file);
    ctx->use_certificate_chain_file(cert_file, ec);
    if (ec)
      throw ConfigError("etcd TLS cert '" + cert_file +
                        "': not a PEM certificate: " + openssl_reason(ec));
    ctx->use_private_key_file(key_file, ssl::context::pem, ec);
    if (ec)
      throw ConfigError("etcd TLS key '" + key_file +
                        "': not a PEM private key: " + openssl_reason(ec));
    if (SSL_CTX_check_private_key(ctx->native_handle()) != 1) {
      ERR_clear_error();
      throw ConfigError("etcd TLS key '" + key_file + "' does not match the certificate '" +
                        cert_file + "'");
    }
  }
  return ctx;
}

HttpConnection::HttpConnection(ssl::context* tls)
    : socket_(ioc_), resolver_(ioc_), tls_context_(tls) {}

HttpConnection::~HttpConnection() { close(); }

void HttpConnection::close() {
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  tls_.reset();
}

StepError HttpConnection::failure(StepError::Kind kind, const std::string& what,
                                  const error_code& ec) const {
  if (!tls_ || ec.category() != asio::error::get_ssl_category() || truncated(ec))
    return {kind, what + ": " + ec.message()};
  SSL* ssl_handle = const_cast<ssl::stream<tcp::socket&>&>(*tls_).native_handle();
  const long verify = SSL_get_verify_result(ssl_handle);
  std::string why;
  if (verify != X509_V_OK) {
    why = std::string("certificate verify failed: ") +
          X509_verify_cert_error_string(static_cast<int>(verify));
    ERR_clear_error();
  } else {
    why = openssl_reason(ec);
    // An alert from the member about a certificate is about ours.
    if (why.find("alert") != std::string::npos && why.find("certificate") != std::string::npos)
      why += " (the member refused this client's certificate, or wanted one)";
  }
  return {StepError::Kind::kTls, "TLS: " + why};
}

StepError HttpConnection::handshake(const Endpoint& endpoint, Clock::time_point deadline) {
  tls_.emplace(socket_, *tls_context_);
  SSL* ssl_handle = tls_->native_handle();
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl_handle);
  error_code ec;
  asio::ip::make_address(endpoint.host, ec);
  // A host name goes in SNI and must be on the certificate; an IP literal
  // (never sent as SNI) must be among its IP addresses.
  bool named = false;
  if (ec) {
    named = SSL_set_tlsext_host_name(ssl_handle, endpoint.host.c_str()) == 1 &&
            X509_VERIFY_PARAM_set1_host(param, endpoint.host.c_str(), 0) == 1;
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  } else {
    named = X509_VERIFY_PARAM_set1_ip_asc(param, endpoint.host.c_str()) == 1;
  }
  if (!named) {
    ERR_clear_error();
    return {StepError::Kind::kTls,
            "TLS: cannot check the certificate against '" + endpoint.host + "'"};
  }
  bool timed_out = false;
  std::size_t n = 0;
  ec = run(
      deadline, true,
      [&](auto handler) {
        tls_->async_handshake(ssl::stream_base::client, [handler](error_code e) { handler(e, 0); });
      },
      timed_out, n);
  if (timed_out) return {StepError::Kind::kTimeout, "TLS handshake timed out"};
  // A member may close a connection as it stops; one that serves plain http
  // closes (or resets) every one this way, hence the hint.
  if (ec == asio::error::eof || truncated(ec) || ec == asio::error::connection_reset)
    return {StepError::Kind::kConnect,
            "TLS handshake failed: the member closed the connection (does it serve https?)"};
  if (ec) return failure(StepError::Kind::kConnect, "TLS handshake failed", ec);
  return {};
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
      if (tls_context_) return handshake(endpoint, deadline);
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
      [&](auto handler) {
        if (tls_) {
          asio::async_write(*tls_, asio::buffer(request), handler);
        } else {
          asio::async_write(socket_, asio::buffer(request), handler);
        }
      },
      timed_out, n);
  if (timed_out) return {StepError::Kind::kTimeout, "timed out sending the request"};
  if (ec) return failure(StepError::Kind::kClosed, "sending the request failed", ec);
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
        [&](auto handler) {
          if (tls_) {
            tls_->async_read_some(asio::buffer(buffer_), handler);
          } else {
            socket_.async_read_some(asio::buffer(buffer_), handler);
          }
        },
        timed_out, n);
    if (timed_out) return {StepError::Kind::kTimeout, "timed out waiting for the response"};
    if (ec == asio::error::eof || (tls_ && truncated(ec))) {
      error_code pec;
      if (raw_.empty() && parser_->is_header_done()) parser_->put_eof(pec);
      if (parser_->is_done()) return {};
      return {StepError::Kind::kClosed, "connection closed mid-response"};
    }
    if (ec) return failure(StepError::Kind::kClosed, "reading the response failed", ec);
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

#pragma once

// Internal to etcd/: one HTTP/1.1 connection to one etcd member, driven
// synchronously, every step bounded by a deadline.
//
// Each step runs one Asio operation on the connection's private io_context
// with a timer beside it; when the timer wins, the operation is cancelled
// (reads) or the socket closed (connect, TLS handshake, write). A cancelled read leaves the
// connection usable, which a watch relies on to wait in slices. Response bytes
// go through Beast's HTTP parser (chunked or sized bodies alike); the body
// grows in body(), from which the caller may erase what it has consumed.
//
// With a TLS context, connect() also runs the TLS handshake (bounded by the
// same deadline): SNI names the host unless it is an IP literal, and OpenSSL
// checks the member's certificate against the context's trust anchors and
// against the endpoint's host name or IP address. Requests and answers then
// go through the TLS stream.
//
// Not thread-safe: one thread drives one connection.

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace ctorchrun::etcd::detail {

using Clock = std::chrono::steady_clock;

struct Endpoint {
  std::string host;  // without brackets for IPv6
  std::uint16_t port = 0;
  std::string text;  // as given: "host:port" or "[addr]:port"
};

// Parses "host:port" or "[v6addr]:port". Throws ConfigError.
Endpoint parse_endpoint(const std::string& text);

// A TLS client context for etcd members: TLS 1.2 or later, the member's
// certificate verified against `ca_file` (empty: OpenSSL's default trust
// store), and `cert_file`/`key_file` (PEM, both or neither) presented to
// members that ask for a client certificate. Throws ConfigError naming the
// file and OpenSSL's reason when one cannot be read or used.
std::shared_ptr<boost::asio::ssl::context> make_tls_context(const std::string& ca_file,
                                                            const std::string& cert_file,
                                                            const std::string& key_file);

// What went wrong in one step. kTls: the TLS layer failed in a way that
// retrying cannot mend (the member's certificate failed verification, the
// member refused ours, or it does not speak TLS).
struct StepError {
  enum class Kind { kNone, kConnect, kTimeout, kClosed, kProtocol, kTls };
  Kind kind = Kind::kNone;
  std::string what;
  explicit operator bool() const { return kind != Kind::kNone; }
};

class HttpConnection {
 public:
  // Most unconsumed body bytes held at once (a watch consumes as it goes).
  static constexpr std::size_t kMaxPendingBody = 64u << 20;

  // `tls`: speak TLS with this context (which must outlive the connection);
  // null: plain TCP.
  explicit HttpConnection(boost::asio::ssl::context* tls = nullptr);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  StepError connect(const Endpoint& endpoint, Clock::time_point deadline);
  // Sends a POST with a JSON body ("Connection: close": one request per connection).
  StepError post(const std::string& target, const std::string& body, Clock::time_point deadline);
  // Reads and parses at least one more byte of the response (or notes its end).
  // After a kTimeout the connection stays usable.
  StepError read_more(Clock::time_point deadline);
  // Reads until the whole response is in.
  StepError read_all(Clock::time_point deadline);

  bool header_done() const { return parser_->is_header_done(); }
  bool done() const { return parser_->is_done(); }
  unsigned status() const { return parser_->get().result_int(); }
  std::string& body() { return parser_->get().body(); }
  bool request_sent() const { return request_sent_; }
  void close();

 private:
  template <class Start>
  boost::system::error_code run(Clock::time_point deadline, bool close_on_timeout, Start start,
                                bool& timed_out, std::size_t& bytes);
  StepError handshake(const Endpoint& endpoint, Clock::time_point deadline);
  // A step's failure: a TLS error that retrying cannot mend, or `kind`.
  StepError failure(StepError::Kind kind, const std::string& what,
                    const boost::system::error_code& ec) const;

  boost::asio::io_context ioc_;
  boost::asio::ip::tcp::socket socket_;
  boost::asio::ip::tcp::resolver resolver_;
  boost::asio::ssl::context* tls_context_;
  // Over socket_ once it is connected, when TLS is on.
  std::optional<boost::asio::ssl::stream<boost::asio::ip::tcp::socket&>> tls_;
  std::optional<boost::beast::http::response_parser<boost::beast::http::string_body>> parser_;
  std::string raw_;  // received, not yet parsed
  char buffer_[16384];
  std::string host_header_;
  bool request_sent_ = false;
};

}  // namespace ctorchrun::etcd::detail

#pragma once
// Reaching a rendezvous store at HOST:PORT, shared by the handlers: the
// endpoint as people read it, and a connect that retries until a deadline, as
// torch's client does for an address that does not resolve or answer yet.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "store/tcp_store.h"

namespace ctorchrun::rendezvous {

// An address as given: a host name or numeric address (an IPv6 literal
// without its brackets) and a port.
struct Endpoint {
  std::string host;
  int port = 0;
};

// Parses "host:port", "[v6]:port", "host" or "[v6]" (the port is then
// `default_port`): the one reading of --rdzv_endpoint's items and of etcd
// members. Throws ConfigError naming `text` for a missing ']', a port that is
// not 1..65535, or an empty host.
Endpoint parse_endpoint(const std::string& text, int default_port);

// "host:port", or "[addr]:port" for an IPv6 literal given without brackets.
std::string format_endpoint(const std::string& addr, int port);

// An address without the brackets of an IPv6 literal ("[::1]" -> "::1").
std::string strip_brackets(const std::string& addr);

// Where a store binds so that it is reachable at `addr` (brackets already
// removed): a loopback literal or "localhost" keeps it on that loopback
// address, any other address of this host gets its family's wildcard (as
// torch binds). Throws IoError naming the address when it does not resolve
// or belongs to no interface of this host. One family: for a store that
// only `addr` reaches (the workers' store, whose address is published).
std::string bind_address_for(const std::string& addr);

// Where the store of an endpoint that people may spell several ways binds
// (the rendezvous store; ServerOptions' host and also_hosts, in this order),
// so that every spelling of one host meets one store, as with torch's store,
// which binds both families:
// - the loopback endpoint (127.0.0.1, ::1, "localhost"): 127.0.0.1, then
//   ::1, each only where this host has it (IPv6 may be off). The same order
//   for every spelling, so among agents of one host binding the same port
//   the first address decides which one hosts: the others fail at it and
//   connect to the one store. Another 127.x literal (127.0.1.1) is an
//   address of its own and binds only itself, as bind_address_for.
// - any other address of this host: "::" (dual-stack, serving IPv4 too)
//   where this host has IPv6, else "0.0.0.0".
// Throws IoError as bind_address_for.
std::vector<std::string> bind_addresses_for(const std::string& addr);

// Whether `host` resolves now (a numeric address always does).
bool resolves(const std::string& host);

// Waits until `host` resolves, looking it up again every 250 ms, until
// `deadline`: a name that is not in DNS yet (a Kubernetes headless service
// whose pod is not ready) is waited for, not taken as another host's.
// `on_wait` is called at most once per `log_interval` meanwhile. False when
// the deadline passed first.
bool await_resolvable(const std::string& host, std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds log_interval, const std::function<void()>& on_wait);

// A client of the store at addr:port (addr without brackets).
std::shared_ptr<store::TcpStore> tcp_client(const std::string& addr, int port,
                                            std::chrono::milliseconds connect_timeout,
                                            std::chrono::milliseconds op_timeout);

struct ConnectRetry {
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds wait_log_interval{30'000};
  std::chrono::milliseconds op_timeout{30'000};  // of each call on the client returned
  // Called at most once per wait_log_interval while the store cannot be
  // reached, with the client's reason.
  std::function<void(const std::string& why)> on_wait;
  // The TimeoutError's message once the deadline passed, from the last reason.
  std::function<std::string(const std::string& why)> timeout_message;
};

// Connects to addr:port, retrying until retry.deadline; throws TimeoutError
// with retry.timeout_message then.
std::shared_ptr<store::TcpStore> connect_until(const std::string& addr, int port,
                                               const ConnectRetry& retry);

}  // namespace ctorchrun::rendezvous

#pragma once

// HostProbe: notices that a TCP server's process is gone, without sending it
// anything. It holds one idle connection to the server; when the server's
// process dies its kernel closes the connection (FIN or RST), which the probe
// sees at the next look. Used on the workers' store of group rank 0: under
// etcd a lost agent's presence goes only when its lease expires (seconds),
// while its store's connection closes at once.
//
// Evidence, not proof: a server may also close on purpose (the agent left,
// or re-formed). Callers confirm with the rendezvous state (c10d_state.h).
// A connection never made (timeout, unreachable, a host name: only numeric
// addresses are probed, since a name lookup could block) or a silent peer (a
// host cut off by the network) proves nothing: gone() stays false and the
// lease decides.
//
// Not thread-safe: one thread (the agent's monitor) uses it.

#include <chrono>
#include <cstdint>
#include <string>

namespace ctorchrun::rendezvous {

class HostProbe {
 public:
  // Connects at once, waiting at most `connect_timeout`; a failure to
  // connect is remembered (gone() answers for a refused connection: nothing
  // listens there any more) and retried at the next gone().
  HostProbe(std::string host, std::uint16_t port, std::chrono::milliseconds connect_timeout);
  ~HostProbe();
  HostProbe(const HostProbe&) = delete;
  HostProbe& operator=(const HostProbe&) = delete;

  // True once the server refused a new connection, or closed the probe's
  // and then refused a new one (a server that closes a connection while it
  // still listens, at its connection limit say, lives). Never blocks longer
  // than the connect timeout (and not at all while connected and quiet).
  bool gone();
  // Why gone() said so ("closed by the peer", "connection refused"...).
  const std::string& why() const { return why_; }

 private:
  void connect_now();

  std::string host_;
  std::uint16_t port_;
  std::chrono::milliseconds connect_timeout_;
  int fd_ = -1;
  bool gone_ = false;
  std::string why_;
};

}  // namespace ctorchrun::rendezvous

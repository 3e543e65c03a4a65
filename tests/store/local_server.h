#pragma once
// A store server for one test: loopback, a free port, `o`'s limits.

#include <memory>

#include "store/tcp_store_server.h"

namespace ctorchrun::testing {

inline std::unique_ptr<store::TcpStoreServer> local_server(store::ServerOptions o = {}) {
  o.host = "127.0.0.1";
  o.port = 0;
  return store::TcpStoreServer::start(o);
}

}  // namespace ctorchrun::testing

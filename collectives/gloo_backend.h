#pragma once

// The gloo backend: Debian's libgloo, TCP transport, CPU buffers.
//
// This header and gloo_backend.cc are the only places that know gloo; every
// gloo include stays in the .cc, so a gloo upgrade touches one file.
//
// Set-up: one TCP device per process and interface (GLOO_SOCKET_IFNAME, as
// torch honours it, else the local address that routes to MASTER_ADDR),
// then gloo's full-mesh connection through the group's store, bounded by the
// group's timeout. Collectives run in the order they are started, one at a
// time per group: an _async one on the group's thread, a blocking one on its
// caller's thread once everything started before it is done. Each begins by
// exchanging its 32-byte signature (op, count, data type, reduction, root,
// sequence number) with every peer over the same gloo context, so that a
// call that differs across ranks fails on every rank before data moves,
// rather than giving wrong answers or tripping a gloo assertion on its I/O
// thread (BackendContext::check_calls). send and recv are posted at once on the
// caller's thread. Reductions are ours (this gloo has no bfloat16 and no
// average).

#include <memory>

#include "collectives/backend.h"

namespace ctorchrun::dist {

// Throws TimeoutError when set-up does not finish within context.timeout,
// IoError when the device cannot be created or a peer cannot be reached.
std::unique_ptr<Backend> create_gloo_backend(const BackendContext& context);

}  // namespace ctorchrun::dist

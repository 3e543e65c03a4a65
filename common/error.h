#pragma once

// Error types shared by every layer.
//
// Synchronous library calls (store client, rendezvous) report failures of the
// outside world by throwing a type derived from ctorchrun::Error. Broken
// invariants (our own bugs) go through CTORCHRUN_CHECK, which throws
// InternalError; only main() catches that (exit code 70).

#include <stdexcept>
#include <string>

namespace ctorchrun {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A deadline passed before the operation could complete.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A socket, file or process operation failed (connect refused, reset, EOF...).
class IoError : public Error {
 public:
  using Error::Error;
};

// The peer sent bytes that do not follow the protocol.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// The configuration (command line, environment, files) is invalid.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A call whose arguments cannot be right: the ranks of a group called
// different collectives (libctorch_dist's call check), or a second process
// writes a checkpoint directory that another holds. A ConfigError, so code
// that catches those catches these too.
class InvalidArgument : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// The rendezvous was closed by another participant.
class RendezvousClosedError : public Error {
 public:
  using Error::Error;
};

// An invariant of ours was broken: a bug, never the user's fault.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond,
                               const std::string& msg);
}  // namespace detail

}  // namespace ctorchrun

#define CTORCHRUN_CHECK(cond, msg)                                                    \
  do {                                                                                \
    if (!(cond)) ::ctorchrun::detail::check_failed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

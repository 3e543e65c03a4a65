#pragma once

// store::Store: the key-value store every part of ctorchrun rendezvous through.
//
// The semantics are those of PyTorch's c10d Store, so that a key written by a
// torch worker and one written by us mean the same thing:
//  - keys and values are arbitrary bytes (std::string holds them; NUL is fine);
//  - get() first waits, up to timeout(), for the key to exist;
//  - add() parses the stored value like C's stoll, stores the sum as decimal
//    text and returns it; a missing key counts as 0;
//  - compare_set() follows torch's four rules (see compare_set below);
//  - num_keys() counts every key of the store, whoever wrote it;
//  - tallies (tally_add and its readers) are ours, not torch's: below.
//
// Thread safety: every implementation in this folder may be called from
// several threads at once. Calls block for at most their timeout.
//
// Errors: TimeoutError when a deadline passes (the message names the keys and
// the timeout); IoError when the connection to a remote store fails; Error
// when the server refuses an operation (add() on a non-numeric value).
//
// Retry contract: what a caller may do when a call's answer was lost (an
// IoError after the request went out: the write may or may not have been
// applied). Implementations that fail over between servers (EtcdStore)
// replay the idempotent ones themselves.
//  - idempotent, replay freely: every read (get, check, wait, multi_get,
//    num_keys, tally_count, tally_entries), set, multi_set, add(key, 0)
//    (a read; EtcdStore writes nothing to a missing key), delete_key (a
//    replay may return false), and compare_set (a replay of a swap that
//    applied finds the key holding `desired` and returns it: the same
//    outcome);
//  - recoverable: tally_add on EtcdStore (it reads back its own enrolment's
//    key and place, see etcd/etcd_store.h); portable tallies (TCP, hash) are
//    ambiguous, but their server's loss is the whole store's;
//  - ambiguous, never replayed: add(key, delta != 0) and append (a replay
//    counts or appends twice). The agents' main path uses none of them on a
//    store that fails over: its counters and sets are tallies.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::store {

inline constexpr std::chrono::milliseconds kDefaultTimeout{300'000};  // torch's Store default

class Store {
 public:
  virtual ~Store() = default;

  // Creates or overwrites `key`; wakes waiters on it.
  virtual void set(const std::string& key, const std::string& value) = 0;

  // Waits up to timeout() for `key`, then returns its value.
  virtual std::string get(const std::string& key) = 0;

  // Adds `delta` to the integer stored at `key` (0 if missing); returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // torch's rules: key missing and `expected` empty -> stores `desired`,
  // returns it; key missing and `expected` not empty -> stores nothing, returns
  // `expected`; key equal to `expected` -> stores `desired`, returns it;
  // otherwise returns the current value unchanged.
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;

  // Blocks until every key exists; TimeoutError after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  // True when every key exists now (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // Number of keys in the whole store (every tenant's).
  virtual int64_t num_keys() = 0;

  // Removes `key`; true if it existed.
  virtual bool delete_key(const std::string& key) = 0;

  // Appends to the value of `key`, creating it if missing; wakes waiters.
  virtual void append(const std::string& key, const std::string& value) = 0;

  // Waits up to timeout() for every key, then returns their values in order.
  virtual std::vector<std::string> multi_get(const std::vector<std::string>& keys) = 0;

  // Sets each keys[i] to values[i], in order. Sizes must match (ConfigError).
  virtual void multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) = 0;

  // Tallies: many writers enrol at once under `key`, each learning its place.
  // A tally only grows; read it only through these three. Each store chooses
  // its layout: one whose add() and append() are single atomic requests
  // (TcpStore, HashStore) uses portable_tally (below); one whose writes are
  // compare-and-set loops (etcd) keeps one key per enrolment so that no
  // writer ever retries against the others. Wrappers forward all three.
  //
  // Enrols `entry` (may be empty: counted, not listed) and returns the number
  // enrolled up to and including this one: 1, 2, 3... in the store's order,
  // each place given once. Not retried after an ambiguous failure (IoError),
  // so that nothing is counted twice.
  virtual int64_t tally_add(const std::string& key, const std::string& entry) = 0;
  // The number enrolled now (0 when none).
  virtual int64_t tally_count(const std::string& key) = 0;
  // The non-empty entries enrolled, in no promised order.
  virtual std::vector<std::string> tally_entries(const std::string& key) = 0;

  // Called from another thread: a call blocked on this store (a wait, say)
  // returns at once with an Error, and every later call fails too; for a
  // thread that must stop now rather than at its call's timeout. The caller
  // keeps the store alive meanwhile. Default: nothing (calls end at their
  // timeouts); TcpStore shuts its connection down.
  virtual void interrupt() noexcept {}

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 protected:
  std::chrono::milliseconds timeout_ = kDefaultTimeout;
};

// Reads `key` without waiting: its value, or nullopt when it does not exist
// now. One request that never writes and never waits (a compare_set whose
// expected value no key holds: torch's rules then store nothing and return
// the current value, or `expected` when the key is missing), so it is safe on
// a key that can vanish at any moment (a key bound to its writer's
// connection or lease). Idempotent: retried freely.
std::optional<std::string> read_if_present(Store& store, const std::string& key);

// The tally in plain operations: the entries appended to `key` as
// "<entry>," (so an entry holds no ','; ConfigError otherwise), then the count
// added at key + kCountSuffix. Two requests per enrolment, one per read.
namespace portable_tally {
inline constexpr const char* kCountSuffix = "#count";
int64_t add(Store& store, const std::string& key, const std::string& entry);
int64_t count(Store& store, const std::string& key);
std::vector<std::string> entries(Store& store, const std::string& key);
}  // namespace portable_tally

}  // namespace ctorchrun::store

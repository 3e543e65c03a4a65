#pragma once

// EtcdStore: a store::Store whose keys live in an etcd v3 cluster, under a
// key prefix of their own ("/ctorchrun/<run id>/"), so that the rendezvous
// state machine and the agents' protocol run unchanged on etcd.
//
// Semantics are torch's, as HashStore and TcpStore have them (store/store.h):
//  - set() creates or overwrites; get() waits up to timeout() for the key.
//  - add() stores decimal text (as TcpStore does) and parses the old value as
//    C's stoll (leading blanks, trailing junk ignored); a missing key counts
//    as 0; a value that holds no number throws Error.
//  - compare_set() follows torch's four rules in one transaction: the key is
//    created when absent and `expected` is "", replaced when it holds
//    `expected` (including "" == ""), and otherwise left alone; the return is
//    `desired` after a store, `expected` when the key is absent and `expected`
//    is not "", else the current value. (A nested transaction serves the
//    expected == "" case: "absent" and "holds the empty string" are two
//    compares that etcd cannot OR in one.)
//  - wait()/get()/multi_get() read once, and when keys are missing watch them
//    from the revision after that read: no polling and no lost wake-up (a set
//    between the read and the watch is replayed by the watch). A wait on one
//    key that times out keeps its watch for the store's next wait on that
//    same key, which then neither reads nor opens a stream: consecutive
//    waits on a key (a caller waiting in slices) behave as one longer wait,
//    so a set since the first of them counts. One missing key
//    is watched alone; several through one watch on their longest common
//    prefix. As torch's TCP store counts a SET seen during a wait, a key set
//    and deleted again after the read counts as set. When etcd has compacted
//    the history a watch needs, the keys still missing are read again and
//    watched from that read.
//  - check() and the reads of wait()/multi_get() see one snapshot for up to
//    kMaxTxnOps keys (one transaction); more keys take one transaction per
//    kMaxTxnOps keys.
//  - set() is one transaction (create bound, or overwrite keeping the
//    binding); for a value over kInlineValueBytes, two (create if absent,
//    else overwrite if present). compare_set() with expected "" likewise.
//  - multi_set() is one transaction (atomic) for up to kMaxTxnOps distinct
//    keys holding kInlineValueBytes in all; beyond that, or with a key given
//    twice, it calls set() key by key in order (not atomic; the last value
//    of a repeated key wins, as in torch).
//  - append() and add() are compare-and-set loops on the key's mod_revision,
//    at most kMaxAttempts rounds each (TimeoutError past that: too many
//    concurrent writers of one key). Neither is replayed on another member
//    after an ambiguous failure (IoError instead), so neither applies twice.
//    add(key, 0) on a key holding a number is one read, and on a missing key
//    writes nothing and returns 0 (a deviation from torch's store, which
//    creates the key with "0": a poll of a counter leaves no key behind).
//  - tallies (store/store.h) never contend: tally_add() puts a key of its
//    own, key#tally/<token> (the entry as its value, no lease), and counts
//    the tally's keys in the same transaction, one round trip; etcd
//    serialises transactions, so the count is the enrolment's place. It is
//    recoverable: when that answer is lost (IoError after sending), the
//    enrolment is made if absent (a compare-and-put any member may replay)
//    and its place read back as the count of the tally's keys created up to
//    its key's creation revision, so it is counted once and given its
//    place, whether or not the first request applied.
//    tally_count() counts those keys, tally_entries() reads them. Many
//    writers cost one transaction each, where an add() on one key costs
//    O(writers) retries each.
//  - num_keys() counts every etcd key under the prefix, whoever wrote it,
//    including the binding markers below (key#held, key#left): it is the
//    number of keys in this store's part of etcd, as TcpStore's is the number
//    in its server.
//  - delete_key() returns whether the key existed. Retried after an ambiguous
//    failure like every idempotent request, so a delete that was applied but
//    whose answer was lost reports false.
// Keys are bytes; the full etcd key is prefix + key. Keys ending in "#held"
// or "#left" are markers (below); do not use those suffixes for data.
//
// Keys bound to a lease (etcd's counterpart of TcpStore's BIND_KEYS,
// store/protocol.h). After bind_keys_to_lease(ttl), every key this store
// creates (set, add, compare_set, append or multi_set on a missing key) is
// attached to a lease that a LeaseKeeper refreshes every ttl/3. When the
// process dies (or loses etcd for a whole TTL) the lease expires and etcd
// deletes those keys. Overwriting an existing key never changes its binding,
// whichever store writes it (etcd's ignore_lease), so a bound key stays bound
// to its creator, as with BIND_KEYS.
//
// etcd cannot write a gone marker when a lease expires: expiry only deletes
// the lease's keys. So the marker is written the other way round, at
// creation, and it is durable (no lease):
//  - creating bound key K also writes K#held (the lease id, no lease) and
//    deletes K#left, in the same transaction;
//  - deleting K on purpose (delete_key, from any store) deletes K and K#held
//    and writes K#left, in one transaction;
//  - creating K unbound deletes K#held and K#left, so the markers always
//    speak of K's current incarnation.
// Hence, read in one snapshot (key_status()):
//    K present, K#held present  -> kHeld   (bound, its holder alive)
//    K present, no K#held       -> kPresent (not bound)
//    K absent,  K#held present  -> kLost   (the lease expired: holder gone)
//    K absent,  K#left present  -> kLeft   (deleted on purpose)
//    neither                    -> kAbsent (never created, or unbound and deleted)
// Unlike "K absent and no K#left", kLost is positive evidence: a watcher
// need not know whether K was ever created. wait_vacated() blocks until K is
// absent and says why. There is no single key whose existence means "lost";
// check() answers for K + "#gone" (the TCP store's gone marker,
// store/protocol.h) with key_status(K) == kLost, so code written against
// BIND_KEYS checks runs unchanged here (wait() on such a key does not: it
// waits for a real key of that name). The markers stay until K is created
// again (any creation clears them) or someone deletes them like any key; a
// run's keys usually go with its prefix.
//
// Lease loss: when the keeper reports the lease lost (lease_lost()), the
// bound keys are gone or going. From then on set(), multi_set() and
// compare_set() with expected "" throw IoError naming the reason, and so do
// add() and append() on a missing key, until bind_keys_to_lease() is called
// again (a new lease; keys of the old one stay with it). Reads, waits,
// deletes and the other writes go on working.
// Destruction stops the keeper and leaves the lease to expire, exactly as if
// the process had died: delete keys first to leave them on purpose.
//
// Errors: IoError when no member answers within the client's read timeout
// (from the client; a blocked wait whose watch no member takes back for a
// whole read timeout fails so too, within about twice it), TimeoutError when a wait passes its
// deadline (naming the missing keys, the prefix and the timeout), Error when add() meets a
// non-integer, ConfigError for multi_set() with sizes that differ,
// ProtocolError/EtcdError as the client throws them. After any throw the
// store is usable (every request is its own exchange).
//
// Thread safety: every method may be called from several threads at once.
// Lifetime: shares ownership of the client; watches made for waits live only
// inside the call.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "etcd/client.h"
#include "etcd/lease_keeper.h"
#include "etcd/watch.h"
#include "store/store.h"

namespace ctorchrun::etcd {

namespace detail {
struct ClientCore;
}

class EtcdStore : public store::Store {
 public:
  // etcd's default --max-txn-ops: the most operations one transaction holds.
  static constexpr std::size_t kMaxTxnOps = 128;
  // Compare-and-set rounds of add() and append() before TimeoutError.
  static constexpr int kMaxAttempts = 256;
  // Values up to this size may appear twice in one transaction (a create
  // branch and an overwrite branch); larger ones are sent once per request,
  // in two steps, since etcd takes requests of about 1.5 MiB at most.
  static constexpr std::size_t kInlineValueBytes = 256 * 1024;
  static constexpr const char* kHeldSuffix = "#held";
  static constexpr const char* kLeftSuffix = "#left";
  // A tally's keys: key + kTallySuffix + a token unique to the enrolment.
  static constexpr const char* kTallySuffix = "#tally/";

  // `prefix` is prepended to every key (usually "/ctorchrun/<run id>/").
  // Throws ConfigError for a null client. Connects to nothing yet.
  EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix);
  ~EtcdStore() override;
  EtcdStore(const EtcdStore&) = delete;
  EtcdStore& operator=(const EtcdStore&) = delete;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t num_keys() override;
  bool delete_key(const std::string& key) override;
  void append(const std::string& key, const std::string& value) override;
  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override;
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override;
  int64_t tally_add(const std::string& key, const std::string& entry) override;
  int64_t tally_count(const std::string& key) override;
  std::vector<std::string> tally_entries(const std::string& key) override;

  // Binds every key this store creates from now on to a new lease of `ttl`
  // (rounded up to whole seconds, at least 1; etcd may raise it to its
  // minimum, 1.5 election timeouts), kept
  // alive every ttl/3 by a background thread. Calling it again starts another
  // lease (after lease_lost(), say). Throws IoError/EtcdError from the grant.
  void bind_keys_to_lease(std::chrono::milliseconds ttl);
  // The current lease's id, 0 when unbound.
  std::int64_t lease_id() const;
  // True once the keeper has given the lease up; lease_lost_reason() says why.
  bool lease_lost() const;
  std::string lease_lost_reason() const;

  enum class KeyStatus { kAbsent, kPresent, kHeld, kLost, kLeft };
  // `key` and its markers read in one snapshot; see the table above.
  KeyStatus key_status(const std::string& key);
  // Blocks until `key` does not exist, then returns kLost, kLeft or kAbsent
  // (returns at once when it is absent now). TimeoutError after `timeout`.
  KeyStatus wait_vacated(const std::string& key, std::chrono::milliseconds timeout);

  static std::string held_marker(const std::string& key) { return key + kHeldSuffix; }
  static std::string left_marker(const std::string& key) { return key + kLeftSuffix; }
  static const char* to_string(KeyStatus s);

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<EtcdClient>& client() const { return client_; }

 private:
  struct Snapshot;
  using Clock = std::chrono::steady_clock;

  // The lease for a creation (0 when unbound); IoError when it was lost.
  std::int64_t creation_lease() const;
  // Reads `full_keys` (prefix included); count_only reads no values.
  Snapshot read(const std::vector<std::string>& full_keys, bool count_only) const;
  // Waits until every full key in `missing` was put after `revision`.
  void wait_missing(std::vector<std::string> missing, std::int64_t revision,
                    Clock::time_point deadline, std::chrono::milliseconds timeout) const;
  std::string where() const;

  std::shared_ptr<EtcdClient> client_;
  // The client's own state (members, deadline, the member that answered
  // last), for the transactions the client's API has no call for (several
  // keys, nested compares, ignore_lease).
  std::shared_ptr<detail::ClientCore> core_;
  const std::string prefix_;

  mutable std::mutex lease_mutex_;
  std::unique_ptr<LeaseKeeper> keeper_;  // null while unbound

  // The watch of the last single-key wait that timed out, kept for the next
  // wait on the same key (a caller that waits in slices: one stream, no
  // reads). One slot; a call takes it out while it uses it.
  std::unique_ptr<Watch> take_parked(const std::string& full_key) const;
  void park(const std::string& full_key, std::unique_ptr<Watch> watch) const;
  mutable std::mutex parked_mutex_;
  mutable std::string parked_key_;
  mutable std::unique_ptr<Watch> parked_;

  // A random base drawn once per store, and a counter: tally_token().
  std::string tally_token();
  std::mutex token_mutex_;
  std::string token_base_;
  std::uint64_t token_count_ = 0;
};

}  // namespace ctorchrun::etcd

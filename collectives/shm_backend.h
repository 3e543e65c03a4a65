#pragma once

// The shared-memory path of the "gloo" backend: collectives between ranks of
// one host through one shared segment per group, instead of loopback TCP.
//
// When it is used: the backend called "gloo" is built by
// create_host_backend(). Every rank publishes in the group's store whether
// it wants the path (BackendContext::shm, CTORCHRUN_DIST_SHM) and where it
// runs (host name, boot id, the shared-memory directory's device and inode,
// the pid namespace), and, for the single-copy path below, the address and
// value of a probe word of its own. When every rank of a group of two or
// more wants it and all are on one host (in one pid namespace), the group
// runs all_reduce, broadcast, reduce, all_gather, reduce_scatter and
// barrier through shared memory; gather, scatter and all_to_all through
// gloo, in the group's order; send and recv through gloo. When all want it
// and the ranks are on several hosts, some with two ranks or more, the
// group is hierarchical: shared memory within each host, gloo between hosts
// (collectives/hier_backend.h, create_hier_backend, given the host
// identities of this exchange). Otherwise (the switch off on any rank, one
// rank a host, a segment that cannot be made or mapped on any rank) the
// group is gloo alone, and a fallback for a reason other than the switch or
// the hosts is logged once per process (a warning on logger "coll").
//
// The segment: rank 0 removes this host's stale segments (names whose
// creator pid is dead, sweep_stale_segments), creates
// /dev/shm/ctdist.<pidns>.<pid>.<job>.<group hash>.<nonce> (<job> from
// TORCHELASTIC_RUN_ID, <group hash> of the group's store prefix, so two
// groups or two jobs never share one), reserves its pages (posix_fallocate:
// a full /dev/shm is an error at set-up, never a SIGBUS later) and publishes
// the name; every rank maps it and says so in the store; once all have, the
// name is unlinked, so that a process killed later leaves nothing behind.
// Its size is bounded: a control page plus two buffers of a chunk per rank,
// the chunk 1 MiB, or less so that the segment stays within 32 MiB
// (CTORCHRUN_DIST_SHM_CHUNK sets it, 64 KiB to 64 MiB; rank 0's holds);
// when the directory cannot hold that, rank 0 halves the chunk down to
// 64 KiB before it gives up. Larger messages go in chunks.
//
// Cross-memory attach (CMA), off by default: at set-up every rank that
// wants it (CTORCHRUN_DIST_SHM_CMA, "1" on, "0" or unset off, anything else
// a ConfigError) lets any process of its user read its memory
// (prctl(PR_SET_PTRACER_ANY); EINVAL, no Yama, is fine) and publishes a
// probe word with the host exchange; each rank then reads every peer's
// word with process_vm_readv, checks its value and says whether it could
// in the "mapped" answer (no extra round trip). Only when every rank could
// does the group use the single-copy path; otherwise large all_reduce
// copies through the segment as below, and a reason other than the switch
// (a seccomp filter, Yama's ptrace_scope 2 or 3, a non-dumpable process) is
// logged once per process at info on logger "coll". A rank whose sizes
// (below) leave the path nothing, as in groups of more than two ranks by
// default, neither calls prctl nor publishes a probe, and says "off".
//
// Algorithms: in a CMA group of two ranks (switched on), from kShmCmaBytes (4 MiB) to
// kShmCmaMaxBytes (32 MiB; CTORCHRUN_DIST_SHM_CMA_MIN and _MAX set the
// sizes at any group size, rank 0's hold) an all_reduce or reduce is
// single-copy: each rank writes its buffer's address and length next to
// its call signature; barrier (the call check); rank r reduces elements
// [lo(r), lo(r + 1)) in rank order in place in its own buffer, reading
// each peer's elements with process_vm_readv in 256 KiB pieces into a
// scratch that stays in cache; barrier; every rank that needs the result
// reads the other shares straight from their owners' buffers into its
// own; barrier (no one reads its buffer any more). 2.5 bytes of memory
// traffic per byte at two ranks against the chunked path's 4.5, and three
// barriers a call against two a chunk. Outside that window the segment
// path is the faster one on the benchmark VM (a 2-core VM): below 4 MiB
// everything stays in cache, where memcpy runs at 9-20 GB/s and
// process_vm_readv, which copies page by page, at about 5.5 (1 MiB: 115 us
// against 262); above 32 MiB the segment's chunk buffers still stay in
// cache, so both paths come to about 2 bytes of DRAM traffic a byte (read
// the input, write the result) and the slower copy decides; with more
// ranks each reads (n - 1) / n of the message twice by that copy where the
// segment path uses memcpy (1.0 to 1.4x slower at 4 ranks at every size
// measured). Since the chunk became 1 MiB the segment path is the faster
// one inside that window too on the benchmark VM (1.3-1.6x at 4-32 MiB, two
// ranks, 2026-11-28), hence off by default; where the kernel copies faster
// than memory bandwidth is shared, switch it on and measure.
//
// Otherwise, up to kShmFlatBytes an all_reduce is flat (every rank copies
// its buffer in, then reduces all of them itself, in rank order); larger
// ones are a reduce-scatter then an all-gather per chunk (each rank reduces
// its share of the chunk, in rank order, then copies the others' shares).
// Reductions are reduce_kernels' loops, each element in rank order on
// every path, so the paths agree bit for bit. The results equal gloo's bit
// for bit for integers, min and max at any size (min and max pass a NaN on
// from either side; which of two NaNs, or of +0 and -0, is kept follows the
// order), and for every type at two ranks (a + b == b + a); at three ranks
// and more, floating sums and products are summed in rank order where
// gloo's ring starts elsewhere, so they may differ in the last bits.
//
// Synchronisation: a barrier is a counter per rank (its own cache line);
// waiting spins briefly, yields, then sleeps on a futex in slices while it
// checks the group's failure flag, each peer's liveness (a pidfd, else
// kill(pid, 0)) and the op's deadline. A peer that died or destroyed its
// group fails the waiters with IoError within a slice (about 100 ms); a
// peer that is alive but stuck makes them throw TimeoutError at the op's
// deadline; a rank whose op failed raises the group's failure flag so that
// the others fail at once with IoError. After either the group is unusable.
// On the single-copy path a read of a peer that died fails the same way
// (the same IoError, at once: process_vm_readv never waits); a read that
// fails otherwise is an IoError naming the errno.
//
// Calls are checked as gloo checks them (BackendContext::check_calls): each
// rank writes its call's 32-byte signature into the segment with its first
// chunk (or its buffer's address) and compares all of them after the first barrier, so a mismatch
// is the same InvalidArgument on every rank and the group stays usable. Collectives run in the
// order they are started, one at a time: an _async one on the group's thread, a blocking one on its
// caller's thread once everything started before it is done.

#include <memory>
#include <string>

#include "collectives/backend.h"

namespace ctorchrun::dist {

// all_reduce up to this many bytes is flat (one barrier); above, chunked
// reduce-scatter + all-gather (two barriers a chunk).
inline constexpr size_t kShmFlatBytes = 64 * 1024;

// In groups of up to kShmCmaRanks, all_reduce and reduce from kShmCmaBytes
// up to kShmCmaMaxBytes read the peers' buffers with process_vm_readv where
// every rank can (single copy, three barriers a call);
// CTORCHRUN_DIST_SHM_CMA_MIN and _MAX override the sizes at any group size
// (rank 0's hold). Elsewhere the segment path is faster (see above).
inline constexpr int kShmCmaRanks = 2;
inline constexpr size_t kShmCmaBytes = 4 * 1024 * 1024;
inline constexpr size_t kShmCmaMaxBytes = 32 * 1024 * 1024;

// How many all_reduce and reduce calls of this process went by cross-memory
// attach (for tests and diagnostics).
uint64_t shm_cma_calls();

// The backend "gloo" names (see above). Throws as create_gloo_backend does,
// and TimeoutError when a rank does not reach the shared-memory set-up
// within context.timeout.
std::unique_ptr<Backend> create_host_backend(const BackendContext& context);

// Unlinks the segments in `dir` whose creator (the pid in the name, in this
// pid namespace) no longer runs; returns how many it removed.
int sweep_stale_segments(const std::string& dir);

}  // namespace ctorchrun::dist

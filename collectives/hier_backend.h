#pragma once

// The hierarchical path of the "gloo" backend: a group whose ranks span
// several hosts moves its collectives through shared memory within each
// host and gloo between one rank of each host, instead of gloo between all.
//
// When it is used: create_host_backend() (collectives/shm_backend.h) learns
// from its "shm/host" exchange whether every rank wants shared memory
// (BackendContext::shm, CTORCHRUN_DIST_SHM) and where each runs. When all
// want it, the ranks are on two or more hosts, and at least one host holds
// two or more of them, the group is a HierBackend; its transport() is
// "hier". With one rank per host it is gloo alone (nothing to share).
//
// What it is made of, built in this order within the group's set-up timeout:
//  - the host group: this host's ranks, in group-rank order (its rank 0, the
//    host's lowest group rank, is the host's leader), built by
//    create_host_backend() itself under the store prefix "hier/host<k>"
//    (hosts numbered by their lowest group rank; its own "shm/host"
//    exchange is among the host's ranks) and the group key extended
//    likewise: shared memory on a host of two or more ranks (or gloo there
//    when the segment cannot be made, logged as on one host), a group of one
//    on a host of one;
//  - the leaders' group: gloo between the leaders, prefix "hier/leaders";
//    only leaders build it;
//  - the whole group's gloo, as a flat group would have it.
// The subgroups check no calls of their own (see "Calls" below).
//
// Which op goes which way (H: host group, L: leaders' group):
//  - all_reduce: H reduce to the leader, L all_reduce, H broadcast from the
//    leader. An average is a sum all the way, divided once by the group's
//    size by the leaders before the last broadcast: exact, not an average
//    of the hosts' averages. A message larger than a piece
//    (CTORCHRUN_DIST_HIER_PIECE, default 4 MiB) goes in pieces,
//    pipelined: H reduces the next piece while L all-reduces this one, and
//    H broadcasts pieces while L does the later ones.
//  - reduce to root R: H reduce to the leader, L reduce to R's host's
//    leader, then, when R is not its host's leader, an H broadcast from the
//    leader on R's host only. R ends with the result; every other rank's
//    buffer is left unspecified (partial sums, or the result on R's host),
//    as gloo's reduce leaves them and ProcessGroup::reduce allows.
//  - reduce_scatter: an all_reduce, as above, of a copy of the input; each
//    rank keeps its slice (gloo's own reduce_scatter is the same over all
//    ranks, so the message crosses hosts once per leader, not per rank).
//  - broadcast from R: when R is not its host's leader, an H broadcast from
//    R on R's host; then L broadcast from R's host; then an H broadcast from
//    the leader on every other host.
//  - all_gather: H all_gather to every rank of the host; the leaders
//    all_gather their hosts' blocks (padded to the largest host); each
//    leader puts the blocks in group-rank order; H broadcast of the result.
//  - barrier: H barrier, L barrier, H barrier.
//  - gather, scatter, all_to_all: the whole group's gloo, in the group's
//    order (their data goes rank to rank; a detour through leaders would
//    move more). send and recv: the whole group's gloo at once, not queued.
// Collectives run in the order they are started, one at a time: an _async
// one on the group's thread, a blocking one on its caller's thread once
// everything started before it is done. Each step calls a subgroup with
// async false, except the host steps of a pipelined all_reduce, which run
// on the host group's own thread and are all waited for before the call
// ends.
//
// Results: integers, min and max are bit for bit those of a flat gloo
// group (min and max up to which of two NaNs, or of +0 and -0, is kept);
// so is every broadcast and gather. Floating sums, products and
// averages are summed in another order (within each host in rank order,
// then across hosts), so at three ranks and more they may differ from a
// flat group's in the last bits, within the type's rounding.
//
// Calls (BackendContext::check_calls): before any data moves, each rank's
// 32-byte call signature goes to all: an H all_gather of the signatures,
// an L all_gather of each host's signatures (padded to the fullest host),
// an H broadcast of the whole table
// (three small steps, each of a fixed shape whatever the call). Every rank
// then compares the same table, so a call that differs between any two
// ranks, on one host or on two, is the same InvalidArgument on every rank,
// no buffer has changed, and the group stays usable. An all_reduce of up to
// 4 KiB rides along: each record carries the rank's data, the leaders
// reduce it (within the host in rank order, then in host order) once the
// signatures agree, and the last step brings the result with the table; so
// a small checked all_reduce is three steps, as an unchecked one is (4 ranks
// as 2 x 2 on a loaded 2-core machine: median 0.6 ms a 4-byte call either
// way, flat gloo 6.5 ms). A larger call pays the three steps on top of its
// own (about the cost of a small all_reduce); CTORCHRUN_DIST_CHECK_CALLS=0
// skips them.
//
// Failures: a rank whose step fails (a peer died, a connection dropped, the
// op's deadline passed) destroys its subgroups, so that the peers waiting
// for it in either fail at once with IoError instead of at their deadline:
// a leader whose L step fails wakes its host's ranks (they see the leader
// leave the shared segment), and a leader whose H step fails (a rank of its
// host died) leaves L, whose other leaders see the connection close and
// pass it on to their hosts alike. A rank that
// is alive but stuck makes its peers throw TimeoutError at the op's deadline
// (one deadline for all of the op's steps), or IoError when a peer's
// timeout reaches them first. After either the group is unusable: every
// later op throws IoError.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/backend.h"

namespace ctorchrun::dist {

// The HierBackend of `context`'s group, given every rank's host identity (in
// group-rank order, as create_host_backend exchanged them) and the piece a
// large all_reduce is cut in (bytes; the same on every rank, rank 0's
// CTORCHRUN_DIST_HIER_PIECE or 4 MiB); null when no host has two ranks or
// all ranks are on one host. Set-up ends by `deadline` or throws
// TimeoutError; otherwise it throws as create_gloo_backend and
// create_host_backend do.
std::unique_ptr<Backend> create_hier_backend(const BackendContext& context,
                                             const std::vector<std::string>& hosts, size_t piece,
                                             std::chrono::steady_clock::time_point deadline);

}  // namespace ctorchrun::dist

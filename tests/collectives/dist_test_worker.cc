// Worker for the multi-process libctorch_dist tests, run under ctorchrun (or
// started by a test with the launcher's environment).
//
//   dist_test_worker matrix
//     every op x data type x reduce op on sizes 1, 7 (odd), 1001 (odd) and one
//     element above gloo's 1 MiB segment, in blocking and async forms, on the
//     world group and on subgroups; inputs are small integers, results are
//     compared bit for bit. Prints "matrix: N checks passed" (exit 0) or each
//     failure (exit 1).
//   dist_test_worker peer-death VICTIM kill|kill-late|stop TIMEOUT_MS [COUNT [OP]]
//     all ranks all-reduce 4 MiB in a loop (COUNT float32 when given; OP
//     reduce_scatter: reduce-scatter COUNT float32 instead); on the third round rank
//     VICTIM starts the all-reduce and then SIGKILLs (kill-late: 5 ms later) or SIGSTOPs itself.
//     Each rank prints "transport T" first; the others print "survivor R failed after MS ms: TYPE:
//     WHAT" (TYPE: IoError, TimeoutError, other) and exit 7; each prints "single-copy calls N"
//     (shm_cma_calls) after round 1.
//   dist_test_worker versus [TRANSPORT]
//     two groups of the same ranks, one on shared memory (InitOptions::shm,
//     whose transport must be TRANSPORT, default shm; hier: reduce and
//     broadcast also from root 1 and from root 0)
//     and one on gloo alone; every shared-memory op x data type x reduce op
//     on pseudo-random inputs, at sizes on both sides of the flat limit and
//     of a chunk, compared between the two: bit for bit at two ranks, for
//     integers and for min and max; floating sums, products and averages at
//     three ranks or more within a tolerance (the shared-memory path sums in
//     rank order, gloo's ring does not). Prints "versus: rank R of W
//     (shm|gloo): N checks, B bit-identical" (exit 0) or each failure (exit 1).
//   dist_test_worker cma
//     four groups of the same ranks: shared memory with the single-copy path
//     (cross-memory attach, switched on) at its default sizes, the same from one byte to
//     just below the default threshold (CTORCHRUN_DIST_SHM_CMA_MIN=1,
//     _MAX=4194303), shared memory without it (CTORCHRUN_DIST_SHM_CMA=0) and
//     gloo alone; all_reduce and reduce of every data type x reduce op at
//     sizes up to several single-copy pieces a rank (odd counts, counts below
//     the world size), and sums on both sides of the default threshold
//     (4 MiB: one type of each width at two ranks, where the default takes
//     the single copy; float32 alone above, where it does not), compared:
//     the shared-memory groups bit for bit among
//     themselves, with gloo as `versus` does. Counts the calls that went by
//     cross-memory attach (shm_cma_calls) on each group against the calls
//     within its sizes, and that a group with the switch unset takes none.
//     Prints "cma: rank R of W: N checks, C single-copy
//     calls" (exit 0) or each failure (exit 1).
//   dist_test_worker loop ROUNDS [COUNT]
//     prints "transport T" (the world group's), then all-reduces ROUNDS times
//     COUNT float32 (default 3000; timeout 20 s)
//     on the world group and on a second group of the same ranks in turn,
//     each round's values its own, checked; prints "loop: rank R ok" (exit 0).
//   dist_test_worker mismatch KIND TIMEOUT_MS
//     prints "transport T", then the ranks all-reduce with arguments that
//     differ by KIND: count (4 vs 3 float32 on rank 1), dtype (float32 vs
//     int32 on rank 1), op (sum vs max on rank 1), large (1000 vs 500
//     float32), upper (4 float32, 3 on the upper half of the ranks),
//     straddle (4 float32, 2000 on the upper half). Each
//     rank prints "mismatch R: OUTCOME" (the error's type and text and
//     whether its buffer is intact, or what it got), then all-reduces once more, alike on all, and
//     prints "after R: ok" or what went wrong. Exit 0.
//   dist_test_worker async-order
//     prints "transport T", then starts 24 all-reduces, broadcasts (from
//     rank i mod world), all-gathers and barriers of its own values at
//     once, waits for them last to first and checks every result; prints
//     "async: rank R ok" (exit 0) or each failure (exit 1).

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/process_group.h"
#include "collectives/shm_backend.h"
#include "common/error.h"

namespace dist = ctorchrun::dist;
using dist::DataType;
using dist::ReduceOp;

namespace {

const DataType kTypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                           DataType::kBFloat16, DataType::kInt8,    DataType::kUInt8,
                           DataType::kInt32,    DataType::kInt64};
const ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                               ReduceOp::kAverage};

// Element i of rank r: 1, 2 or 3, so sums, products (<= 81) and averages of
// up to four ranks are exact or rounded once in every type.
int value(int r, size_t i) { return static_cast<int>((i + static_cast<size_t>(r)) % 3) + 1; }

void encode(DataType t, double v, unsigned char* out) {
  switch (t) {
    case DataType::kFloat32: {
      float x = static_cast<float>(v);
      std::memcpy(out, &x, 4);
      return;
    }
    case DataType::kFloat64:
      std::memcpy(out, &v, 8);
      return;
    case DataType::kFloat16: {
      uint16_t x = dist::float_to_half(static_cast<float>(v));
      std::memcpy(out, &x, 2);
      return;
    }
    case DataType::kBFloat16: {
      uint16_t x = dist::float_to_bfloat16(static_cast<float>(v));
      std::memcpy(out, &x, 2);
      return;
    }
    case DataType::kInt8: {
      auto x = static_cast<int8_t>(v);
      std::memcpy(out, &x, 1);
      return;
    }
    case DataType::kUInt8: {
      auto x = static_cast<uint8_t>(v);
      std::memcpy(out, &x, 1);
      return;
    }
    case DataType::kInt32: {
      auto x = static_cast<int32_t>(v);
      std::memcpy(out, &x, 4);
      return;
    }
    case DataType::kInt64: {
      auto x = static_cast<int64_t>(v);
      std::memcpy(out, &x, 8);
      return;
    }
  }
}

// The reduction over ranks of value(r, i), as the library computes it: exact
// integers, and for the average one division (in double for float64, in
// float, then rounded to the type, for the others).
double reduced(ReduceOp op, DataType t, int world, size_t i) {
  double acc = value(0, i);
  for (int r = 1; r < world; ++r) {
    const double v = value(r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAverage:
        acc += v;
        break;
      case ReduceOp::kProduct:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  if (op != ReduceOp::kAverage) return acc;
  if (t == DataType::kFloat64) return acc / world;
  return static_cast<double>(static_cast<float>(acc) / static_cast<float>(world));
}

struct Raw {
  DataType type;
  std::vector<unsigned char> bytes;
  Raw(DataType t, size_t count) : type(t), bytes(count * dist::element_size(t)) {}
  size_t count() const { return bytes.size() / dist::element_size(type); }
  dist::Buffer buffer() { return dist::Buffer{bytes.data(), count(), type, {}}; }
  void set(size_t i, double v) { encode(type, v, bytes.data() + i * dist::element_size(type)); }
};

class Checker {
 public:
  Checker(int global_rank) : global_rank_(global_rank) {}

  // Compares `got` with `want` element by element, bit for bit.
  void expect(const Raw& got, const Raw& want, const std::string& what) {
    ++checks_;
    const size_t es = dist::element_size(got.type);
    for (size_t i = 0; i < want.count(); ++i) {
      if (std::memcmp(got.bytes.data() + i * es, want.bytes.data() + i * es, es) != 0) {
        ++failures_;
        std::cerr << "rank " << global_rank_ << ": " << what << ": element " << i << " differs\n";
        return;
      }
    }
  }
  void fail(const std::string& what) {
    ++failures_;
    std::cerr << "rank " << global_rank_ << ": " << what << "\n";
  }
  int checks() const { return checks_; }
  int failures() const { return failures_; }

 private:
  int global_rank_;
  int checks_ = 0;
  int failures_ = 0;
};

std::string label(const char* op, DataType t, size_t n, const char* extra = "") {
  return std::string(op) + " " + dist::to_string(t) + " x" + std::to_string(n) + extra;
}

void run_matrix(dist::ProcessGroup& pg, Checker& c, const std::vector<DataType>& types,
                const std::vector<size_t>& sizes, bool all_ops) {
  const int rank = pg.rank();
  const int world = pg.size();
  const auto w = static_cast<size_t>(world);
  for (DataType t : types) {
    for (size_t n : sizes) {
      auto filled = [&](size_t count, int r, size_t offset = 0) {
        Raw raw(t, count);
        for (size_t i = 0; i < count; ++i) raw.set(i, value(r, offset + i));
        return raw;
      };
      // all_reduce, reduce, reduce_scatter with every reduce op.
      for (ReduceOp op : kReduceOps) {
        if (op == ReduceOp::kAverage && !dist::is_floating(t)) continue;
        if (!all_ops && op != ReduceOp::kSum && op != ReduceOp::kAverage) continue;
        const std::string tag = std::string(" ") + dist::to_string(op);
        Raw want(t, n);
        for (size_t i = 0; i < n; ++i) want.set(i, reduced(op, t, world, i));
        Raw buf = filled(n, rank);
        pg.all_reduce(buf.buffer(), op);
        c.expect(buf, want, label("all_reduce", t, n, tag.c_str()));
        if (!all_ops) continue;
        const int root = world - 1;
        Raw red = filled(n, rank);
        pg.reduce(red.buffer(), root, op);
        if (rank == root) c.expect(red, want, label("reduce", t, n, tag.c_str()));
        Raw in(t, n * w);
        for (size_t i = 0; i < n * w; ++i) in.set(i, value(rank, i));
        Raw out(t, n);
        pg.reduce_scatter(in.buffer(), out.buffer(), op);
        Raw want_rs(t, n);
        for (size_t i = 0; i < n; ++i) {
          want_rs.set(i, reduced(op, t, world, static_cast<size_t>(rank) * n + i));
        }
        c.expect(out, want_rs, label("reduce_scatter", t, n, tag.c_str()));
      }
      // broadcast from rank 1 (0 alone).
      {
        const int root = 1 % world;
        Raw buf = filled(n, rank);
        pg.broadcast(buf.buffer(), root);
        c.expect(buf, filled(n, root), label("broadcast", t, n));
      }
      // all_gather: output = every rank's input in rank order.
      Raw gathered_want(t, n * w);
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < n; ++i)
          gathered_want.set(static_cast<size_t>(r) * n + i, value(r, i));
      }
      {
        Raw in = filled(n, rank);
        Raw out(t, n * w);
        pg.all_gather(in.buffer(), out.buffer());
        c.expect(out, gathered_want, label("all_gather", t, n));
      }
      if (!all_ops) continue;
      {
        Raw in = filled(n, rank);
        Raw out(t, rank == 0 ? n * w : 0);
        pg.gather(in.buffer(), out.buffer(), 0);
        if (rank == 0) c.expect(out, gathered_want, label("gather", t, n));
      }
      {
        const int root = world - 1;
        Raw in(t, rank == root ? n * w : 0);
        for (size_t i = 0; i < in.count(); ++i) in.set(i, value(root, i));
        Raw out(t, n);
        pg.scatter(in.buffer(), out.buffer(), root);
        c.expect(out, filled(n, root, static_cast<size_t>(rank) * n), label("scatter", t, n));
      }
      {
        // Slice j of rank i holds value(i, j*n + k); after the exchange slice
        // i of rank j must hold it.
        Raw in(t, n * w);
        for (size_t i = 0; i < n * w; ++i) in.set(i, value(rank, i));
        Raw out(t, n * w);
        pg.all_to_all(in.buffer(), out.buffer());
        Raw want(t, n * w);
        for (int src = 0; src < world; ++src) {
          for (size_t k = 0; k < n; ++k) {
            want.set(static_cast<size_t>(src) * n + k,
                     value(src, static_cast<size_t>(rank) * n + k));
          }
        }
        c.expect(out, want, label("all_to_all", t, n));
      }
      if (world > 1) {
        // A ring of send/recv: the send posted async, the recv blocking.
        const int next = (rank + 1) % world;
        const int prev = (rank + world - 1) % world;
        Raw out = filled(n, rank);
        Raw in(t, n);
        auto sent = pg.send_async(out.buffer(), next, 5);
        pg.recv(in.buffer(), prev, 5);
        sent->wait();
        c.expect(in, filled(n, prev), label("send/recv", t, n));
      }
    }
    // Async forms: a batch started together, waited for in reverse order.
    {
      const size_t n = 7;
      std::vector<Raw> bufs;
      std::vector<Raw> wants;
      std::vector<dist::WorkHandle> works;
      for (ReduceOp op : kReduceOps) {
        if (op == ReduceOp::kAverage && !dist::is_floating(t)) continue;
        Raw buf(t, n);
        Raw want(t, n);
        for (size_t i = 0; i < n; ++i) {
          buf.set(i, value(rank, i));
          want.set(i, reduced(op, t, world, i));
        }
        bufs.push_back(std::move(buf));
        wants.push_back(std::move(want));
      }
      size_t k = 0;
      for (ReduceOp op : kReduceOps) {
        if (op == ReduceOp::kAverage && !dist::is_floating(t)) continue;
        works.push_back(pg.all_reduce_async(bufs[k++].buffer(), op));
      }
      Raw bc(t, n);
      for (size_t i = 0; i < n; ++i) bc.set(i, value(rank, i));
      works.push_back(pg.broadcast_async(bc.buffer(), 0));
      Raw gin(t, n);
      for (size_t i = 0; i < n; ++i) gin.set(i, value(rank, i));
      Raw gout(t, n * w);
      works.push_back(pg.all_gather_async(gin.buffer(), gout.buffer()));
      works.push_back(pg.barrier_async());
      for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
      for (size_t j = 0; j < bufs.size(); ++j) {
        if (!works[j]->is_completed()) c.fail("async work not completed after wait");
        c.expect(bufs[j], wants[j], label("all_reduce_async", t, n));
      }
      Raw bc_want(t, n);
      for (size_t i = 0; i < n; ++i) bc_want.set(i, value(0, i));
      c.expect(bc, bc_want, label("broadcast_async", t, n));
      Raw g_want(t, n * w);
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < n; ++i) g_want.set(static_cast<size_t>(r) * n + i, value(r, i));
      }
      c.expect(gout, g_want, label("all_gather_async", t, n));
    }
  }
  pg.barrier();
}

int matrix() {
  auto pg = dist::init_process_group();
  Checker c(pg->rank());
  const int world = pg->size();
  std::vector<DataType> all(std::begin(kTypes), std::end(kTypes));
  for (DataType t : all) {
    // One element above gloo's 1 MiB segment (AllreduceOptions::kMaxSegmentSize).
    const size_t big = (size_t{1} << 20) / dist::element_size(t) + 1;
    run_matrix(*pg, c, {t}, {1, 7, 1001, big}, true);
  }
  // Subgroups: every rank calls new_group with the same lists.
  std::vector<int> reversed;
  for (int r = world - 1; r >= 0; --r) reversed.push_back(r);
  std::vector<int> evens;
  for (int r = 0; r < world; r += 2) evens.push_back(r);
  std::vector<int> without_zero;
  for (int r = 1; r < world; ++r) without_zero.push_back(r);
  std::vector<std::vector<int>> lists = {reversed, evens};
  if (!without_zero.empty()) lists.push_back(without_zero);
  for (const auto& ranks : lists) {
    auto sub = pg->new_group(ranks);
    const bool member = std::find(ranks.begin(), ranks.end(), pg->rank()) != ranks.end();
    if (member != (sub != nullptr)) {
      c.fail("new_group membership wrong");
      continue;
    }
    if (!sub) continue;
    const auto position = std::find(ranks.begin(), ranks.end(), pg->rank()) - ranks.begin();
    if (sub->rank() != position || sub->size() != static_cast<int>(ranks.size()) ||
        sub->global_ranks() != ranks) {
      c.fail("subgroup ranks wrong");
    }
    run_matrix(*sub, c, {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}, {1, 1001},
               true);
  }
  pg->barrier();
  if (c.failures() > 0) {
    std::cerr << "rank " << pg->rank() << ": " << c.failures() << " of " << c.checks()
              << " checks failed\n";
    return 1;
  }
  std::cout << "matrix: rank " << pg->rank() << " of " << world << ": " << c.checks()
            << " checks passed" << std::endl;
  return 0;
}

const char* error_type(const std::exception& e) {
  if (dynamic_cast<const ctorchrun::TimeoutError*>(&e) != nullptr) return "TimeoutError";
  if (dynamic_cast<const ctorchrun::IoError*>(&e) != nullptr) return "IoError";
  if (dynamic_cast<const ctorchrun::InvalidArgument*>(&e) != nullptr) return "InvalidArgument";
  return "other";
}

int peer_death(int victim, const std::string& how, int timeout_ms, size_t count,
               const std::string& op) {
  dist::InitOptions options;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  auto pg = dist::init_process_group(options);
  std::cout << "transport " << pg->transport() << std::endl;
  std::vector<float> data(count, 1.0f);
  std::vector<float> share(count / static_cast<size_t>(pg->size()));
  for (int round = 0;; ++round) {
    if (round == 2) std::cout << "single-copy calls " << dist::shm_cma_calls() << std::endl;
    const auto start = std::chrono::steady_clock::now();
    try {
      auto work = op == "reduce_scatter"
                      ? pg->reduce_scatter_async(dist::make_buffer(data.data(), data.size()),
                                                 dist::make_buffer(share.data(), share.size()))
                      : pg->all_reduce_async(dist::make_buffer(data.data(), data.size()));
      if (round == 2 && pg->rank() == victim) {
        std::cout << "victim " << victim << " " << how << "s itself" << std::endl;
        // kill-late: once the op (on the group's thread) is under way.
        if (how == "kill-late") std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ::raise(how == "stop" ? SIGSTOP : SIGKILL);
      }
      work->wait();
    } catch (const std::exception& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count();
      std::cout << "survivor " << pg->rank() << " failed after " << ms << " ms: " << error_type(e)
                << ": " << e.what() << std::endl;
      std::_Exit(7);
    }
    if (round > 1000) return 0;  // bounded: the victim stops the loop long before
  }
}

// A pseudo-random value for element i of rank r in `t`, exact in every
// type: integers 1-3 (sums and products of four ranks fit in int8), floats
// with fractional parts, near 1 for products so that they stay in range.
double random_value(DataType t, ReduceOp op, int r, size_t i) {
  uint64_t h = (static_cast<uint64_t>(r) + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  h ^= h >> 29;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 32;
  if (!dist::is_floating(t)) return static_cast<double>(h % 3 + 1);
  if (op == ReduceOp::kProduct) return 1.0 + static_cast<double>(h % 257) / 1024.0 - 0.125;
  return (static_cast<double>(h % 4001) - 2000.0) / 256.0;
}

double decode(DataType t, const unsigned char* in) {
  switch (t) {
    case DataType::kFloat32: {
      float x;
      std::memcpy(&x, in, 4);
      return x;
    }
    case DataType::kFloat64: {
      double x;
      std::memcpy(&x, in, 8);
      return x;
    }
    case DataType::kFloat16: {
      uint16_t x;
      std::memcpy(&x, in, 2);
      return dist::half_to_float(x);
    }
    case DataType::kBFloat16: {
      uint16_t x;
      std::memcpy(&x, in, 2);
      return dist::bfloat16_to_float(x);
    }
    case DataType::kInt8:
      return static_cast<int8_t>(in[0]);
    case DataType::kUInt8:
      return in[0];
    case DataType::kInt32: {
      int32_t x;
      std::memcpy(&x, in, 4);
      return x;
    }
    case DataType::kInt64: {
      int64_t x;
      std::memcpy(&x, in, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

// Relative tolerance where the order of a floating reduction differs.
double tolerance(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return 1e-5;
    case DataType::kFloat64:
      return 1e-12;
    case DataType::kFloat16:
      return 1e-2;
    case DataType::kBFloat16:
      return 5e-2;
    default:
      return 0;
  }
}

int versus(const std::string& want) {
  dist::InitOptions on;
  on.shm = true;
  auto shm = dist::init_process_group(on);
  dist::InitOptions off;
  off.shm = false;
  auto gloo = dist::init_process_group(off);
  const int rank = shm->rank();
  const int world = shm->size();
  const auto w = static_cast<size_t>(world);
  Checker c(rank);
  if (world > 1 && shm->transport() != want) c.fail("the shm group runs on " + shm->transport());
  // The hierarchical path hands results on within a host: roots that are
  // and are not their host's first rank.
  std::vector<int> roots = {world - 1};
  std::vector<int> broadcast_roots = {1 % world};
  if (want == "hier") {
    roots = {world - 1, 1 % world, 0};
    broadcast_roots = {1 % world, 0, world - 1};
  }
  if (gloo->transport() != "gloo") c.fail("the gloo group runs on " + gloo->transport());
  int identical = 0;
  // `exact`: the two paths must agree bit for bit; otherwise within the
  // type's tolerance relative to the summands' magnitude (up to 8 a rank:
  // rounding in another order errs relative to it, not to the sum, which
  // may have cancelled) or, for products, to the result.
  auto compare = [&](const Raw& a, const Raw& b, bool exact, const std::string& what,
                     bool product = false) {
    const size_t es = dist::element_size(a.type);
    bool same = a.bytes == b.bytes;
    if (same) {
      ++identical;
    } else if (exact) {
      c.fail(what + ": shm and gloo differ where they must be bit-identical");
      return;
    }
    for (size_t i = 0; i < a.count() && !same; ++i) {
      const double x = decode(a.type, a.bytes.data() + i * es);
      const double y = decode(a.type, b.bytes.data() + i * es);
      const double scale = product ? std::max(1.0, std::abs(y)) : 8.0 * world;
      if (std::abs(x - y) > tolerance(a.type) * scale) {
        c.fail(what + ": element " + std::to_string(i) + " is " + std::to_string(x) + " on shm, " +
               std::to_string(y) + " on gloo");
        return;
      }
    }
    c.expect(a, a, what);  // counts the check
  };
  // One element, odd sizes, the flat limit's sides (64 KiB), several chunks
  // (the test runs with CTORCHRUN_DIST_SHM_CHUNK=65536).
  for (DataType t : kTypes) {
    const size_t es = dist::element_size(t);
    std::vector<size_t> sizes = {1, 7, 1001, (64u << 10) / es, (64u << 10) / es + 3};
    // Several chunks: one type of each width, to keep the sanitizer build's run short.
    if (t == DataType::kFloat32 || t == DataType::kBFloat16 || t == DataType::kInt64 ||
        t == DataType::kUInt8) {
      sizes.push_back((200u << 10) / es + 5);
    }
    for (size_t n : sizes) {
      auto fill = [&](size_t count, ReduceOp op, size_t offset = 0) {
        Raw raw(t, count);
        for (size_t i = 0; i < count; ++i) raw.set(i, random_value(t, op, rank, offset + i));
        return raw;
      };
      for (ReduceOp op : kReduceOps) {
        if (op == ReduceOp::kAverage && !dist::is_floating(t)) continue;
        const bool order_free =
            world <= 2 || !dist::is_floating(t) || op == ReduceOp::kMin || op == ReduceOp::kMax;
        const std::string tag = std::string(" ") + dist::to_string(op);
        Raw a = fill(n, op), b = fill(n, op);
        shm->all_reduce(a.buffer(), op);
        gloo->all_reduce(b.buffer(), op);
        const bool product = op == ReduceOp::kProduct;
        compare(a, b, order_free, label("all_reduce", t, n, tag.c_str()), product);
        for (int root : roots) {
          Raw ra = fill(n, op), rb = fill(n, op);
          shm->reduce(ra.buffer(), root, op);
          gloo->reduce(rb.buffer(), root, op);
          if (rank == root)
            compare(ra, rb, order_free, label("reduce", t, n, tag.c_str()), product);
        }
        Raw in = fill(n * w, op);
        Raw oa(t, n), ob(t, n);
        shm->reduce_scatter(in.buffer(), oa.buffer(), op);
        gloo->reduce_scatter(in.buffer(), ob.buffer(), op);
        compare(oa, ob, order_free, label("reduce_scatter", t, n, tag.c_str()), product);
      }
      for (int root : broadcast_roots) {
        Raw ba = fill(n, ReduceOp::kSum), bb = fill(n, ReduceOp::kSum);
        shm->broadcast(ba.buffer(), root);
        gloo->broadcast(bb.buffer(), root);
        compare(ba, bb, true, label("broadcast", t, n));
      }
      Raw gin = fill(n, ReduceOp::kSum);
      Raw ga(t, n * w), gb(t, n * w);
      shm->all_gather(gin.buffer(), ga.buffer());
      gloo->all_gather(gin.buffer(), gb.buffer());
      compare(ga, gb, true, label("all_gather", t, n));
      shm->barrier();
    }
    // The ops the shared-memory group hands to gloo, in its order.
    Raw in = [&] {
      Raw raw(t, 5 * w);
      for (size_t i = 0; i < raw.count(); ++i) raw.set(i, random_value(t, ReduceOp::kSum, rank, i));
      return raw;
    }();
    Raw aa(t, 5 * w), ab(t, 5 * w);
    auto pending = shm->all_to_all_async(in.buffer(), aa.buffer());
    float one = 1;
    shm->all_reduce(dist::make_buffer(&one, 1));
    pending->wait();
    gloo->all_to_all(in.buffer(), ab.buffer());
    compare(aa, ab, true, label("all_to_all", t, 5));
    if (one != static_cast<float>(world)) c.fail("all_reduce after all_to_all_async is wrong");
  }
  shm->barrier();
  gloo->barrier();
  if (c.failures() > 0) return 1;
  std::cout << "versus: rank " << rank << " of " << world << " (" << shm->transport()
            << "): " << c.checks() << " checks, " << identical << " bit-identical" << std::endl;
  return 0;
}

// A group made with CTORCHRUN_DIST_SHM_CMA(_MIN, _MAX) set as given (empty:
// unset).
std::shared_ptr<dist::ProcessGroup> group_with(bool shm, const char* cma, const char* cma_min,
                                               const char* cma_max) {
  auto set = [](const char* name, const char* value) {
    if (*value != 0) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  };
  set("CTORCHRUN_DIST_SHM_CMA", cma);
  set("CTORCHRUN_DIST_SHM_CMA_MIN", cma_min);
  set("CTORCHRUN_DIST_SHM_CMA_MAX", cma_max);
  dist::InitOptions options;
  options.shm = shm;
  auto pg = dist::init_process_group(options);
  ::unsetenv("CTORCHRUN_DIST_SHM_CMA");
  ::unsetenv("CTORCHRUN_DIST_SHM_CMA_MIN");
  ::unsetenv("CTORCHRUN_DIST_SHM_CMA_MAX");
  return pg;
}

int cma() {
  // The variables are read when a group is made: the job's own must stay
  // out of it.
  if (std::getenv("CTORCHRUN_DIST_SHM_CMA") != nullptr) {
    std::cerr << "cma: run without CTORCHRUN_DIST_SHM_CMA\n";
    return 1;
  }
  // Switched on (off by default) at the default sizes, and from one byte.
  auto big = group_with(true, "1", "", "");
  auto small = group_with(true, "1", "1", "4194303");
  auto copy = group_with(true, "0", "", "");
  auto gloo = group_with(false, "", "", "");
  const int rank = big->rank();
  const int world = big->size();
  Checker c(rank);
  if (world > 1 && big->transport() != "shm") c.fail("the shm group runs on " + big->transport());
  if (gloo->transport() != "gloo") c.fail("the gloo group runs on " + gloo->transport());
  struct Calls {
    uint64_t want = 0;  // calls within the group's sizes
    uint64_t got = 0;   // shm_cma_calls() went up by
  } on_big, on_small, on_copy;
  auto run = [&](dist::ProcessGroup& g, Calls& calls, size_t min, size_t max, Raw& buf, ReduceOp op,
                 int root) {
    const uint64_t before = dist::shm_cma_calls();
    if (root < 0) {
      g.all_reduce(buf.buffer(), op);
    } else {
      g.reduce(buf.buffer(), root, op);
    }
    calls.got += dist::shm_cma_calls() - before;
    if (world > 1 && buf.bytes.size() >= min && buf.bytes.size() <= max) ++calls.want;
  };
  const size_t off = ~size_t{0};
  // By default only groups of two take the single copy.
  const size_t big_max = world <= dist::kShmCmaRanks ? dist::kShmCmaMaxBytes : 0;
  for (DataType t : kTypes) {
    const size_t es = dist::element_size(t);
    const size_t at = dist::kShmCmaBytes / es;
    // Counts below the world size, odd ones (not divisible by 2, 4 and, for
    // most, 3), several of reduce_by_cma's 256 KiB pieces per rank (the
    // small group's single copy), then the threshold: the big group's
    // choice, which the reduction does not change, so sums alone (4 MiB
    // calls of four groups are most of this mode's time, under a sanitizer
    // minutes).
    std::vector<size_t> sizes = {1, 3, 7, 1001, (world * (600u << 10) + 333) / es};
    const size_t threshold_from = sizes.size();
    if (world <= dist::kShmCmaRanks && (t == DataType::kFloat32 || t == DataType::kBFloat16 ||
                                        t == DataType::kInt64 || t == DataType::kUInt8)) {
      sizes.insert(sizes.end(), {at - 1, at, at + 1});
    } else if (t == DataType::kFloat32) {
      sizes.push_back(at);  // not taken by default in larger groups
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      for (ReduceOp op : kReduceOps) {
        if (op == ReduceOp::kAverage && !dist::is_floating(t)) continue;
        if (k >= threshold_from && op != ReduceOp::kSum) continue;
        const bool order_free =
            world <= 2 || !dist::is_floating(t) || op == ReduceOp::kMin || op == ReduceOp::kMax;
        const bool product = op == ReduceOp::kProduct;
        for (int root : {-1, world - 1}) {
          const std::string what = label(root < 0 ? "all_reduce" : "reduce", t, n,
                                         (std::string(" ") + dist::to_string(op)).c_str());
          std::vector<Raw> got;
          for (int g = 0; g < 4; ++g) {
            Raw raw(t, n);
            for (size_t i = 0; i < n; ++i) raw.set(i, random_value(t, op, rank, i));
            got.push_back(std::move(raw));
          }
          run(*big, on_big, dist::kShmCmaBytes, big_max, got[0], op, root);
          run(*small, on_small, 1, (size_t{4} << 20) - 1, got[1], op, root);
          run(*copy, on_copy, off, off, got[2], op, root);
          gloo->all_reduce(got[3].buffer(), op);
          if (root >= 0 && rank != root) continue;
          c.expect(got[0], got[2], what + " (single copy from its default size)");
          c.expect(got[1], got[2], what + " (single copy from one byte)");
          if (got[2].bytes != got[3].bytes) {
            bool close = !order_free;
            const double scale_sum = 8.0 * world;
            for (size_t i = 0; i < n && close; ++i) {
              const double x = decode(t, got[2].bytes.data() + i * es);
              const double y = decode(t, got[3].bytes.data() + i * es);
              const double scale = product ? std::max(1.0, std::abs(y)) : scale_sum;
              close = std::abs(x - y) <= tolerance(t) * scale;
            }
            if (!close) c.fail(what + ": shm and gloo differ beyond what their orders allow");
          }
        }
      }
    }
  }
  auto count = [&](const char* which, const Calls& calls) {
    if (calls.got != calls.want) {
      c.fail(std::string(which) + ": " + std::to_string(calls.got) +
             " calls went by cross-memory attach, " + std::to_string(calls.want) + " should have");
    }
  };
  count("default sizes", on_big);
  count("from 1 byte to just below 4 MiB", on_small);
  count("CTORCHRUN_DIST_SHM_CMA=0", on_copy);
  {
    // Unset, the switch is off: an all_reduce inside the default window
    // goes through the segment.
    auto plain = group_with(true, "", "", "");
    Raw raw(DataType::kFloat32, (dist::kShmCmaBytes + dist::kShmCmaMaxBytes) / 2 / 4);
    const uint64_t before = dist::shm_cma_calls();
    plain->all_reduce(raw.buffer(), ReduceOp::kSum);
    if (dist::shm_cma_calls() != before) {
      c.fail("an all_reduce went by cross-memory attach with CTORCHRUN_DIST_SHM_CMA unset");
    }
  }
  big->barrier();
  gloo->barrier();
  if (c.failures() > 0) return 1;
  std::cout << "cma: rank " << rank << " of " << world << ": " << c.checks() << " checks, "
            << on_big.got + on_small.got << " single-copy calls" << std::endl;
  return 0;
}

int loop(int rounds, size_t count) {
  dist::InitOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  auto pg = dist::init_process_group(options);
  std::vector<int> all;
  for (int r = 0; r < pg->size(); ++r) all.push_back(r);
  auto second = pg->new_group(all);
  std::cout << "transport " << pg->transport() << " " << second->transport() << std::endl;
  const auto world = static_cast<float>(pg->size());
  for (int round = 0; round < rounds; ++round) {
    dist::ProcessGroup& g = round % 2 == 0 ? *pg : *second;
    std::vector<float> data(count, static_cast<float>(round + pg->rank()));
    g.all_reduce(dist::make_buffer(data.data(), data.size()));
    const float want = world * static_cast<float>(round) + world * (world - 1) / 2;
    for (float x : data) {
      if (x != want) {
        std::cerr << "loop: rank " << pg->rank() << " round " << round << " got " << x << ", want "
                  << want << "\n";
        return 1;
      }
    }
  }
  std::cout << "loop: rank " << pg->rank() << " ok" << std::endl;
  return 0;
}

int mismatch(const std::string& kind, int timeout_ms) {
  dist::InitOptions options;
  options.timeout = std::chrono::milliseconds(timeout_ms);
  auto pg = dist::init_process_group(options);
  std::cout << "transport " << pg->transport() << std::endl;
  const int rank = pg->rank();
  std::vector<float> floats(2000, 1.0f);
  std::vector<int32_t> ints(4, 1);
  dist::Buffer buffer = dist::make_buffer(floats.data(), 4);
  ReduceOp op = ReduceOp::kSum;
  if (kind == "count" && rank == 1) buffer.count = 3;
  if (kind == "dtype" && rank == 1) buffer = dist::make_buffer(ints.data(), ints.size());
  if (kind == "op" && rank == 1) op = ReduceOp::kMax;
  if (kind == "large") buffer.count = rank == 0 ? 1000 : 500;
  if (kind == "upper" && rank >= (pg->size() + 1) / 2) buffer.count = 3;
  if (kind == "straddle" && rank >= (pg->size() + 1) / 2) buffer.count = 2000;
  std::string outcome;
  try {
    pg->all_reduce(buffer, op);
    outcome = "no error, got " + std::to_string(kind == "dtype" && rank == 1 ? ints[0] : floats[0]);
  } catch (const ctorchrun::InvalidArgument& e) {
    outcome = std::string("InvalidArgument: ") + e.what();
    const bool intact = std::all_of(floats.begin(), floats.end(), [](float x) { return x == 1; }) &&
                        std::all_of(ints.begin(), ints.end(), [](int32_t x) { return x == 1; });
    outcome += intact ? " [buffer intact]" : " [buffer changed]";
  } catch (const ctorchrun::ConfigError& e) {
    outcome = std::string("ConfigError: ") + e.what();
  } catch (const ctorchrun::TimeoutError& e) {
    outcome = std::string("TimeoutError: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("other error: ") + e.what();
  }
  std::cout << "mismatch " << rank << ": " << outcome << std::endl;
  std::string after = "ok";
  try {
    float x = 1;
    pg->all_reduce(dist::make_buffer(&x, 1));
    if (x != static_cast<float>(pg->size())) after = "wrong sum " + std::to_string(x);
  } catch (const std::exception& e) {
    after = std::string("failed: ") + e.what();
  }
  std::cout << "after " << rank << ": " << after << std::endl;
  return 0;
}

int async_order() {
  auto pg = dist::init_process_group();
  std::cout << "transport " << pg->transport() << std::endl;
  const int rank = pg->rank();
  const int world = pg->size();
  constexpr int kOps = 24;
  constexpr size_t kCount = 3000;
  std::vector<std::vector<float>> data(kOps);
  std::vector<std::vector<float>> inputs(kOps);
  std::vector<dist::WorkHandle> works;
  for (int i = 0; i < kOps; ++i) {
    auto& d = data[static_cast<size_t>(i)];
    d.assign(kCount, static_cast<float>((i + 1) * (rank + 1)));
    switch (i % 4) {
      case 0:
      case 1:
        works.push_back(pg->all_reduce_async(dist::make_buffer(d.data(), d.size())));
        break;
      case 2:
        works.push_back(pg->broadcast_async(dist::make_buffer(d.data(), d.size()), i % world));
        break;
      default: {
        // All-gathers 1/world of it: element k of the result is rank k's value.
        const size_t part = kCount / static_cast<size_t>(world);
        inputs[static_cast<size_t>(i)].assign(part, static_cast<float>((i + 1) * (rank + 1)));
        auto& in = inputs[static_cast<size_t>(i)];
        works.push_back(pg->all_gather_async(dist::make_buffer(in.data(), in.size()),
                                             dist::make_buffer(d.data(), part * world)));
        works.push_back(pg->barrier_async());
        break;
      }
    }
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  int failures = 0;
  const size_t part = kCount / static_cast<size_t>(world);
  for (int i = 0; i < kOps; ++i) {
    const auto& d = data[static_cast<size_t>(i)];
    for (size_t k = 0; k < (i % 4 == 3 ? part * static_cast<size_t>(world) : kCount); ++k) {
      float want = 0;
      switch (i % 4) {
        case 0:
        case 1:
          want = static_cast<float>((i + 1) * world * (world + 1) / 2);
          break;
        case 2:
          want = static_cast<float>((i + 1) * (i % world + 1));
          break;
        default:
          want = static_cast<float>((i + 1) * (static_cast<int>(k / part) + 1));
          break;
      }
      if (d[k] != want) {
        std::cerr << "async: rank " << rank << " op " << i << " element " << k << " is " << d[k]
                  << ", want " << want << "\n";
        ++failures;
        break;
      }
    }
  }
  if (failures > 0) return 1;
  std::cout << "async: rank " << rank << " ok" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "matrix") return matrix();
    if (mode == "peer-death" && argc >= 5 && argc <= 7) {
      const size_t count = argc >= 6 ? std::strtoull(argv[5], nullptr, 10) : size_t{1} << 20;
      return peer_death(std::atoi(argv[2]), argv[3], std::atoi(argv[4]), count,
                        argc == 7 ? argv[6] : "all_reduce");
    }
    if (mode == "cma") return cma();
    if (mode == "mismatch" && argc == 4) return mismatch(argv[2], std::atoi(argv[3]));
    if (mode == "versus" && argc <= 3) return versus(argc == 3 ? argv[2] : "shm");
    if (mode == "async-order") return async_order();
    if (mode == "loop" && (argc == 3 || argc == 4)) {
      return loop(std::atoi(argv[2]), argc == 4 ? std::strtoull(argv[3], nullptr, 10) : 3000);
    }
  } catch (const std::exception& e) {
    std::cerr << "dist_test_worker: " << e.what() << "\n";
    return 1;
  }
  std::cerr
      << "usage: dist_test_worker matrix | versus [TRANSPORT] | cma | async-order | "
         "loop ROUNDS [COUNT] | peer-death VICTIM kill|kill-late|stop TIMEOUT_MS [COUNT [OP]] | "
         "mismatch count|dtype|op|large|upper|straddle TIMEOUT_MS\n";
  return 2;
}

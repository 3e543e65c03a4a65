#include "collectives/gloo_backend.h"

#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "collectives/call_signature.h"
#include "collectives/op_queue.h"
#include "collectives/reduce_kernels.h"
#include "common/error.h"
#include "common/log.h"

namespace ctorchrun::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

milliseconds remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(left, milliseconds(1));
}

// gloo's rendezvous store over ours, every wait bounded by the set-up deadline.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<store::Store> store, Clock::time_point deadline)
      : store_(std::move(store)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    store_->wait({key}, remaining(deadline_));
    std::string value = store_->get(key);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    store_->wait(keys, remaining(deadline_));
  }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    store_->wait(keys, std::min(timeout, remaining(deadline_)));
  }

 private:
  std::shared_ptr<store::Store> store_;
  Clock::time_point deadline_;
};

// The local address of the route to `host`: connecting a UDP socket sends
// nothing but makes the kernel pick the source address it would use.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) {
    throw IoError("gloo: cannot resolve MASTER_ADDR '" + host +
                  "' to choose the interface; set GLOO_SOCKET_IFNAME");
  }
  std::string address;
  for (addrinfo* ai = found; ai != nullptr && address.empty(); ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw =
          local.ss_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, raw, text, sizeof text) != nullptr) address = text;
    }
    ::close(fd);
  }
  freeaddrinfo(found);
  if (address.empty()) {
    throw IoError("gloo: no route to MASTER_ADDR '" + host + "'; set GLOO_SOCKET_IFNAME");
  }
  return address;
}

// One device (and so one epoll thread) per interface and process, shared by
// every group on it, as torch shares its default device.
std::shared_ptr<gloo::transport::Device> device_for(const std::string& master_addr) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<gloo::transport::Device>> devices;
  gloo::transport::tcp::attr attr;
  std::string key;
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') {
    std::string first(ifname);
    first = first.substr(0, first.find(','));
    attr.iface = first;
    key = "iface " + first;
  } else {
    attr.hostname = local_address_towards(master_addr.empty() ? "127.0.0.1" : master_addr);
    key = "host " + attr.hostname;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (auto existing = devices[key].lock()) return existing;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw IoError("gloo: cannot create a TCP device on " + key + ": " + e.what());
  }
  devices[key] = device;
  return device;
}

template <size_t N>
struct Blob {
  unsigned char bytes[N];
};

// Why this process closed the group's connections itself, if it did (a
// dropped send or recv), so that the ops failing afterwards say so instead of
// gloo's "Application timeout caused pair closure".
class CloseReason {
 public:
  // Records `why` unless a reason is there already; true if it was recorded.
  bool set(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!why_.empty()) return false;
    why_ = why;
    return true;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    why_.clear();
  }
  std::string get() {
    std::lock_guard<std::mutex> lock(mutex_);
    return why_;
  }

 private:
  std::mutex mutex_;
  std::string why_;
};

[[noreturn]] void rethrow_translated(const std::string& what, milliseconds timeout,
                                     CloseReason& closed) {
  const std::string reason = closed.get();
  const std::string hint =
      (reason.empty() ? "; a peer died, hung or was restarted" : "; " + reason) +
      "; this group is unusable, exit so the launcher can restart the job";
  try {
    throw;
  } catch (const ctorchrun::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (message.find("imed out") != std::string::npos) {
      throw TimeoutError(what + " timed out after " + std::to_string(timeout.count()) +
                         " ms: " + message + hint);
    }
    throw IoError(what + " failed: " + message + hint);
  }
}

// Calls `fire` at `at` from a thread of its own, unless destroyed first.
class Alarm {
 public:
  Alarm(Clock::time_point at, std::function<void()> fire)
      : thread_([this, at, fire = std::move(fire)] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!cv_.wait_until(lock, at, [&] { return cancelled_; })) fire();
        }) {}
  ~Alarm() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cancelled_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Alarm(const Alarm&) = delete;
  Alarm& operator=(const Alarm&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool cancelled_ = false;
  std::thread thread_;  // last: starts once the members it uses exist
};

// send/recv: posted on the caller's thread; gloo completes them on its loop.
//
// gloo's own wait timeout closes every connection of the group, so it is
// given the op's deadline only; a Work::wait(timeout) that ends earlier
// interrupts gloo's wait from an Alarm (abortWaitSend/Recv), which leaves
// the operation posted. gloo cannot take one posted operation back either:
// dropping the Work of an unfinished one closes the group's connections at
// once (what the op's timeout would do later), so that gloo's loop never
// touches the caller's buffer afterwards.
class P2pWork : public Work {
 public:
  P2pWork(std::shared_ptr<gloo::transport::Device> device,
          std::unique_ptr<gloo::transport::UnboundBuffer> buffer, bool is_send,
          milliseconds timeout, std::string description, std::shared_ptr<CloseReason> closed)
      : device_(std::move(device)),
        buffer_(std::move(buffer)),
        is_send_(is_send),
        deadline_(Clock::now() + timeout),
        timeout_(timeout),
        description_(std::move(description)),
        closed_(std::move(closed)) {}

  ~P2pWork() override {
    // Nobody else can be waiting: a waiter holds a reference.
    if (done_) return;
    const bool mine = closed_->set("the group was closed when the Work of an unfinished " +
                                   description_ + " was dropped (gloo cannot cancel it)");
    try {
      // gloo's wait timing out closes every connection of the group.
      if (gloo_wait(milliseconds(1)) && mine) closed_->clear();  // it had just completed
    } catch (const std::exception& e) {
      // An earlier failure (the peer's) closed it already: not ours to explain.
      if (mine && std::string(e.what()).find("Timed out waiting") == std::string::npos) {
        closed_->clear();
      }
    }
  }

  void wait() override { wait_until(deadline_, timeout_); }
  void wait(milliseconds timeout) override { wait_until(Clock::now() + timeout, timeout); }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

 private:
  // True when the operation completed, false when abort_wait() interrupted
  // the wait; throws gloo's exception when it failed or timed out.
  bool gloo_wait(milliseconds timeout) {
    return is_send_ ? buffer_->waitSend(nullptr, timeout) : buffer_->waitRecv(nullptr, timeout);
  }
  void abort_wait() {
    if (is_send_) {
      buffer_->abortWaitSend();
    } else {
      buffer_->abortWaitRecv();
    }
  }

  [[noreturn]] void still_running(milliseconds timeout) const {
    throw TimeoutError(description_ + " did not complete within " +
                       std::to_string(timeout.count()) +
                       " ms (Work::wait timeout); it is still running");
  }

  // One thread at a time waits in gloo; the others follow it on cv_ and
  // take over if it leaves first (its own wait timed out).
  void wait_until(Clock::time_point until, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!done_) {
      if (waiting_) {
        if (!cv_.wait_until(lock, until, [&] { return done_ || !waiting_; })) {
          still_running(timeout);
        }
        continue;
      }
      waiting_ = true;
      lock.unlock();
      bool completed = false;
      std::exception_ptr error;
      try {
        if (until >= deadline_) {
          completed = gloo_wait(remaining(deadline_));
        } else {
          Alarm alarm(until, [this] { abort_wait(); });
          completed = gloo_wait(remaining(deadline_));
        }
      } catch (...) {
        try {
          rethrow_translated(description_, timeout_, *closed_);
        } catch (...) {
          error = std::current_exception();
        }
      }
      lock.lock();
      waiting_ = false;
      if (completed || error) {
        done_ = true;
        error_ = error;
      }
      cv_.notify_all();
      if (!done_) still_running(timeout);
    }
    if (error_) std::rethrow_exception(error_);
  }

  // The buffer holds the tcp context, which may outlive the backend: the
  // device must outlive both (see GlooBackend::device_).
  std::shared_ptr<gloo::transport::Device> device_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  bool is_send_;
  Clock::time_point deadline_;
  milliseconds timeout_;
  std::string description_;
  std::shared_ptr<CloseReason> closed_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool waiting_ = false;  // a thread is in gloo_wait
  bool done_ = false;
  std::exception_ptr error_;
};

class GlooBackend : public Backend {
 public:
  explicit GlooBackend(const BackendContext& context)
      : rank_(context.rank), size_(context.size), check_calls_(context.check_calls) {
    if (size_ > 1) {
      const auto deadline = Clock::now() + context.timeout;
      device_ = device_for(context.master_addr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
      ctx->setTimeout(context.timeout);
      StoreAdapter adapter(context.store, deadline);
      try {
        ctx->connectFullMesh(adapter, device_);
      } catch (...) {
        rethrow_translated(
            "gloo set-up of rank " + std::to_string(rank_) + "/" + std::to_string(size_),
            context.timeout, *closed_);
      }
      context_ = std::move(ctx);
    }
  }

  ~GlooBackend() override { queue_.stop(); }

  std::string name() const override { return "gloo"; }

  WorkHandle run(const Op& op, bool async) override {
    if (op.type == OpType::kSend || op.type == OpType::kRecv) return post_p2p(op, async);
    return queue_.run(op, async, describe(op, "gloo", rank_, size_));
  }

 private:
  // The slots of signature exchanges: gloo's collectives use prefixes 1-8
  // (gloo/types.h), send and recv slots below 2^32.
  static constexpr uint8_t kSignatureSlotPrefix = 0x63;

  void execute(const Op& given, uint32_t tag, const PromiseWork& work) {
    if (size_ == 1) {
      execute_alone(given);
      return;
    }
    // gloo counts a timeout from when each call starts: an op with a
    // deadline of its own gets what is left of it. Errors report the op's
    // timeout.
    Op op = given;
    if (given.deadline != Clock::time_point{}) op.timeout = remaining(given.deadline);
    if (check_calls_) check_same_call(op, tag, work.description(), given.timeout);
    try {
      switch (element_size(op.type == OpType::kBarrier ? DataType::kUInt8
                           : op.input.data != nullptr  ? op.input.dtype
                                                       : op.output.dtype)) {
        case 1:
          execute_typed<1>(op, tag);
          break;
        case 2:
          execute_typed<2>(op, tag);
          break;
        case 4:
          execute_typed<4>(op, tag);
          break;
        default:
          execute_typed<8>(op, tag);
          break;
      }
    } catch (...) {
      rethrow_translated(work.description(), given.timeout, *closed_);
    }
  }

  // Every rank sends the signature of its call to every other rank before
  // any data moves (all sends and receives posted at once: one round trip,
  // where gloo's ring all-gather takes size - 1); all see the same table, so
  // all throw the same ConfigError, or none does, and the group stays in
  // step either way.
  void check_same_call(const Op& op, uint32_t tag, const std::string& what, milliseconds reported) {
    std::vector<detail::Signature> all(static_cast<size_t>(size_));
    all[static_cast<size_t>(rank_)] = detail::signature_of(op, tag);
    constexpr size_t kSize = sizeof(detail::Signature);
    try {
      auto buffer = context_->createUnboundBuffer(all.data(), all.size() * kSize);
      const uint64_t slot = gloo::Slot::build(kSignatureSlotPrefix, tag);
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        buffer->recv(peer, slot, static_cast<size_t>(peer) * kSize, kSize);
        buffer->send(peer, slot, static_cast<size_t>(rank_) * kSize, kSize);
      }
      for (int i = 1; i < size_; ++i) {
        buffer->waitRecv(op.timeout);
        buffer->waitSend(op.timeout);
      }
    } catch (...) {
      rethrow_translated(what, reported, *closed_);
    }
    detail::check_same_calls(all, rank_, what);
  }

  // A group of one: every collective is a copy (or nothing).
  void execute_alone(const Op& op) {
    switch (op.type) {
      case OpType::kAllGather:
      case OpType::kGather:
      case OpType::kScatter:
      case OpType::kReduceScatter:
      case OpType::kAllToAll:
        if (op.output.data != op.input.data && op.input.count > 0) {
          std::memmove(op.output.data, op.input.data, op.input.bytes());
        }
        return;
      default:
        return;  // in place, or a barrier
    }
  }

  template <size_t N>
  void execute_typed(const Op& op, uint32_t tag) {
    using T = Blob<N>;
    const auto& ctx = context_;
    auto* out = static_cast<T*>(op.output.data);
    auto* in = static_cast<T*>(op.input.data);
    switch (op.type) {
      case OpType::kAllReduce: {
        if (op.output.count == 0) return;
        all_reduce<T>(out, op.output.count, op.output.dtype, op.reduce, tag, op.timeout);
        return;
      }
      case OpType::kBroadcast: {
        if (op.output.count == 0) return;
        gloo::BroadcastOptions opts(ctx);
        opts.setOutput<T>(out, op.output.count);
        opts.setRoot(op.peer);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::broadcast(opts);
        return;
      }
      case OpType::kReduce: {
        if (op.output.count == 0) return;
        gloo::ReduceOptions opts(ctx);
        opts.setOutput<T>(out, op.output.count);
        opts.setRoot(op.peer);
        opts.setReduceFunction(detail::reduce_function(op.output.dtype, op.reduce));
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::reduce(opts);
        if (op.reduce == ReduceOp::kAverage && rank_ == op.peer) {
          detail::divide_in_place(op.output.data, op.output.count, op.output.dtype, size_);
        }
        return;
      }
      case OpType::kAllGather: {
        if (op.input.count == 0) return;
        gloo::AllgatherOptions opts(ctx);
        opts.setInput<T>(in, op.input.count);
        opts.setOutput<T>(out, op.input.count * size_);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::allgather(opts);
        return;
      }
      case OpType::kGather: {
        if (op.input.count == 0) return;
        gloo::GatherOptions opts(ctx);
        opts.setInput<T>(in, op.input.count);
        if (rank_ == op.peer) opts.setOutput<T>(out, op.input.count * size_);
        opts.setRoot(op.peer);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::gather(opts);
        return;
      }
      case OpType::kScatter: {
        if (op.output.count == 0) return;
        gloo::ScatterOptions opts(ctx);
        std::vector<T*> slices;
        if (rank_ == op.peer) {
          for (int r = 0; r < size_; ++r) slices.push_back(in + r * op.output.count);
          opts.setInputs<T>(slices, op.output.count);
        }
        opts.setOutput<T>(out, op.output.count);
        opts.setRoot(op.peer);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::scatter(opts);
        return;
      }
      case OpType::kReduceScatter: {
        // This gloo has no general reduce-scatter (torch 1.13's gloo group
        // has none at all): all-reduce a copy and keep this rank's slice.
        if (op.output.count == 0) return;
        std::vector<T> scratch(op.input.count);
        std::memcpy(scratch.data(), in, op.input.bytes());
        all_reduce<T>(scratch.data(), scratch.size(), op.input.dtype, op.reduce, tag, op.timeout);
        std::memcpy(out, scratch.data() + rank_ * op.output.count, op.output.bytes());
        return;
      }
      case OpType::kAllToAll: {
        if (op.input.count == 0) return;
        gloo::AlltoallOptions opts(ctx);
        opts.setInput<T>(in, op.input.count);
        opts.setOutput<T>(out, op.output.count);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::alltoall(opts);
        return;
      }
      case OpType::kBarrier: {
        gloo::BarrierOptions opts(ctx);
        opts.setTag(tag);
        opts.setTimeout(op.timeout);
        gloo::barrier(opts);
        return;
      }
      case OpType::kSend:
      case OpType::kRecv:
        break;
    }
    CTORCHRUN_CHECK(false, "gloo backend: operation routed to the wrong path");
  }

  template <typename T>
  void all_reduce(T* data, size_t count, DataType dtype, ReduceOp op, uint32_t tag,
                  milliseconds timeout) {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput<T>(data, count);
    opts.setReduceFunction(detail::reduce_function(dtype, op));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allreduce(opts);
    if (op == ReduceOp::kAverage) detail::divide_in_place(data, count, dtype, size_);
  }

  WorkHandle post_p2p(const Op& op, bool async) {
    const bool is_send = op.type == OpType::kSend;
    const Buffer& b = is_send ? op.input : op.output;
    auto description = describe(op, "gloo", rank_, size_);
    auto buffer = context_->createUnboundBuffer(b.data, b.bytes());
    const auto slot = static_cast<uint64_t>(static_cast<uint32_t>(op.tag));
    try {
      if (is_send) {
        buffer->send(op.peer, slot);
      } else {
        buffer->recv(op.peer, slot);
      }
    } catch (...) {
      rethrow_translated(description, op.timeout, *closed_);
    }
    auto work = std::make_shared<P2pWork>(device_, std::move(buffer), is_send, op.timeout,
                                          description, closed_);
    if (!async) work->wait();
    return work;
  }

  const int rank_;
  const int size_;
  const bool check_calls_;
  // Before context_, so destroyed after it: gloo's tcp context lets go of
  // its device before its pairs unregister from the device's loop, and when
  // that was the last reference (another thread's group went at the same
  // time) the pairs used a freed loop.
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::shared_ptr<CloseReason> closed_ = std::make_shared<CloseReason>();
  // Last: its thread runs execute(), which uses everything above.
  OpQueue queue_{
      [this](const Op& op, uint32_t tag, const PromiseWork& work) { execute(op, tag, work); }};
};

}  // namespace

std::unique_ptr<Backend> create_gloo_backend(const BackendContext& context) {
  if (context.device.type != DeviceType::kCpu) {
    throw ConfigError("the gloo backend works on CPU buffers; device " + to_string(context.device) +
                      " needs the nccl backend");
  }
  return std::make_unique<GlooBackend>(context);
}

}  // namespace ctorchrun::dist

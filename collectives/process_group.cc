#include "collectives/process_group.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <utility>

#include "common/error.h"
#include "common/log.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "store/tcp_store_server.h"

namespace ctorchrun::dist {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int env_int(const char* name, std::optional<int> given, std::optional<int> fallback) {
  if (given) return *given;
  auto text = env(name);
  if (!text) {
    if (fallback) return *fallback;
    throw ConfigError(std::string("init_process_group: ") + name +
                      " is not set; run the worker under ctorchrun (or torchrun), or set it in "
                      "InitOptions");
  }
  try {
    size_t used = 0;
    int value = std::stoi(*text, &used);
    if (used != text->size()) throw std::invalid_argument(*text);
    return value;
  } catch (const std::exception&) {
    throw ConfigError(std::string("init_process_group: ") + name + "='" + *text +
                      "' is not an integer");
  }
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ",") + std::to_string(r);
  return text;
}

// Every rank announces itself and waits for the others, so that a missing
// rank is named instead of surfacing as a timeout deep inside the backend.
void wait_for_ranks(store::Store& store, int rank, int size, milliseconds timeout,
                    const std::string& where) {
  store.set("arrived/" + std::to_string(rank), "1");
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("arrived/" + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const TimeoutError&) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (!store.check({keys[r]})) missing.push_back(r);
    }
    throw TimeoutError("process group set-up timed out after " + std::to_string(timeout.count()) +
                       " ms: rank(s) " + join_ranks(missing) + " of " + std::to_string(size) +
                       " never arrived (" + where +
                       "); check that every rank started and calls init_process_group");
  }
}

// An on/off switch: `given` when set, else its variable (0 or 1), else on.
bool read_switch(std::optional<bool> given, const char* name) {
  if (given) return *given;
  auto text = env(name);
  if (!text) return true;
  if (*text != "0" && *text != "1") {
    throw ConfigError(std::string("init_process_group: ") + name + "='" + *text +
                      "' must be 0 (off) or 1 (on)");
  }
  return *text == "1";
}

// The common end of init_process_group, join_process_group (and so of
// every group): every rank announces itself on `context.store` and waits
// for the others, then the backend is made within what is left of
// `deadline`. `where` names the store and keys in a timeout's message.
std::unique_ptr<Backend> set_up_backend(const std::string& name, BackendContext context,
                                        Clock::time_point deadline, const std::string& where) {
  auto left = [&] {
    return std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()),
                    milliseconds(1));
  };
  wait_for_ranks(*context.store, context.rank, context.size, left(), where);
  context.timeout = left();
  return create_backend(name, context);
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Backend> backend, BackendContext context,
                           std::string store_prefix, std::shared_ptr<store::Store> root_store,
                           std::vector<int> global_ranks, std::shared_ptr<void> keep_alive)
    : backend_(std::move(backend)),
      context_(std::move(context)),
      store_prefix_(std::move(store_prefix)),
      root_store_(std::move(root_store)),
      global_ranks_(std::move(global_ranks)),
      keep_alive_(std::move(keep_alive)) {}

ProcessGroup::~ProcessGroup() {
  backend_.reset();  // stops the backend's threads before the store goes
}

namespace {

// gloo writes to its peers' sockets without MSG_NOSIGNAL: with SIGPIPE's
// default action a peer's death would kill this process instead of failing
// the op. A handler or SIG_IGN the program chose is left alone.
void ignore_default_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      !(current.sa_flags & SA_SIGINFO)) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  const int rank = env_int("RANK", options.rank, std::nullopt);
  const int world = env_int("WORLD_SIZE", options.world_size, std::nullopt);
  const int local_rank = env_int("LOCAL_RANK", options.local_rank, 0);
  const int attempt = env_int("TORCHELASTIC_RESTART_COUNT", options.restart_count, 0);
  if (world < 1 || rank < 0 || rank >= world) {
    throw ConfigError("init_process_group: RANK=" + std::to_string(rank) +
                      " is not in [0, WORLD_SIZE=" + std::to_string(world) + ")");
  }
  if (options.timeout <= milliseconds(0)) {
    throw ConfigError("init_process_group: the timeout must be positive");
  }
  // torch's NCCL groups default to 10 min, its gloo groups to 30.
  const milliseconds timeout = options.backend == "nccl" && options.timeout == kDefaultTimeout
                                   ? kDefaultNcclTimeout
                                   : options.timeout;
  const bool check_calls = read_switch(options.check_calls, "CTORCHRUN_DIST_CHECK_CALLS");
  const bool shm = read_switch(options.shm, "CTORCHRUN_DIST_SHM");
  const auto deadline = Clock::now() + timeout;
  ignore_default_sigpipe();

  std::shared_ptr<store::Store> root = options.store;
  std::shared_ptr<void> keep_alive;
  std::string master_addr = options.master_addr.value_or(env("MASTER_ADDR").value_or(""));
  std::string where = "in-process store";
  if (!root) {
    if (master_addr.empty() && world == 1) {
      root = std::make_shared<store::HashStore>();
    } else {
      if (master_addr.empty()) {
        throw ConfigError("init_process_group: MASTER_ADDR is not set (WORLD_SIZE=" +
                          std::to_string(world) + "); run the worker under ctorchrun");
      }
      const int port = env_int("MASTER_PORT", options.master_port, std::nullopt);
      if (port <= 0 || port > 65535) {
        throw ConfigError("init_process_group: MASTER_PORT=" + std::to_string(port) +
                          " is not a port");
      }
      // As torch's env:// initialisation: the launcher's agent hosts the
      // store when it says so, else rank 0 does.
      if (rank == 0 && env("TORCHELASTIC_USE_AGENT_STORE").value_or("") != "True") {
        store::ServerOptions server;
        server.port = static_cast<uint16_t>(port);
        keep_alive = std::shared_ptr<store::TcpStoreServer>(store::TcpStoreServer::start(server));
      }
      store::TcpStoreOptions client;
      client.host = master_addr;
      client.port = static_cast<uint16_t>(port);
      client.timeout = timeout;
      client.connect_timeout = timeout;
      root = std::make_shared<store::TcpStore>(client);
      where = "store " + master_addr + ":" + std::to_string(port);
    }
  }
  // The n-th init_process_group of rank r uses group n: a per-rank counter
  // in the store (not in the process, where threads may play several ranks),
  // so a job that builds and destroys groups never reuses an old group's keys.
  const std::string attempt_prefix =
      std::string(kStorePrefix) + "/attempt_" + std::to_string(attempt);
  store::PrefixStore attempt_store(attempt_prefix, root);
  const int64_t generation = attempt_store.add("inits/rank_" + std::to_string(rank), 1);
  const std::string prefix = attempt_prefix + "/pg_" + std::to_string(generation);
  auto group_store = std::make_shared<store::PrefixStore>(prefix, root);
  BackendContext context;
  context.store = group_store;
  context.rank = rank;
  context.size = world;
  context.device = options.device;
  if (context.device.type == DeviceType::kCuda && context.device.index < 0) {
    context.device.index = local_rank;
  }
  context.timeout = timeout;
  context.master_addr = master_addr;
  context.check_calls = check_calls;
  context.shm = shm;
  context.group_key = prefix;
  auto backend = set_up_backend(options.backend, context, deadline,
                                where + ", keys /" + prefix + "/arrived/<rank>");
  std::vector<int> global(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) global[static_cast<size_t>(r)] = r;
  get_logger("coll")->debug(
      "process group ready: backend={} transport={} rank={} world={} attempt={} prefix={}",
      options.backend, backend->transport(), rank, world, attempt, prefix);
  return std::make_shared<ProcessGroup>(std::move(backend), std::move(context), prefix, root,
                                        std::move(global), std::move(keep_alive));
}

std::shared_ptr<ProcessGroup> join_process_group(std::shared_ptr<store::Store> store, int rank,
                                                 int size, const std::string& group_key,
                                                 const InitOptions& options) {
  if (!store) throw ConfigError("join_process_group: no store");
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("join_process_group: rank " + std::to_string(rank) + " is not in [0, " +
                      std::to_string(size) + ")");
  }
  if (options.timeout <= milliseconds(0)) {
    throw ConfigError("join_process_group: the timeout must be positive");
  }
  const auto deadline = Clock::now() + options.timeout;
  BackendContext context;
  context.check_calls = read_switch(options.check_calls, "CTORCHRUN_DIST_CHECK_CALLS");
  context.shm = read_switch(options.shm, "CTORCHRUN_DIST_SHM");
  ignore_default_sigpipe();
  context.store = store;
  context.rank = rank;
  context.size = size;
  context.device = options.device;
  context.master_addr = options.master_addr.value_or(env("MASTER_ADDR").value_or(""));
  context.group_key = group_key;
  context.timeout = options.timeout;
  auto backend = set_up_backend(options.backend, context, deadline, "group '" + group_key + "'");
  std::vector<int> global(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) global[static_cast<size_t>(r)] = r;
  return std::make_shared<ProcessGroup>(std::move(backend), std::move(context), group_key, store,
                                        std::move(global), nullptr);
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks,
                                                      milliseconds timeout) {
  const int id = next_group_.fetch_add(1);
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= size() || !seen.insert(r).second) {
      throw ConfigError("new_group: ranks [" + join_ranks(ranks) +
                        "] must be distinct ranks of the parent group (size " +
                        std::to_string(size()) + ")");
    }
  }
  if (ranks.empty()) throw ConfigError("new_group: the rank list is empty");
  auto position = std::find(ranks.begin(), ranks.end(), rank());
  if (position == ranks.end()) return nullptr;

  const auto group_timeout = timeout > milliseconds(0) ? timeout : context_.timeout;
  const auto deadline = Clock::now() + group_timeout;
  const std::string prefix = store_prefix_ + "/group_" + std::to_string(id);
  auto group_store = std::make_shared<store::PrefixStore>(prefix, root_store_);
  const std::string listed = join_ranks(ranks);
  const std::string agreed = group_store->compare_set("ranks", "", listed);
  if (agreed != listed) {
    throw ConfigError("new_group: this rank asked for ranks [" + listed +
                      "] but another member asked for [" + agreed +
                      "]; every rank must pass the same list in the same order");
  }
  BackendContext context = context_;
  context.store = group_store;
  context.group_key = prefix;
  context.rank = static_cast<int>(position - ranks.begin());
  context.size = static_cast<int>(ranks.size());
  context.timeout = group_timeout;
  auto backend = set_up_backend(backend_->name(), context, deadline,
                                "subgroup [" + listed + "], keys /" + prefix + "/arrived/<rank>");
  std::vector<int> global;
  for (int r : ranks) global.push_back(global_ranks_[static_cast<size_t>(r)]);
  return std::make_shared<ProcessGroup>(std::move(backend), std::move(context), prefix, root_store_,
                                        std::move(global), keep_alive_);
}

WorkHandle ProcessGroup::start(Op op, bool async) {
  const char* name = to_string(op.type);
  auto fail = [&](const std::string& why) {
    throw ConfigError(std::string(name) + " on rank " + std::to_string(rank()) + "/" +
                      std::to_string(size()) + ": " + why);
  };
  auto check_buffer = [&](const Buffer& b, const char* which) {
    if (b.count > 0 && b.data == nullptr) fail(std::string(which) + " buffer is null");
    if (b.count > 0 && b.device.type != context_.device.type) {
      fail(std::string(which) + " buffer is on " + to_string(b.device) + " but the " +
           backend_->name() + " group works on " + to_string(context_.device));
    }
  };
  auto check_rank = [&](int r, const char* what) {
    if (r < 0 || r >= size()) {
      fail(std::string(what) + " " + std::to_string(r) + " is not a rank of this group (size " +
           std::to_string(size()) + ")");
    }
  };
  auto check_same_type = [&]() {
    if (op.input.count > 0 && op.output.count > 0 && op.input.dtype != op.output.dtype) {
      fail(std::string("input is ") + to_string(op.input.dtype) + " but output is " +
           to_string(op.output.dtype));
    }
  };
  const auto n = static_cast<size_t>(size());
  switch (op.type) {
    case OpType::kAllReduce:
    case OpType::kBroadcast:
    case OpType::kReduce:
      check_buffer(op.output, "the");
      if (op.type != OpType::kAllReduce) check_rank(op.peer, "root");
      break;
    case OpType::kAllGather:
    case OpType::kGather:
      check_buffer(op.input, "input");
      if (op.type == OpType::kGather) check_rank(op.peer, "root");
      if (op.type == OpType::kAllGather || rank() == op.peer) {
        check_buffer(op.output, "output");
        check_same_type();
        if (op.output.count != n * op.input.count) {
          fail("output holds " + std::to_string(op.output.count) + " elements, needs " +
               std::to_string(n * op.input.count) + " (group size x input count)");
        }
      }
      break;
    case OpType::kScatter:
    case OpType::kReduceScatter:
      check_buffer(op.output, "output");
      if (op.type == OpType::kScatter) check_rank(op.peer, "root");
      if (op.type == OpType::kReduceScatter || rank() == op.peer) {
        check_buffer(op.input, "input");
        check_same_type();
        if (op.input.count != n * op.output.count) {
          fail("input holds " + std::to_string(op.input.count) + " elements, needs " +
               std::to_string(n * op.output.count) + " (group size x output count)");
        }
      }
      break;
    case OpType::kAllToAll:
      check_buffer(op.input, "input");
      check_buffer(op.output, "output");
      check_same_type();
      if (op.input.count != op.output.count || op.input.count % n != 0) {
        fail(
            "input and output must hold the same number of elements, a multiple of the group "
            "size; they hold " +
            std::to_string(op.input.count) + " and " + std::to_string(op.output.count));
      }
      break;
    case OpType::kBarrier:
      break;
    case OpType::kSend:
    case OpType::kRecv:
      check_buffer(op.type == OpType::kSend ? op.input : op.output, "the");
      check_rank(op.peer, op.type == OpType::kSend ? "destination" : "source");
      if (op.peer == rank()) fail("a rank cannot send to or receive from itself");
      if (op.tag < 0) fail("the tag must not be negative");
      break;
  }
  const bool reduces = op.type == OpType::kAllReduce || op.type == OpType::kReduce ||
                       op.type == OpType::kReduceScatter;
  if (reduces && op.reduce == ReduceOp::kAverage) {
    const DataType dtype = op.type == OpType::kReduceScatter ? op.input.dtype : op.output.dtype;
    if (!is_floating(dtype)) {
      fail(std::string("average is defined for floating types only, not ") + to_string(dtype) +
           "; reduce with sum and divide");
    }
  }
  if (op.timeout <= milliseconds(0)) op.timeout = context_.timeout;
  return backend_->run(op, async);
}

namespace {

Op make_op(OpType type, const Buffer& input, const Buffer& output, ReduceOp reduce, int peer,
           int tag, milliseconds timeout) {
  Op op;
  op.type = type;
  op.input = input;
  op.output = output;
  op.reduce = reduce;
  op.peer = peer;
  op.tag = tag;
  op.timeout = timeout;
  return op;
}

}  // namespace

#define CTORCHRUN_DIST_PAIR(blocking, params, op_expr)          \
  void ProcessGroup::blocking params { start(op_expr, false); } \
  WorkHandle ProcessGroup::blocking##_async params { return start(op_expr, true); }

CTORCHRUN_DIST_PAIR(all_reduce, (const Buffer& buffer, ReduceOp op, milliseconds timeout),
                    make_op(OpType::kAllReduce, {}, buffer, op, 0, 0, timeout))
CTORCHRUN_DIST_PAIR(broadcast, (const Buffer& buffer, int root, milliseconds timeout),
                    make_op(OpType::kBroadcast, {}, buffer, ReduceOp::kSum, root, 0, timeout))
CTORCHRUN_DIST_PAIR(reduce, (const Buffer& buffer, int root, ReduceOp op, milliseconds timeout),
                    make_op(OpType::kReduce, {}, buffer, op, root, 0, timeout))
CTORCHRUN_DIST_PAIR(all_gather, (const Buffer& input, const Buffer& output, milliseconds timeout),
                    make_op(OpType::kAllGather, input, output, ReduceOp::kSum, 0, 0, timeout))
CTORCHRUN_DIST_PAIR(gather,
                    (const Buffer& input, const Buffer& output, int root, milliseconds timeout),
                    make_op(OpType::kGather, input, output, ReduceOp::kSum, root, 0, timeout))
CTORCHRUN_DIST_PAIR(scatter,
                    (const Buffer& input, const Buffer& output, int root, milliseconds timeout),
                    make_op(OpType::kScatter, input, output, ReduceOp::kSum, root, 0, timeout))
CTORCHRUN_DIST_PAIR(reduce_scatter,
                    (const Buffer& input, const Buffer& output, ReduceOp op, milliseconds timeout),
                    make_op(OpType::kReduceScatter, input, output, op, 0, 0, timeout))
CTORCHRUN_DIST_PAIR(all_to_all, (const Buffer& input, const Buffer& output, milliseconds timeout),
                    make_op(OpType::kAllToAll, input, output, ReduceOp::kSum, 0, 0, timeout))
CTORCHRUN_DIST_PAIR(barrier, (milliseconds timeout),
                    make_op(OpType::kBarrier, {}, {}, ReduceOp::kSum, 0, 0, timeout))
CTORCHRUN_DIST_PAIR(send, (const Buffer& buffer, int dst, int tag, milliseconds timeout),
                    make_op(OpType::kSend, buffer, {}, ReduceOp::kSum, dst, tag, timeout))
CTORCHRUN_DIST_PAIR(recv, (const Buffer& buffer, int src, int tag, milliseconds timeout),
                    make_op(OpType::kRecv, {}, buffer, ReduceOp::kSum, src, tag, timeout))

#undef CTORCHRUN_DIST_PAIR

}  // namespace ctorchrun::dist

#include "torch_backend/csrc/process_group_ctorch.h"

#include <ATen/ATen.h>
#include <Python.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <utility>

#include "common/error.h"
#include "common/log.h"
#include "store/prefix_store.h"
#include "torch_backend/csrc/torch_store.h"

namespace ctorchrun::torch_backend {
namespace {

using dist::Buffer;
using dist::DataType;
using dist::ReduceOp;
using dist::WorkHandle;
using std::chrono::milliseconds;

// Where ours live in torch's group store, apart from whatever torch keeps there.
constexpr const char* kKeyPrefix = "ctorch";

// torch's Work, completed (Future first, then waiters) by the callback that
// libctorch_dist's Work runs when the operation ends.
class CtorchWork : public c10d::Work {
 public:
  CtorchWork(c10d::OpType type, std::string name, std::vector<at::Tensor> outputs)
      : c10d::Work(-1, type),
        name_(std::move(name)),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }

  bool wait(milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout.count() == 0) {  // torch's kNoTimeout: wait for completion
      cv_.wait(lock, [&] { return completed_; });
    } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      TORCH_CHECK(false, "ctorch: ", name_, " did not complete within ", timeout.count(),
                  " ms (Work.wait timeout); it is still running");
    }
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  const std::string name_;
  const std::vector<at::Tensor> outputs_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

// Byte buffers for staging, kept for the group's next calls: a fresh buffer
// of many MiB costs a page fault for every 4 KiB on first touch, which took
// longer than the copies themselves (an all_gather of 16 MiB into a list,
// 2 ranks: 7x the time of the same call into one tensor). At most kKeep
// buffers, kMaxBytes each, are kept; thread-safe.
class StagingPool {
 public:
  // A contiguous 1-D tensor of `numel` elements of `dtype`, from a kept
  // buffer when one is large enough; give its buffer back with release().
  std::pair<at::Tensor, at::Tensor> acquire(int64_t numel, at::ScalarType dtype) {
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor buffer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->numel() >= bytes) {
          buffer = *it;
          free_.erase(it);
          break;
        }
      }
    }
    if (!buffer.defined()) buffer = at::empty({std::max<int64_t>(bytes, 1)}, at::kByte);
    return {buffer.narrow(0, 0, bytes).view(dtype), buffer};
  }

  void release(const at::Tensor& buffer) {
    if (buffer.numel() > kMaxBytes) return;
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(buffer);
    if (free_.size() > kKeep) {  // drop the smallest
      auto smallest =
          std::min_element(free_.begin(), free_.end(),
                           [](const auto& a, const auto& b) { return a.numel() < b.numel(); });
      free_.erase(smallest);
    }
  }

 private:
  static constexpr size_t kKeep = 4;
  static constexpr int64_t kMaxBytes = int64_t{256} << 20;
  std::mutex mutex_;
  std::vector<at::Tensor> free_;
};

namespace {

// What one call keeps alive until it ends, and copies back after success
// (from a contiguous staging tensor into the caller's); its pooled buffers
// go back to the pool once it has ended.
struct Staging {
  std::vector<at::Tensor> keep;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (destination, source)
  std::shared_ptr<StagingPool> pool;
  std::vector<at::Tensor> pooled;

  at::Tensor take(int64_t numel, at::ScalarType dtype) {
    auto [tensor, buffer] = pool->acquire(numel, dtype);
    pooled.push_back(buffer);
    return tensor;
  }
  void give_back() {
    for (const auto& buffer : pooled) pool->release(buffer);
    pooled.clear();
  }
};

Staging staged_by(const std::shared_ptr<StagingPool>& pool) {
  Staging staging;
  staging.pool = pool;
  return staging;
}

DataType data_type(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kChar:
      return DataType::kInt8;
    case at::kByte:
    case at::kBool:
      return DataType::kUInt8;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    default:
      TORCH_CHECK(false, "ctorch: ", op, " does not support tensors of ", t.scalar_type(),
                  "; it takes float32, float64, float16, bfloat16, int8, uint8, int32, int64 "
                  "and bool");
  }
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "ctorch: ", op, " got an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "ctorch: ", op, " takes CPU tensors, not ", t.device(),
              " (use nccl for CUDA tensors: init_process_group(\"cpu:ctorch,cuda:nccl\"))");
  TORCH_CHECK(t.layout() == at::kStrided, "ctorch: ", op, " takes dense tensors, not ", t.layout());
  data_type(t, op);
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "ctorch: ", op, " takes one tensor per process, got ",
              tensors.size());
  check_tensor(tensors[0], op);
  return tensors[0];
}

// A contiguous tensor holding `t`'s data: `t` itself, or a copy written back
// into `t` after success when `written` (the op's output).
at::Tensor contiguous(const at::Tensor& t, bool written, Staging& staging) {
  if (t.is_contiguous()) {
    staging.keep.push_back(t);
    return t;
  }
  at::Tensor copy = t.contiguous();
  staging.keep.push_back(copy);
  if (written) staging.copy_back.emplace_back(t, copy);
  return copy;
}

Buffer buffer_of(const at::Tensor& t, const char* op) {
  return Buffer{
      t.numel() > 0 ? t.data_ptr() : nullptr, static_cast<size_t>(t.numel()), data_type(t, op), {}};
}

ReduceOp reduce_op(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) {
  const bool boolean = t.scalar_type() == at::kBool;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      TORCH_CHECK(!boolean, "ctorch: ", name,
                  " cannot SUM bool tensors; use MAX (or) or MIN (and)");
      return ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), "ctorch: ", name,
                  " averages floating tensors only, not ", t.scalar_type(),
                  "; reduce with SUM and divide");
      return ReduceOp::kAverage;
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN:
      return ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceOp::kMax;
    default:
      TORCH_CHECK(false, "ctorch: ", name, " does not support reduce op ", static_cast<int>(op.op_),
                  " (BAND, BOR, BXOR and PREMUL_SUM); it offers SUM, AVG, PRODUCT, MIN, MAX");
  }
}

milliseconds op_timeout(milliseconds given) {
  return given.count() < 0 ? dist::kGroupTimeout : given;
}

using Start = std::function<WorkHandle()>;

// Runs each of `starts` (each queues one operation in libctorch_dist), then
// returns torch's Work, completed with `outputs` once every operation and
// the copies back are done, with the first error if any failed.
// libctorch_dist's errors in a start (a bad call) become c10::Error, a
// RuntimeError in Python; operations queued before it still run.
c10::intrusive_ptr<c10d::Work> launch_all(c10d::OpType type, const char* name,
                                          std::vector<at::Tensor> outputs, Staging staging,
                                          const std::vector<Start>& starts) {
  std::vector<WorkHandle> handles;
  try {
    for (const auto& start : starts) handles.push_back(start());
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ctorch: ", e.what());
  }
  auto work = c10::make_intrusive<CtorchWork>(type, name, std::move(outputs));
  struct Pending {
    std::mutex mutex;
    size_t left;
    std::exception_ptr error;
    Staging staging;
  };
  auto pending = std::make_shared<Pending>();
  pending->left = handles.size();
  pending->staging = std::move(staging);
  auto done = [work, pending](std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(pending->mutex);
      if (error && !pending->error) pending->error = error;
      if (--pending->left > 0) return;
    }
    // The last one: every operation has ended, nothing else touches pending.
    if (!pending->error) {
      try {
        for (const auto& [to, from] : pending->staging.copy_back) to.copy_(from);
      } catch (...) {
        pending->error = std::current_exception();
      }
    }
    pending->staging.give_back();
    pending->staging = Staging{};
    work->complete(pending->error);
  };
  for (const auto& handle : handles) dist::when_complete(handle, done);
  return work;
}

c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* name,
                                      std::vector<at::Tensor> outputs, Staging staging,
                                      const Start& start) {
  return launch_all(type, name, std::move(outputs), std::move(staging), {start});
}

std::string transport_reason(const std::string& transport, int size) {
  if (transport == "shm") return "every rank runs on this host";
  if (transport == "hier") return "ranks on several hosts: shared memory within each, gloo between";
  if (size == 1) return "a group of one rank";
  const char* shm = std::getenv("CTORCHRUN_DIST_SHM");
  if (shm != nullptr && std::string(shm) == "0") return "CTORCHRUN_DIST_SHM=0";
  return "one rank per host, or no shared memory to be had (see any warning above)";
}

}  // namespace

ProcessGroupCtorch::ProcessGroupCtorch(const GroupOptions& options)
    : BackendBase(options.rank, options.size), pool_(std::make_shared<StagingPool>()) {
  TORCH_CHECK(options.store, "ctorch: no store to build the process group on");
  auto store =
      std::make_shared<store::PrefixStore>(kKeyPrefix, std::make_shared<TorchStore>(options.store));
  dist::InitOptions init;
  init.timeout = options.timeout;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string key =
      "torch/attempt_" + std::string(attempt ? attempt : "0") + "/group_" + options.group_id;
  try {
    group_ = dist::join_process_group(store, options.rank, options.size, key, init);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ctorch: process group '", options.group_id, "' set-up failed: ", e.what());
  }
  if (options.rank == 0) {
    get_logger("coll")->info("ctorch process group '{}' of {} rank(s): transport {} ({})",
                             options.group_id, options.size, group_->transport(),
                             transport_reason(group_->transport(), options.size));
  }
}

ProcessGroupCtorch::~ProcessGroupCtorch() {
  // The last reference may go from Python, with the GIL held, while the
  // group's queue thread completes a Future whose callback needs the GIL (a
  // DDP comm hook's then()): stopping the group waits for that thread, so
  // the GIL is let go meanwhile.
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* state = PyEval_SaveThread();
    group_.reset();
    PyEval_RestoreThread(state);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  const char* name = "broadcast";
  const at::Tensor& t = single(tensors, name);
  TORCH_CHECK(opts.rootTensor == 0, "ctorch: ", name, " takes one tensor per process");
  Staging staging = staged_by(pool_);
  at::Tensor data = contiguous(t, true, staging);
  return launch(c10d::OpType::BROADCAST, name, tensors, std::move(staging), [&] {
    return group_->broadcast_async(buffer_of(data, name), static_cast<int>(opts.rootRank),
                                   op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  const char* name = "allreduce";
  const at::Tensor& t = single(tensors, name);
  const ReduceOp op = reduce_op(opts.reduceOp, t, name);
  Staging staging = staged_by(pool_);
  at::Tensor data = contiguous(t, true, staging);
  return launch(c10d::OpType::ALLREDUCE, name, tensors, std::move(staging), [&] {
    return group_->all_reduce_async(buffer_of(data, name), op, op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* name = "allreduce_coalesced";
  TORCH_CHECK(!tensors.empty(), "ctorch: ", name, " got no tensors");
  for (const auto& t : tensors) {
    check_tensor(t, name);
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "ctorch: ", name,
                " takes tensors of one type, got ", tensors[0].scalar_type(), " and ",
                t.scalar_type());
  }
  const ReduceOp op = reduce_op(opts.reduceOp, tensors[0], name);
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  Staging staging = staged_by(pool_);
  at::Tensor joined = staging.take(total, tensors[0].scalar_type());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    at::Tensor slot = joined.narrow(0, offset, t.numel());
    slot.copy_(t.reshape({-1}));
    staging.copy_back.emplace_back(t, slot.view(t.sizes()));
    offset += t.numel();
  }
  return launch(c10d::OpType::ALLREDUCE_COALESCED, name, tensors, std::move(staging), [&] {
    return group_->all_reduce_async(buffer_of(joined, name), op, op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  const char* name = "reduce";
  const at::Tensor& t = single(tensors, name);
  TORCH_CHECK(opts.rootTensor == 0, "ctorch: ", name, " takes one tensor per process");
  const ReduceOp op = reduce_op(opts.reduceOp, t, name);
  Staging staging = staged_by(pool_);
  at::Tensor data = contiguous(t, true, staging);
  return launch(c10d::OpType::REDUCE, name, tensors, std::move(staging), [&] {
    return group_->reduce_async(buffer_of(data, name), static_cast<int>(opts.rootRank), op,
                                op_timeout(opts.timeout));
  });
}

namespace {

// `parts` (one per rank, each shaped like `like`) as views of one
// contiguous staging tensor: the op writes it, the copies back fill `parts`
// (or `parts` are read from it: `fill` copies them in first).
at::Tensor stage_parts(const std::vector<at::Tensor>& parts, const at::Tensor& like, int size,
                       const char* name, bool fill, Staging& staging) {
  TORCH_CHECK(static_cast<int>(parts.size()) == size, "ctorch: ", name, " takes ", size,
              " tensors (the group's size), got ", parts.size());
  at::Tensor flat = staging.take(size * like.numel(), like.scalar_type());
  for (int r = 0; r < size; ++r) {
    const at::Tensor& part = parts[static_cast<size_t>(r)];
    check_tensor(part, name);
    TORCH_CHECK(part.numel() == like.numel() && part.scalar_type() == like.scalar_type(),
                "ctorch: ", name, ": tensor ", r, " holds ", part.numel(), " ", part.scalar_type(),
                ", every one must hold ", like.numel(), " ", like.scalar_type());
    at::Tensor slot = flat.narrow(0, r * like.numel(), like.numel());
    if (fill) {
      slot.copy_(part.reshape({-1}));
    } else {
      staging.copy_back.emplace_back(part, slot.view(part.sizes()));
    }
  }
  return flat;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "allgather";
  const at::Tensor& input = single(inputs, name);
  TORCH_CHECK(outputs.size() == 1, "ctorch: ", name, " takes one output list per process");
  Staging staging = staged_by(pool_);
  at::Tensor in = contiguous(input, false, staging);
  at::Tensor flat = stage_parts(outputs[0], input, getSize(), name, false, staging);
  return launch(c10d::OpType::ALLGATHER, name, outputs[0], std::move(staging), [&] {
    return group_->all_gather_async(buffer_of(in, name), buffer_of(flat, name),
                                    op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor";
  check_tensor(input, name);
  check_tensor(output, name);
  Staging staging = staged_by(pool_);
  at::Tensor in = contiguous(input, false, staging);
  at::Tensor out = contiguous(output, true, staging);
  return launch(c10d::OpType::_ALLGATHER_BASE, name, {output}, std::move(staging), [&] {
    return group_->all_gather_async(buffer_of(in, name), buffer_of(out, name),
                                    op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "allgather_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "ctorch: ", name, " takes an output list per input");
  Staging staging = staged_by(pool_);
  std::vector<Start> starts;
  std::vector<at::Tensor> results;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], name);
    at::Tensor in = contiguous(inputs[i], false, staging);
    at::Tensor flat = stage_parts(outputs[i], inputs[i], getSize(), name, false, staging);
    results.insert(results.end(), outputs[i].begin(), outputs[i].end());
    starts.push_back([this, in, flat, name, timeout = op_timeout(opts.timeout)] {
      return group_->all_gather_async(buffer_of(in, name), buffer_of(flat, name), timeout);
    });
  }
  return launch_all(c10d::OpType::ALLGATHER_COALESCED, name, results, std::move(staging), starts);
}

#if TORCH_VERSION_MAJOR >= 2
namespace {

// The coalesced tensor forms: one operation per (output, input) pair, made
// by `make` from their contiguous versions, all in one Work.
c10::intrusive_ptr<c10d::Work> pairwise(
    const char* name, Staging staging, std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const std::function<Start(const at::Tensor& in, const at::Tensor& out)>& make) {
  TORCH_CHECK(outputs.size() == inputs.size(), "ctorch: ", name, " takes an output per input");
  std::vector<Start> starts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(inputs[i], name);
    check_tensor(outputs[i], name);
    starts.push_back(
        make(contiguous(inputs[i], false, staging), contiguous(outputs[i], true, staging)));
  }
  return launch_all(c10d::OpType::COALESCED, name, outputs, std::move(staging), starts);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "allgather_into_tensor_coalesced";
  const milliseconds timeout = op_timeout(opts.timeout);
  return pairwise(name, staged_by(pool_), outputs, inputs, [&](at::Tensor in, at::Tensor out) {
    return [this, in, out, name, timeout] {
      return group_->all_gather_async(buffer_of(in, name), buffer_of(out, name), timeout);
    };
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor_coalesced";
  const milliseconds timeout = op_timeout(opts.timeout);
  return pairwise(name, staged_by(pool_), outputs, inputs, [&](at::Tensor in, at::Tensor out) {
    const ReduceOp op = reduce_op(opts.reduceOp, out, name);
    return [this, in, out, op, name, timeout] {
      return group_->reduce_scatter_async(buffer_of(in, name), buffer_of(out, name), op, timeout);
    };
  });
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* name = "gather";
  const at::Tensor& input = single(inputs, name);
  const int root = static_cast<int>(opts.rootRank);
  Staging staging = staged_by(pool_);
  at::Tensor in = contiguous(input, false, staging);
  at::Tensor flat;
  std::vector<at::Tensor> results;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1, "ctorch: ", name, " takes one output list on the root");
    flat = stage_parts(outputs[0], input, getSize(), name, false, staging);
    results = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "ctorch: ", name,
                " takes output tensors on the root only");
  }
  return launch(c10d::OpType::GATHER, name, results, std::move(staging), [&] {
    return group_->gather_async(buffer_of(in, name),
                                flat.defined() ? buffer_of(flat, name) : Buffer{}, root,
                                op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* name = "scatter";
  const at::Tensor& output = single(outputs, name);
  const int root = static_cast<int>(opts.rootRank);
  Staging staging = staged_by(pool_);
  at::Tensor out = contiguous(output, true, staging);
  at::Tensor flat;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1, "ctorch: ", name, " takes one input list on the root");
    flat = stage_parts(inputs[0], output, getSize(), name, true, staging);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "ctorch: ", name,
                " takes input tensors on the root only");
  }
  return launch(c10d::OpType::SCATTER, name, outputs, std::move(staging), [&] {
    return group_->scatter_async(flat.defined() ? buffer_of(flat, name) : Buffer{},
                                 buffer_of(out, name), root, op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter";
  const at::Tensor& output = single(outputs, name);
  TORCH_CHECK(inputs.size() == 1, "ctorch: ", name, " takes one input list per process");
  const ReduceOp op = reduce_op(opts.reduceOp, output, name);
  Staging staging = staged_by(pool_);
  at::Tensor out = contiguous(output, true, staging);
  at::Tensor flat = stage_parts(inputs[0], output, getSize(), name, true, staging);
  return launch(c10d::OpType::REDUCE_SCATTER, name, outputs, std::move(staging), [&] {
    return group_->reduce_scatter_async(buffer_of(flat, name), buffer_of(out, name), op,
                                        op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  check_tensor(input, name);
  check_tensor(output, name);
  const ReduceOp op = reduce_op(opts.reduceOp, output, name);
  Staging staging = staged_by(pool_);
  at::Tensor in = contiguous(input, false, staging);
  at::Tensor out = contiguous(output, true, staging);
  return launch(c10d::OpType::_REDUCE_SCATTER_BASE, name, {output}, std::move(staging), [&] {
    return group_->reduce_scatter_async(buffer_of(in, name), buffer_of(out, name), op,
                                        op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  check_tensor(input, name);
  check_tensor(output, name);
  auto even = [&](const std::vector<int64_t>& splits, const at::Tensor& t) {
    if (splits.empty()) return true;
    for (int64_t s : splits) {
      if (s * getSize() != (t.dim() > 0 ? t.size(0) : 0)) return false;
    }
    return true;
  };
  TORCH_CHECK(even(output_split_sizes, output) && even(input_split_sizes, input), "ctorch: ", name,
              " with uneven split sizes is not supported; pass equal splits (or none)");
  Staging staging = staged_by(pool_);
  at::Tensor in = contiguous(input, false, staging);
  at::Tensor out = contiguous(output, true, staging);
  return launch(c10d::OpType::ALLTOALL_BASE, name, {output}, std::move(staging), [&] {
    return group_->all_to_all_async(buffer_of(in, name), buffer_of(out, name),
                                    op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  TORCH_CHECK(!inputs.empty(), "ctorch: ", name, " got no tensors");
  check_tensor(inputs[0], name);
  Staging staging = staged_by(pool_);
  at::Tensor in = stage_parts(inputs, inputs[0], getSize(), name, true, staging);
  at::Tensor out = stage_parts(outputs, inputs[0], getSize(), name, false, staging);
  return launch(c10d::OpType::ALLTOALL, name, outputs, std::move(staging), [&] {
    return group_->all_to_all_async(buffer_of(in, name), buffer_of(out, name),
                                    op_timeout(opts.timeout));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::barrier(const c10d::BarrierOptions& opts) {
  return launch(c10d::OpType::BARRIER, "barrier", {}, Staging{},
                [&] { return group_->barrier_async(op_timeout(opts.timeout)); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::send(std::vector<at::Tensor>& tensors, int dst,
                                                        int tag) {
  const char* name = "send";
  const at::Tensor& t = single(tensors, name);
  Staging staging = staged_by(pool_);
  at::Tensor data = contiguous(t, false, staging);
  return launch(c10d::OpType::SEND, name, tensors, std::move(staging),
                [&] { return group_->send_async(buffer_of(data, name), dst, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCtorch::recv(std::vector<at::Tensor>& tensors, int src,
                                                        int tag) {
  const char* name = "recv";
  const at::Tensor& t = single(tensors, name);
  Staging staging = staged_by(pool_);
  at::Tensor data = contiguous(t, true, staging);
  return launch(c10d::OpType::RECV, name, tensors, std::move(staging),
                [&] { return group_->recv_async(buffer_of(data, name), src, tag); });
}

c10::intrusive_ptr<BackendBase> create_process_group(const GroupOptions& options) {
  return c10::make_intrusive<ProcessGroupCtorch>(options);
}

}  // namespace ctorchrun::torch_backend

// The Python module of the ctorch backend: one function, the creator that
// torch.distributed calls for every process group of backend "ctorch"
// (ctorch/__init__.py registers it). Its name carries the torch version it
// was built against (_C_torch<major>_<minor>), so that builds for several
// torches sit side by side in one package.

#include <pybind11/chrono.h>
#include <torch/python.h>

#include "torch_backend/csrc/process_group_ctorch.h"

#ifndef CTORCH_EXTENSION_NAME
#error "CTORCH_EXTENSION_NAME names the module (set by the build)"
#endif

namespace {

c10::intrusive_ptr<ctorchrun::torch_backend::BackendBase> create(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
    std::string group_id) {
  ctorchrun::torch_backend::GroupOptions options;
  options.store = std::move(store);
  options.rank = rank;
  options.size = size;
  options.timeout = timeout;
  options.group_id = std::move(group_id);
  return ctorchrun::torch_backend::create_process_group(options);
}

std::string transport(const c10::intrusive_ptr<ctorchrun::torch_backend::BackendBase>& backend) {
  auto* ours = dynamic_cast<ctorchrun::torch_backend::ProcessGroupCtorch*>(backend.get());
  TORCH_CHECK(ours != nullptr, "not a ctorch process group");
  return ours->transport();
}

}  // namespace

PYBIND11_MODULE(CTORCH_EXTENSION_NAME, m) {
  m.doc() = "libctorch_dist as the torch.distributed backend 'ctorch'";
  // Set-up waits for every rank (up to the timeout): without the GIL, so
  // that the process's other Python threads run meanwhile.
  m.def("create_process_group", &create, pybind11::arg("store"), pybind11::arg("rank"),
        pybind11::arg("size"), pybind11::arg("timeout"), pybind11::arg("group_id"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("transport", &transport, pybind11::arg("backend"),
        "What moves a ctorch group's data: 'shm', 'hier' or 'gloo'.");
  m.attr("torch_version") = TORCH_VERSION;
}

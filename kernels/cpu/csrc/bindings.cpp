// The extension's entry points, two ways:
// - a Python module (pybind11) for eager calls: the cheapest call from Python, and the GIL is released
//   while a kernel runs, so another thread of the worker (the output sender, the next step's scheduling)
//   runs Python meanwhile;
// - torch operators in the namespace XINSERVE_OPS (xinserve_<build key>, set by kernels/cpp_build.py,
//   so two builds loaded in one process do not collide), for compiled decode steps: a traced call goes
//   through torch's C++ dispatcher instead of a Python custom op (kernels/cpp.py registers the fake
//   implementations the compiler needs).

// pybind11 with torch's tensor casters, not <torch/extension.h> (which adds torch's whole C++ frontend):
// half the compile time of this file (17 s against 36, measured).
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, double scale);
void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping);
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
int64_t decode_linear_lanes();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "store this step's keys and values into their slots of the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_linear", &decode_linear, "x @ weight^T (+ bias) for a few rows, streaming the weight once",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("decode_linear_lanes", &decode_linear_lanes, "the decode linear's vector width in floats (8: AVX2, 16: AVX-512)");
}

// TORCH_LIBRARY pastes its namespace argument into names, so the macro holding it is expanded first.
#define XINSERVE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define XINSERVE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

XINSERVE_LIBRARY(XINSERVE_OPS, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("decode_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

XINSERVE_LIBRARY_IMPL(XINSERVE_OPS, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("decode_linear", &decode_linear);
}

// Python bindings of dppo._C: no logic, only the mapping of C++ types and errors onto Python.
#include <torch/extension.h>

#include "backend.h"
#include "errors.h"
#include "pool.h"
#include "streamer.h"

namespace py = pybind11;

namespace {

// The Python exception classes live in dppo/_errors.py (so they can derive from KeyError, MemoryError...).
void raise(const char* cls, const char* message) {
  py::object type = py::module_::import("dppo._errors").attr(cls);
  PyErr_SetString(type.ptr(), message);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dppo snapshot engine (C++/CUDA); use it through dppo.snapshot";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dppo::EmptySlotError& e) {
      raise("EmptySlotError", e.what());
    } catch (const dppo::LayoutMismatchError& e) {
      raise("LayoutMismatchError", e.what());
    } catch (const dppo::SnapshotMemoryError& e) {
      raise("SnapshotMemoryError", e.what());
    } catch (const dppo::UnknownNameError& e) {
      raise("UnknownTensorError", e.what());
    } catch (const dppo::SnapshotError& e) {
      raise("SnapshotError", e.what());
    }
  });

  m.def("cuda_compiled", &dppo::cuda_compiled, "Whether this build compiled the CUDA engine");

  using dppo::Pool;
  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
      .def(py::init([](const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors,
                       int64_t max_host_bytes, int64_t device_budget_bytes, bool checksum, int64_t cpu_threads,
                       int64_t piece_bytes, int64_t swap_chunk_bytes, int64_t pin_chunk_bytes, double copy_delay_s,
                       int64_t fail_copy_task) {
             dppo::PoolOptions o;
             o.max_host_bytes = max_host_bytes;
             o.device_budget_bytes = device_budget_bytes;
             o.checksum = checksum;
             o.cpu_threads = cpu_threads;
             o.piece_bytes = piece_bytes;
             o.swap_chunk_bytes = swap_chunk_bytes;
             o.pin_chunk_bytes = pin_chunk_bytes;
             o.copy_delay_s = copy_delay_s;
             o.fail_copy_task = fail_copy_task;
             return std::make_shared<Pool>(names, tensors, o);
           }),
           py::arg("names"), py::arg("tensors"), py::kw_only(), py::arg("max_host_bytes") = -1,
           py::arg("device_budget_bytes") = 0, py::arg("checksum") = false, py::arg("cpu_threads") = 0,
           py::arg("piece_bytes") = dppo::PoolOptions{}.piece_bytes,
           py::arg("swap_chunk_bytes") = dppo::PoolOptions{}.swap_chunk_bytes,
           py::arg("pin_chunk_bytes") = dppo::PoolOptions{}.pin_chunk_bytes, py::arg("copy_delay_s") = 0.0,
           py::arg("fail_copy_task") = -1)
      .def("save", &Pool::save, release_gil())
      .def("restore", &Pool::restore, release_gil())
      .def("clear", &Pool::clear, release_gil())
      .def("fence", &Pool::fence, release_gil())
      .def("synchronize", &Pool::synchronize, release_gil())
      .def("swap_in", &Pool::swap_in, release_gil())
      .def("swap_out", &Pool::swap_out, release_gil())
      .def("view", &Pool::view, release_gil())
      .def("contains", &Pool::contains, release_gil())
      .def("slots", &Pool::slots, release_gil())
      .def("tier", &Pool::tier, release_gil())
      .def("reserve", &Pool::reserve, release_gil())
      .def("release", &Pool::release, release_gil())
      .def("op_stats", &Pool::op_stats, release_gil())
      .def("counters", &Pool::counters, release_gil())
      .def("names", &Pool::names)
      .def_property_readonly("nbytes", &Pool::nbytes)
      .def_property_readonly("storage_bytes", &Pool::storage_bytes)
      .def_property_readonly("runs", &Pool::runs)
      .def_property_readonly("host_bytes", py::cpp_function(&Pool::host_bytes, release_gil()))
      .def_property_readonly("device_bytes", py::cpp_function(&Pool::device_bytes, release_gil()))
      .def_property_readonly("staging_bytes", py::cpp_function(&Pool::staging_bytes, release_gil()))
      .def(
          "streamer",
          [](std::shared_ptr<Pool> self, int64_t slot, const std::vector<std::vector<std::string>>& schedule) {
            return std::make_shared<dppo::Streamer>(std::move(self), slot, schedule);
          },
          release_gil());

  using dppo::Streamer;
  py::class_<Streamer, std::shared_ptr<Streamer>>(m, "Streamer")
      .def("begin", &Streamer::begin, release_gil())
      .def("acquire", &Streamer::acquire, release_gil())
      .def("release", &Streamer::release, release_gil())
      .def("end", &Streamer::end, release_gil())
      .def_property_readonly("steps", &Streamer::steps)
      .def_property_readonly("staging_bytes", py::cpp_function(&Streamer::staging_bytes, release_gil()))
      .def_property_readonly("mode", py::cpp_function(&Streamer::mode, release_gil()));
}

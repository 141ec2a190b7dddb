// The one bindings file: op schemas of every native op (`Tensor!` marks a mutated argument)
// and the Python module `fastpar._C`. Kernels and torch glue live in their own files.
#include <Python.h>
#include <torch/library.h>

#include "build_info.h"

TORCH_LIBRARY(fastpar, m) {
  m.def("build_info() -> str", [] { return fastpar::build_info(); });
}

// Importing fastpar._C loads this library, which registers the ops above as torch.ops.fastpar.*.
static struct PyModuleDef fastpar_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fastpar_module); }

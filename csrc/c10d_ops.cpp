// What the fastpar backend's paths share: see c10d_ops.h.
#include "c10d_ops.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "py_call.h"

namespace fastpar {
namespace backend_ops {
namespace {

// fastpar/comm/engines/dtypes.py's numbering (0: another dtype), for the kernels' signatures.
int64_t dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return 1;
    case at::kDouble: return 2;
    case at::kHalf: return 3;
    case at::kBFloat16: return 4;
    case at::kChar: return 5;
    case at::kByte: return 6;
    case at::kShort: return 7;
    case at::kInt: return 8;
    case at::kLong: return 9;
    case at::kBool: return 10;
    case at::kComplexFloat: return 11;
    case at::kComplexDouble: return 12;
    default: return 0;
  }
}

bool float_kind(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf;
}

}  // namespace

int64_t signature(at::ScalarType s, at::IntArrayRef sizes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the sizes
  for (auto d : sizes) h = (h ^ static_cast<uint64_t>(d)) * 1099511628211ull;
  uint64_t dims = std::min<uint64_t>(sizes.size(), 255);
  return static_cast<int64_t>((static_cast<uint64_t>(dtype_code(s)) << 56) | (dims << 48) |
                              (h & ((1ull << 48) - 1)));
}

bool reduces(const at::Tensor& t, const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      return float_kind(t.is_complex() ? c10::toRealValueType(t.scalar_type()) : t.scalar_type());
    case c10d::ReduceOp::PREMUL_SUM:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::MIN:
      return float_kind(t.scalar_type());
    default:
      return false;
  }
}

void premultiply(at::Tensor& t, const c10d::ReduceOp& op) {
  auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(s != nullptr, "fastpar backend: PREMUL_SUM without its factor");
  if (s->tensor_factor.defined()) {
    t.mul_(s->tensor_factor.to(t.device()));
  } else {
    t.mul_(s->double_factor);
  }
}

void average(at::Tensor& t, int64_t size) {
  TORCH_CHECK(t.scalar_type() != at::kBool, "fastpar backend: ReduceOp.AVG of a bool tensor");
  if (t.is_floating_point() || t.is_complex()) {
    t.div_(size);
  } else {
    t.div_(size, "trunc");  // integers: the sum divided, rounded toward zero
  }
}

void copy_back(at::Tensor& t, const at::Tensor& c) {
  if (!c.is_same(t)) t.copy_(c);
}

std::tuple<int64_t, PyObject*> call_shm_maker(PyObject* maker, std::string& failed) {
  TORCH_CHECK(failed.empty(), "fastpar backend: setting up shared memory failed earlier: ",
              failed);
  TORCH_CHECK(maker != nullptr, "fastpar backend: the group was shut down");
  std::string error;
  int64_t handle = 0;
  PyObject* owner = nullptr;
  {
    Gil gil;
    PyObject* made = PyObject_CallNoArgs(maker);
    if (made == nullptr) {
      error = take_python_error();
    } else {
      if (PyTuple_Check(made) && PyTuple_Size(made) == 2) {
        handle = PyLong_AsLongLong(PyTuple_GetItem(made, 0));
        owner = PyTuple_GetItem(made, 1);
      }
      if (owner == nullptr || handle <= 0 || PyErr_Occurred()) {
        PyErr_Clear();
        error = "the maker did not return (handle, owner)";
        owner = nullptr;
      } else {
        Py_INCREF(owner);
      }
      Py_DECREF(made);
    }
  }
  if (!error.empty()) failed = error;
  TORCH_CHECK(error.empty(), "fastpar backend: setting up shared memory: ", error);
  return {handle, owner};
}

}  // namespace backend_ops
}  // namespace fastpar

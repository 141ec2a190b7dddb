// MPI's own collectives for a spanning fastpar backend group: see c10d_mpi.h.
#include "c10d_mpi.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>
#include <utility>

#include "c10d_ops.h"
#include "py_call.h"

namespace fastpar {

using c10d::ReduceOp;

namespace {

bool on_cpu(const at::Tensor& t) { return t.is_cpu() && t.layout() == at::kStrided; }

}  // namespace

MpiPath::MpiPath(PyObject* calls) : calls_(calls) {
  if (calls_ != nullptr) {
    Gil gil;
    Py_INCREF(calls_);
  }
}

MpiPath::~MpiPath() { close(false); }

bool MpiPath::carries(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kInt || s == at::kLong ||
         s == at::kByte || s == at::kChar;
}

bool MpiPath::all_reduces(const at::Tensor& t, const ReduceOp& op) const {
  if (!on() || !on_cpu(t) || !carries(t.scalar_type())) return false;
  const bool floats = t.is_floating_point();
  switch (op.op_) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
    case ReduceOp::MIN:
    case ReduceOp::MAX:
    case ReduceOp::PRODUCT:
      return true;
    case ReduceOp::PREMUL_SUM:
      return floats;
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      return !floats;
    default:
      return false;
  }
}

bool MpiPath::moves(const at::Tensor& t) const { return on() && on_cpu(t); }

void MpiPath::call(const char* method, const at::Tensor& t, PyObject* rest) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string error;
  {
    Gil gil;
    PyObject* r = nullptr;
    if (calls_ == nullptr) {
      error = "the group's MPI calls were closed";
    } else if (rest == nullptr) {
      error = take_python_error();
    } else {
      PyObject* fn = PyObject_GetAttrString(calls_, method);
      PyObject* tensor = THPVariable_Wrap(t);
      const Py_ssize_t n = PyTuple_Size(rest);
      PyObject* args = fn != nullptr && tensor != nullptr ? PyTuple_New(n + 1) : nullptr;
      if (args != nullptr) {
        Py_INCREF(tensor);
        PyTuple_SetItem(args, 0, tensor);
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* item = PyTuple_GetItem(rest, i);
          Py_INCREF(item);
          PyTuple_SetItem(args, i + 1, item);
        }
        r = PyObject_CallObject(fn, args);
      }
      if (r == nullptr) error = take_python_error();
      Py_XDECREF(r);
      Py_XDECREF(args);
      Py_XDECREF(tensor);
      Py_XDECREF(fn);
    }
    Py_XDECREF(rest);
  }
  TORCH_CHECK(error.empty(), "fastpar backend: MPI ", method, ": ", error);
}

void MpiPath::all_reduce(at::Tensor& t, const ReduceOp& op, int64_t size) {
  at::Tensor c = t.contiguous();
  if (op.op_ == ReduceOp::PREMUL_SUM) {
    if (c.is_same(t)) c = t.clone();  // the caller's tensor keeps its value until the result
    backend_ops::premultiply(c, op);
  }
  const char* name = "sum";
  switch (op.op_) {
    case ReduceOp::MIN: name = "min"; break;
    case ReduceOp::MAX: name = "max"; break;
    case ReduceOp::PRODUCT: name = "prod"; break;
    case ReduceOp::BAND: name = "band"; break;
    case ReduceOp::BOR: name = "bor"; break;
    case ReduceOp::BXOR: name = "bxor"; break;
    default: break;
  }
  PyObject* rest;
  {
    Gil gil;
    rest = Py_BuildValue("(s)", name);
  }
  call("all_reduce", c, rest);
  if (op.op_ == ReduceOp::AVG) backend_ops::average(c, size);
  backend_ops::copy_back(t, c);
}

void MpiPath::reduce_scatter(const at::Tensor& in, at::Tensor& out, bool by_max) {
  PyObject* rest;
  {
    Gil gil;
    PyObject* o = THPVariable_Wrap(out);
    rest = o == nullptr ? nullptr : Py_BuildValue("(Ns)", o, by_max ? "max" : "sum");
  }
  call("reduce_scatter", in, rest);
}

void MpiPath::all_gather(const at::Tensor& in, at::Tensor& out) {
  at::Tensor src = in.contiguous().clone();  // read before out is written (in may lie in out)
  at::Tensor out_c = out.contiguous();
  PyObject* rest;
  {
    Gil gil;
    PyObject* o = THPVariable_Wrap(out_c);
    rest = o == nullptr ? nullptr : Py_BuildValue("(N)", o);
  }
  call("all_gather", src, rest);
  backend_ops::copy_back(out, out_c);
}

void MpiPath::broadcast(at::Tensor& t, int64_t root) {
  at::Tensor c = t.contiguous();
  PyObject* rest;
  {
    Gil gil;
    rest = Py_BuildValue("(L)", static_cast<long long>(root));
  }
  call("broadcast", c, rest);
  backend_ops::copy_back(t, c);
}

void MpiPath::all_to_all(const at::Tensor& in, at::Tensor& out,
                         const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  at::Tensor in_c = in.contiguous();
  at::Tensor out_c = out.contiguous();
  const int64_t in_row = in.dim() == 0 ? 0 : in_c.nbytes() / std::max<int64_t>(in.size(0), 1);
  const int64_t out_row = out.dim() == 0 ? 0 : out_c.nbytes() / std::max<int64_t>(out.size(0), 1);
  PyObject* rest;
  {
    Gil gil;
    PyObject* o = THPVariable_Wrap(out_c);
    PyObject* s = PyList_New(static_cast<Py_ssize_t>(send.size()));
    PyObject* r = PyList_New(static_cast<Py_ssize_t>(recv.size()));
    for (size_t i = 0; i < send.size(); ++i) {
      PyList_SetItem(s, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(send[i] * in_row));
    }
    for (size_t i = 0; i < recv.size(); ++i) {
      PyList_SetItem(r, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(recv[i] * out_row));
    }
    if (o == nullptr) {
      Py_DECREF(s);
      Py_DECREF(r);
      rest = nullptr;
    } else {
      rest = Py_BuildValue("(NNN)", o, s, r);
    }
  }
  call("all_to_all", in_c, rest);
  backend_ops::copy_back(out, out_c);
}

void MpiPath::close(bool collective) {
  PyObject* calls = nullptr;
  {
    // Alone (an abort): never wait for a call in flight, which may wait for a dead peer; its
    // calls are then left to the process's end.
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (collective) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return;
    }
    std::swap(calls, calls_);
  }
  if (collective) {
    call_and_release(calls, "close");
  } else {
    release_python(calls);
  }
}

}  // namespace fastpar

// The CUDA IPC all-reduce behind the fastpar backend: see c10d_ipc.h.
#include "c10d_ipc.h"

#include <ATen/ATen.h>

#include "py_call.h"
#ifdef FASTPAR_WITH_CUDA
#include "cuda/ipc_allreduce.h"
#endif

namespace fastpar {

IpcAllReduce::IpcAllReduce(PyObject* maker, int64_t size) : maker_(maker), size_(size) {
#ifndef FASTPAR_WITH_CUDA
  maker_ = nullptr;  // nothing to launch: every call goes to the CUDA fallback
#endif
  if (maker_ != nullptr) {
    Gil gil;
    Py_INCREF(maker_);
  }
}

IpcAllReduce::~IpcAllReduce() { close(false); }

bool IpcAllReduce::serves(const at::Tensor& t, const c10d::ReduceOp& op) {
  if (maker_ == nullptr || !t.is_cuda() || t.layout() != at::kStrided) return false;
  if (op.op_ != c10d::ReduceOp::SUM && op.op_ != c10d::ReduceOp::AVG) return false;
  const auto s = t.scalar_type();
  if (s != at::kFloat && s != at::kHalf && s != at::kBFloat16) return false;
  const auto nbytes = static_cast<int64_t>(t.nbytes());
  if (nbytes == 0 || nbytes % 16 != 0) return false;  // the kernels move 16 bytes at a time
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(failed_.empty(), "fastpar backend: setting up the CUDA IPC all-reduce failed "
              "earlier: ", failed_);
  if (!tried_) {
    Gil gil;
    // Not inside a CUDA graph capture: the set-up allocates, synchronises and talks to the
    // peers. NCCL serves the captured call; the set-up waits for an eager one (every rank
    // captures alike, so all wait alike).
    PyObject* cuda = PyImport_ImportModule("torch.cuda");
    PyObject* capturing =
        cuda == nullptr ? nullptr : PyObject_CallMethod(cuda, "is_current_stream_capturing", nullptr);
    const bool captured = capturing != nullptr && PyObject_IsTrue(capturing) == 1;
    Py_XDECREF(capturing);
    Py_XDECREF(cuda);
    PyErr_Clear();
    if (captured) return false;
    tried_ = true;  // once, whatever happens: a second try the other ranks would not join
    PyObject* made = PyObject_CallFunction(maker_, "L", static_cast<long long>(t.get_device()));
    if (made == nullptr) {
      failed_ = take_python_error();
    } else if (!PyTuple_Check(made) || PyTuple_Size(made) != 4) {
      failed_ = "the maker did not return (context, max_bytes, algo, owner)";
    } else {
      ctx_ = PyLong_AsLongLong(PyTuple_GetItem(made, 0));
      if (!PyErr_Occurred()) max_bytes_ = PyLong_AsLongLong(PyTuple_GetItem(made, 1));
      if (!PyErr_Occurred()) algo_ = PyLong_AsLongLong(PyTuple_GetItem(made, 2));
      if (PyErr_Occurred()) {
        failed_ = take_python_error();
        ctx_ = 0;
      } else if (ctx_ != 0) {
        owner_ = PyTuple_GetItem(made, 3);
        Py_INCREF(owner_);
      }
    }
    Py_XDECREF(made);
    TORCH_CHECK(failed_.empty(), "fastpar backend: setting up the CUDA IPC all-reduce: ",
                failed_);
  }
  return ctx_ != 0 && nbytes <= max_bytes_;
}

void IpcAllReduce::all_reduce(at::Tensor& t, const c10d::ReduceOp& op) {
#ifdef FASTPAR_WITH_CUDA
  // The kernels read 16 bytes at a time from a contiguous tensor: a view at an odd address or
  // with strides goes through a copy (a rank-local choice: every rank runs the same kernel).
  const bool direct = t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  at::Tensor x = direct ? t : t.clone(at::MemoryFormat::Contiguous);
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(ctx_ != 0, "fastpar backend: the group's CUDA IPC all-reduce was closed");
    ipc::ipc_all_reduce(ctx_, x, algo_);
  }
  if (op.op_ == c10d::ReduceOp::AVG) x.div_(size_);
  if (!direct) t.copy_(x);
#else
  TORCH_CHECK(false, "fastpar backend: this build has no CUDA IPC all-reduce");
#endif
}

void IpcAllReduce::close(bool collective) {
  PyObject* owner = nullptr;
  PyObject* maker = nullptr;
  {
    // Alone (an abort): never wait for a set-up in flight, which may wait for a dead peer.
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (collective) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return;
    }
    std::swap(owner, owner_);
    std::swap(maker, maker_);
    ctx_ = 0;
  }
  call_and_release(owner, collective ? "close" : "drop");
  release_python(maker);
}

}  // namespace fastpar

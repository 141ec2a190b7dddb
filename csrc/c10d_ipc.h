#pragma once
// The CUDA IPC all-reduce behind the fastpar backend's allreduce of CUDA tensors (a group whose
// ranks share a host, on a CUDA build): fastpar.comm's communicator (csrc/cuda/, set up by
// fastpar/backend/cuda.py), taken where its kernels serve the call and its size limit holds;
// NCCL serves the rest. On a CPU build it is never taken.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <mutex>
#include <string>

namespace fastpar {

class IpcAllReduce {
 public:
  // maker(device_index) -> (context, max_bytes, algo, owner), collective over the group;
  // (0, 0, 0, None) where the group's set-up was refused. Null: never taken (the group spans
  // hosts, has one rank, or the build has no CUDA). size: the group's.
  IpcAllReduce(PyObject* maker, int64_t size);
  ~IpcAllReduce();

  // Whether this all-reduce takes the IPC kernels: a dense CUDA tensor of float32, float16 or
  // bfloat16, SUM or AVG, a multiple of 16 bytes, within the group's limit. The first call that
  // could be served sets the group up (collective: which calls qualify depends only on what
  // every rank shares, never on strides or addresses).
  bool serves(const at::Tensor& t, const c10d::ReduceOp& op);

  // t = op over the group of t, on the kernels (serves(t, op) held), enqueued on the current
  // stream of t's device.
  void all_reduce(at::Tensor& t, const c10d::ReduceOp& op);

  // Release the communicator: collectively (the group's shutdown: every rank in the same order,
  // as destroy_process_group does), or this rank alone (abort, or freed without a shutdown:
  // its own region then stays allocated, as a peer may still map it).
  void close(bool collective);

 private:
  PyObject* maker_;
  int64_t size_;
  bool tried_ = false;      // the set-up ran (made or refused)
  std::string failed_;      // why the maker raised (every later call raises it)
  int64_t ctx_ = 0;         // the communicator's context (0: none)
  int64_t max_bytes_ = 0;
  int64_t algo_ = 0;
  PyObject* owner_ = nullptr;  // its Python owner: close() collective, drop() alone
  std::mutex mu_;              // one set-up, one launch sequence
};

}  // namespace fastpar

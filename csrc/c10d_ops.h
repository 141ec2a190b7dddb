#pragma once
// What the fastpar backend's paths share (csrc/c10d_backend.cpp, csrc/c10d_hier.cpp): the shm
// kernels' call signatures, the reductions made from their sum and max, and the call of a
// Python maker of a shm communicator.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>
#include <tuple>

namespace fastpar {
namespace backend_ops {

// What a byte-moving call carries, compared across ranks by the kernel (as shm.signature does):
// bits 56-63 the dtype (fastpar/comm/engines/dtypes.py's numbering), 48-55 the number of dims,
// 0-47 a hash of the shape.
int64_t signature(at::ScalarType s, at::IntArrayRef sizes);

// Whether the kernels reduce t by op: floats by SUM and MAX, and MIN, AVG and PREMUL_SUM made
// from them (MIN = -max(-x), AVG = the sum divided, PREMUL_SUM = multiplied, then summed);
// complex tensors as their real view (SUM and AVG only).
bool reduces(const at::Tensor& t, const c10d::ReduceOp& op);

// t times PREMUL_SUM's factor.
void premultiply(at::Tensor& t, const c10d::ReduceOp& op);

// A sum over `size` ranks made into their average (integers: rounded toward zero).
void average(at::Tensor& t, int64_t size);

// A result computed in c, a contiguous copy of t where t is not, lands in t.
void copy_back(at::Tensor& t, const at::Tensor& c);

// Call a Python maker of a shm communicator (collective over its group): (the communicator's
// handle, a new reference to its owner, whose close() detaches it); its exception as a
// c10::Error. A set-up that failed once (`failed` set) fails every later call alike, without a
// second attempt the other ranks might not join.
std::tuple<int64_t, PyObject*> call_shm_maker(PyObject* maker, std::string& failed);

}  // namespace backend_ops
}  // namespace fastpar

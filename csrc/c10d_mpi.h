#pragma once
// MPI's own collectives for a fastpar backend group that spans hosts, in a job launched by MPI,
// through fastpar/backend/mpi.py (MpiCalls): the group's flat calls that the hierarchy
// (csrc/c10d_hier.h) does not take, and the hierarchy's cross-host stage. Tensors go to Python
// contiguous; moves go as bytes (any dtype).
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <mutex>
#include <vector>

namespace fastpar {

class MpiPath {
 public:
  explicit MpiPath(PyObject* calls);  // an MpiCalls (null: none)
  ~MpiPath();

  bool on() const { return calls_ != nullptr; }
  // The dtypes MPI reduces here (fastpar.comm.policy.MPI_DTYPES).
  static bool carries(at::ScalarType s);
  // Whether MPI reduces t by op: a CPU tensor of a dtype it carries; SUM, AVG, MIN, MAX,
  // PRODUCT, PREMUL_SUM (floats), BAND/BOR/BXOR (integers). Alike on every rank.
  bool all_reduces(const at::Tensor& t, const c10d::ReduceOp& op) const;
  bool moves(const at::Tensor& t) const;  // a CPU tensor (any dtype, as bytes)

  void all_reduce(at::Tensor& t, const c10d::ReduceOp& op, int64_t size);
  // in and out contiguous (the hierarchy's cross stage): out = this rank's block of the sum
  // (or max) over the group of in.
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, bool by_max);
  void all_gather(const at::Tensor& in, at::Tensor& out);  // out: every rank's in, in order
  void broadcast(at::Tensor& t, int64_t root);
  // rows of in's first dimension to each rank, rows of out's from each.
  void all_to_all(const at::Tensor& in, at::Tensor& out, const std::vector<int64_t>& send,
                  const std::vector<int64_t>& recv);

  // The group's shutdown (collective, in order): the MPI communicator freed. Alone (abort):
  // dropped. Later calls take the other paths.
  void close(bool collective);

 private:
  // calls_.<method>(t, *rest) (rest: a new reference to a tuple, consumed; GIL not held).
  void call(const char* method, const at::Tensor& t, PyObject* rest);

  PyObject* calls_;
  std::mutex mu_;  // one MPI call of the group at a time, in the order issued
};

}  // namespace fastpar

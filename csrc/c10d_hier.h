#pragma once
// The fastpar backend's hierarchical path for a group that spans hosts with as many of its ranks
// on each (2 or more): all_reduce, all_gather_into_tensor and reduce_scatter_tensor through each
// host's shm kernels and across the hosts on a gloo among the ranks of one local index, the
// three stages of fastpar.comm's hierarchical engine (fastpar/comm/engines/hierarchical.py).
// Set up by fastpar/backend/create.py (_host_split).
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "c10d_mpi.h"

namespace fastpar {

// A spanning group's host sub-groups: `cross`, the gloo among the ranks of this rank's local
// index (its rank: the host's index); `maker`, which makes this host's shm communicator
// (collective over the host's ranks; as the group's own maker in c10d_backend.h); `place[g]`:
// where group rank g's block lands when the hosts' blocks are gathered, local index j of host h
// at j * hosts + h. Empty (no cross): the group has no hierarchy.
// In a job launched by MPI, `cross_mpi` (an MpiCalls of the same ranks as `cross`) carries the
// cross-host stage of the dtypes MPI reduces below `cross_mpi_max_bytes`, and calls of those
// dtypes take the hierarchy from `mpi_min_bytes` (below, MPI's flat call is faster).
struct Hier {
  c10::intrusive_ptr<c10d::Backend> cross;
  PyObject* maker = nullptr;
  int64_t local_size = 0;  // ranks per host
  int64_t min_bytes = 0;   // smaller calls take a flat call whole
  std::vector<int64_t> place;
  PyObject* cross_mpi = nullptr;
  int64_t mpi_min_bytes = 0;
  int64_t cross_mpi_max_bytes = 0;
};

class HierPath {
 public:
  HierPath(const Hier& hier, int64_t size);
  ~HierPath();

  // Whether a call takes the hierarchy: CPU tensors, from min_bytes, and for reductions the
  // kernels' (backend_ops::reduces); alike on every rank (never strides or addresses).
  bool all_reduces(const at::Tensor& t, const c10d::ReduceOp& op) const;
  bool all_gathers(const at::Tensor& in, const at::Tensor& out) const;
  bool reduce_scatters(const at::Tensor& in, const at::Tensor& out,
                       const c10d::ReduceOp& op) const;

  void all_reduce(at::Tensor& t, const c10d::ReduceOp& op);
  // out (size * in's elements) = every group rank's in, in group order; in may lie in out.
  void all_gather(const at::Tensor& in, at::Tensor& out);
  // out = this rank's block of op over the group of in (size blocks); in is left as it was.
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, const c10d::ReduceOp& op);

  void setTimeout(std::chrono::milliseconds timeout);
  void abort();
  void shutdown();
  // Stop using the host's shm communicator and let its owner close it (after a call in flight).
  void release();

 private:
  bool on() const { return hier_.cross && hier_.maker != nullptr; }
  int64_t least(at::ScalarType s) const;  // the smallest call of dtype s the hierarchy takes
  bool mpi_across(at::ScalarType s, int64_t nbytes) const;  // the cross stage on MPI?
  int64_t intra();  // the host's shm communicator, made at the first call (busy_ held)

  Hier hier_;
  int64_t size_, hosts_;
  at::Tensor place_, order_;  // place_[g] as above; order_[place_[g]] = g
  int64_t intra_ = 0;
  PyObject* intra_owner_ = nullptr;
  MpiPath cross_mpi_;   // the cross stage's MPI calls (off: gloo carries it)
  std::string failed_;  // why the host's shm set-up failed (empty: none did)
  std::mutex busy_;     // one shm call at a time: ranks must agree on the order
};

}  // namespace fastpar

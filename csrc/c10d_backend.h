#pragma once
// The torch.distributed backend "fastpar" (fastpar/backend/): a c10d::Backend that runs each
// operation on fastpar's shared-memory kernels where they serve it (a group within one host;
// CPU tensors) and hands everything else to a backend made beside it on the same store (gloo
// for CPU tensors, NCCL for CUDA ones). Built and owned from Python (fastpar/backend/create.py).
#include <Python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "c10d_hier.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace fastpar {

// rank/size: this rank in the group and the group's size. cpu: the CPU fallback (gloo), cuda:
// the CUDA one (NCCL; none on a CPU build). maker: a Python callable, collective over the group,
// returning (the group's shm communicator handle (csrc/shm_ops.h), the object owning its
// segment, whose close() detaches it), called at the first call the kernels serve; null where
// the group spans hosts or has one rank. timeout_s: the group's timeout. hier: a spanning
// group's hierarchy (csrc/c10d_hier.h; empty: none). ipc_maker: the CUDA IPC all-reduce's
// (csrc/c10d_ipc.h; null: none). mpi_calls: a spanning group's MPI calls, for the flat calls
// the hierarchy does not take (csrc/c10d_mpi.h; null: none).
c10::intrusive_ptr<c10d::Backend> make_backend(int64_t rank, int64_t size,
                                               c10::intrusive_ptr<c10d::Backend> cpu,
                                               std::optional<c10::intrusive_ptr<c10d::Backend>> cuda,
                                               PyObject* maker, double timeout_s,
                                               const Hier& hier, PyObject* ipc_maker,
                                               PyObject* mpi_calls);

// While set (in this thread), every backend passes every call to its fallback: fastpar.comm's
// own gloo calls on a fastpar group stay gloo's. Returns the previous setting.
bool set_fallback_only(bool on);

// What served each operation of a fastpar backend so far: {"allreduce": {"shm": n, ...}, ...};
// empty for another backend.
std::map<std::string, std::map<std::string, int64_t>> backend_served(
    const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace fastpar

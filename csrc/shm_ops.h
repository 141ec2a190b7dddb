#pragma once
// Torch glue of the shared-memory collectives: tensors in, checks, then the pure kernel
// (csrc/shm/shm_collectives.h). The segment itself is mapped and owned by the Python policy
// class (fastpar/comm/engines/shm.py); these functions only receive its address.
#include <ATen/core/Tensor.h>

#include <exception>
#include <optional>
#include <string>
#include <tuple>

namespace fastpar {
namespace shm {
struct Comm;
}

int64_t shm_segment_bytes(int64_t world, int64_t slot_bytes);
void shm_init_segment(int64_t base, int64_t world, int64_t slot_bytes);
// Returns a handle to a per-rank communicator over the segment at `base`.
int64_t shm_attach(int64_t base, int64_t rank, int64_t world, int64_t slot_bytes,
                   double timeout_s, bool oversubscribed);
void shm_detach(int64_t comm);
void shm_all_reduce(int64_t comm, at::Tensor& t, const std::string& op);
// t is this rank's part of a symmetric segment; slots[p] the address of rank p's same part in
// this process, sig what it is (fastpar/comm/symmetric.py; compared across ranks).
void shm_all_reduce_symmetric(int64_t comm, at::Tensor& t, at::IntArrayRef slots,
                              const std::string& op, int64_t sig);
// out: this rank's symmetric buffer of world blocks, its own block filled; slots as above.
void shm_all_gather_symmetric(int64_t comm, at::Tensor& out, at::IntArrayRef slots, int64_t sig);
// in: this rank's source in a symmetric segment (slots: every rank's); out: world x in, plain.
void shm_all_gather_from_symmetric(int64_t comm, const at::Tensor& in, at::IntArrayRef slots,
                                   at::Tensor& out, int64_t sig);
// in: this rank's symmetric buffer of world equal blocks; out: a plain tensor of in's bytes.
void shm_all_to_all_symmetric(int64_t comm, const at::Tensor& in, at::IntArrayRef slots,
                              at::Tensor& out, int64_t sig);
// in: this rank's symmetric buffer of world blocks; out may be in's block of this rank.
void shm_reduce_scatter_symmetric(int64_t comm, const at::Tensor& in, at::IntArrayRef slots,
                                  at::Tensor& out, const std::string& op, int64_t sig);
// sig: the caller's dtype/shape signature, compared across ranks (fastpar/comm/engines/shm.py).
void shm_all_gather(int64_t comm, const at::Tensor& in, at::Tensor& out, int64_t sig);
void shm_reduce_scatter(int64_t comm, const at::Tensor& in, at::Tensor& out,
                        const std::string& op);
void shm_broadcast(int64_t comm, at::Tensor& t, int64_t root, int64_t sig);
// int8 (fastpar/comm/quant.py's codec, blocks of `block`): float32 or bfloat16 tensors;
// residual: float32 of the input's element count, updated in place (error feedback).
void shm_quantized_all_gather(int64_t comm, const at::Tensor& in, at::Tensor& out, int64_t block);
void shm_quantized_reduce_scatter(int64_t comm, const at::Tensor& in, at::Tensor& out,
                                  int64_t block, const std::optional<at::Tensor>& residual);
void shm_quantized_all_reduce(int64_t comm, at::Tensor& t, int64_t block,
                              const std::optional<at::Tensor>& residual);
// The communicator behind a handle, for glue in other files (shm_alltoall_ops.cpp).
shm::Comm& shm_comm(int64_t comm);

// Error kinds (csrc/shm/shm_errors.h), so that Python tells a timeout from an interrupt by a
// code, not by the message's text. Each op's kernel call records what it threw (or nothing)
// in this thread: shm_record_error, called by the ops' error translation. shm_last_error
// returns (kind, cause) of the last error recorded in this thread and clears it: read it right
// after catching the RuntimeError (fastpar/comm/engines/native_errors.py).
void shm_record_error(const std::exception* e);
std::tuple<int64_t, int64_t> shm_last_error();

// The poll hook of the shm kernels' waits (also used by shm_p2p_ops.cpp): "was interrupted
// (SIGINT)" once Ctrl-C has arrived, else null. Takes the GIL itself.
const char* shm_poll_sigint();

}  // namespace fastpar

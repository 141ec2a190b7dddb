#pragma once
// Torch glue of the shared-memory point-to-point channels: tensors in, checks, then the pure
// kernel (csrc/shm/shm_p2p.h). The pair segments are mapped and owned by the Python policy class
// (fastpar/comm/shm_p2p.py); these functions only receive their addresses. Handles are ints.
#include <ATen/core/Tensor.h>

#include <vector>

namespace fastpar {

int64_t shm_p2p_segment_bytes(int64_t tags, int64_t ring_bytes);
void shm_p2p_init_segment(int64_t base, int64_t rank_lo, int64_t rank_hi, int64_t tags,
                          int64_t ring_bytes);
// An endpoint of `rank` over one segment per peer (bases[i] is the pair {rank, peers[i]}; slot
// i); `oversubscribed`: this host's ranks outnumber their CPUs (sets the spin budget).
int64_t shm_p2p_open(int64_t rank, bool oversubscribed, std::vector<int64_t> peers,
                     std::vector<int64_t> bases, int64_t tags, int64_t ring_bytes,
                     double timeout_s);
void shm_p2p_close(int64_t ep);
// header: 1-D int64 CPU tensor; parts: contiguous CPU tensors, sent as their bytes. The parts
// must stay alive and unchanged until the send completes. Returns the send id.
int64_t shm_p2p_send(int64_t ep, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts);
void shm_p2p_progress(int64_t ep);
at::Tensor shm_p2p_recv_header(int64_t ep, int64_t slot, int64_t tag);
void shm_p2p_recv_payload(int64_t ep, int64_t slot, int64_t tag, at::TensorList parts);
bool shm_p2p_send_done(int64_t ep, int64_t id);
void shm_p2p_wait_send(int64_t ep, int64_t id);
void shm_p2p_flush(int64_t ep);
int64_t shm_p2p_pending(int64_t ep);

}  // namespace fastpar

#pragma once
// Torch glue of the shared-memory point-to-point channels: tensors in, checks, then the pure
// kernel (csrc/shm/shm_p2p.h). The pair segments are mapped and owned by the Python communicator
// (fastpar/comm/transport/shm_rings.py); these functions only receive their addresses. Handles
// are ints.
#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace fastpar {

int64_t shm_p2p_segment_bytes(int64_t tags, int64_t ring_bytes);
void shm_p2p_init_segment(int64_t base, int64_t rank_lo, int64_t rank_hi, int64_t tags,
                          int64_t ring_bytes);
// An endpoint of `rank` over one segment per peer (bases[i] is the pair {rank, peers[i]}; slot
// i); `oversubscribed`: this host's ranks outnumber their CPUs (sets the spin budget);
// payloads of at least `single_copy_min` bytes (negative: none) go single-copy where the pair
// allows it (after shm_p2p_probe).
int64_t shm_p2p_open(int64_t rank, bool oversubscribed, std::vector<int64_t> peers,
                     std::vector<int64_t> bases, int64_t tags, int64_t ring_bytes,
                     double timeout_s, int64_t single_copy_min);
void shm_p2p_close(int64_t ep);
// Probes, for every peer, whether this process can read the peer's memory and publishes it;
// call once every peer is attached.
void shm_p2p_probe(int64_t ep);
// Whether this rank's large payloads to the peer of `slot` go single-copy (the peer's verdict).
bool shm_p2p_single_copy(int64_t ep, int64_t slot);
// header: contiguous 1-D int64 CPU tensor; parts: contiguous CPU tensors, sent as their bytes.
// The parts must stay alive and unchanged until the send completes. Returns the send id, or 0
// when the send completed at once (nothing to wait for).
int64_t shm_p2p_send(int64_t ep, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts);
void shm_p2p_progress(int64_t ep);
at::Tensor shm_p2p_recv_header(int64_t ep, int64_t slot, int64_t tag);
void shm_p2p_recv_payload(int64_t ep, int64_t slot, int64_t tag, at::TensorList parts);
// The next message's header into `header` (contiguous 1-D int64, long enough), and its payload
// into `parts` if their bytes add up to it. Returns the header's length n in int64 words when
// the payload was taken too (or is empty), -1 - n when it waits for shm_p2p_recv_payload.
int64_t shm_p2p_recv(int64_t ep, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts);
// shm_p2p_send, then shm_p2p_recv, then, if the payload was taken, the wait for the send: one
// call for a rank that sends and receives at once (MPI_Sendrecv). Returns (the send id, 0 once
// complete; the receive's header length as shm_p2p_recv returns it).
std::tuple<int64_t, int64_t> shm_p2p_sendrecv(int64_t ep, int64_t send_slot, int64_t send_tag,
                                              const at::Tensor& header, at::TensorList parts,
                                              int64_t recv_slot, int64_t recv_tag,
                                              const at::Tensor& recv_header,
                                              at::TensorList recv_parts);
// The same bound once (MPI_Send_init + MPI_Recv_init): the plan keeps the tensors, each start
// sends their current bytes and receives into the bound buffers, with no tensor arguments to
// convert (about 1 us of dispatch instead of 3.5). Freed by shm_p2p_sendrecv_free or close.
int64_t shm_p2p_sendrecv_init(int64_t ep, int64_t send_slot, int64_t send_tag,
                              const at::Tensor& header, at::TensorList parts, int64_t recv_slot,
                              int64_t recv_tag, const at::Tensor& recv_header,
                              at::TensorList recv_parts);
std::tuple<int64_t, int64_t> shm_p2p_sendrecv_start(int64_t ep, int64_t plan);
void shm_p2p_sendrecv_free(int64_t ep, int64_t plan);
// Send id 0 (completed at once) is always complete.
bool shm_p2p_send_done(int64_t ep, int64_t id);
void shm_p2p_wait_send(int64_t ep, int64_t id);
void shm_p2p_flush(int64_t ep);
// After pushing what fits (never blocks): (sends with bytes not yet in their ring, which only
// this rank's later calls push; single-copy sends in their ring that the peer has not read yet).
std::tuple<int64_t, int64_t> shm_p2p_pending(int64_t ep);

}  // namespace fastpar

// The one bindings file: op schemas of every native op (`Tensor(a!)` marks a mutated argument)
// and the Python module `fastpar._C`. Kernels and torch glue live in their own files.
#include <Python.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "build_info.h"
#include "c10d_backend.h"
#include "qlinear_ops.h"
#include "quant_ops.h"
#include "shm_alltoall_ops.h"
#include "shm_ops.h"
#include "shm_p2p_ops.h"
#include "watchdog.h"
#ifdef FASTPAR_WITH_CUDA
#include "cuda/ipc_allreduce.h"
#endif

TORCH_LIBRARY(fastpar, m) {
  m.def("build_info() -> str", [] { return fastpar::build_info(); });
  m.def("watchdog_arm(float seconds, str message, int exit_code, str unlink_prefix=\"\") -> int",
        [](double s, std::string msg, int64_t code, std::string prefix) {
          return fastpar::watchdog_arm(s, msg, code, prefix);
        });
  m.def("watchdog_disarm(int id) -> bool", &fastpar::watchdog_disarm);

  // Shared-memory collectives (CPU). The segment at `base` is owned by fastpar/comm/engines/shm.py.
  m.def("shm_segment_bytes(int world, int slot_bytes) -> int", &fastpar::shm_segment_bytes);
  m.def("shm_init_segment(int base, int world, int slot_bytes) -> ()", &fastpar::shm_init_segment);
  m.def("shm_attach(int base, int rank, int world, int slot_bytes, float timeout_s, "
        "bool oversubscribed) -> int",
        &fastpar::shm_attach);
  m.def("shm_detach(int comm) -> ()", &fastpar::shm_detach);
  // (kind, cause) of this thread's last shm error (collectives and p2p), as the codes of
  // csrc/shm/shm_errors.h; reading clears it.
  m.def("shm_last_error() -> (int, int)", &fastpar::shm_last_error);
  m.def("shm_all_reduce(int comm, Tensor(a!) t, str op) -> ()", &fastpar::shm_all_reduce);
  m.def("shm_all_reduce_symmetric(int comm, Tensor(a!) t, int[] slots, str op, int sig) "
        "-> ()",
        &fastpar::shm_all_reduce_symmetric);
  m.def("shm_all_gather_symmetric(int comm, Tensor(a!) out, int[] slots, int sig) -> ()",
        &fastpar::shm_all_gather_symmetric);
  m.def("shm_all_gather_from_symmetric(int comm, Tensor inp, int[] slots, Tensor(a!) out, "
        "int sig) -> ()", &fastpar::shm_all_gather_from_symmetric);
  m.def("shm_all_to_all_symmetric(int comm, Tensor inp, int[] slots, Tensor(a!) out, int sig) "
        "-> ()", &fastpar::shm_all_to_all_symmetric);
  m.def("shm_reduce_scatter_symmetric(int comm, Tensor inp, int[] slots, Tensor(a!) out, "
        "str op, int sig) -> ()", &fastpar::shm_reduce_scatter_symmetric);
  m.def("shm_all_gather(int comm, Tensor inp, Tensor(a!) out, int sig) -> ()",
        &fastpar::shm_all_gather);
  m.def("shm_reduce_scatter(int comm, Tensor inp, Tensor(a!) out, str op) -> ()",
        &fastpar::shm_reduce_scatter);
  m.def("shm_broadcast(int comm, Tensor(a!) t, int root, int sig) -> ()",
        &fastpar::shm_broadcast);
  // int8 (quant="int8"): the codec in the kernels' copy loops; residual: error feedback.
  m.def("shm_quantized_all_gather(int comm, Tensor inp, Tensor(a!) out, int block) -> ()",
        &fastpar::shm_quantized_all_gather);
  m.def("shm_quantized_reduce_scatter(int comm, Tensor inp, Tensor(a!) out, int block, "
        "Tensor(b!)? residual) -> ()", &fastpar::shm_quantized_reduce_scatter);
  m.def("shm_quantized_all_reduce(int comm, Tensor(a!) t, int block, Tensor(b!)? residual) -> ()",
        &fastpar::shm_quantized_all_reduce);
  // The same codec on CPU tensors in quant.py's wire format (the byte-moving engines' path).
  m.def("quant_pack_rows(Tensor x, int block, Tensor(a!) out, Tensor(b!)? residual, "
        "str feedback) -> ()", &fastpar::quant_pack_rows);
  m.def("quant_unpack_rows(Tensor buf, int m, int block, Tensor(a!) out) -> ()",
        &fastpar::quant_unpack_rows);
  m.def("quant_sum_packed_rows(Tensor buf, int m, int block, Tensor(a!) out) -> ()",
        &fastpar::quant_sum_packed_rows);
  // Weight-only quantized linear (CPU): fastpar/nn/qweight.py's decode-sized GEMM.
  m.def("qlinear(Tensor x, Tensor q, Tensor scales, Tensor? offsets, int bits, int group, "
        "int lead, Tensor(a!) out) -> ()", &fastpar::qlinear);
  m.def("shm_all_to_all(int comm, Tensor inp, int[] send_counts, int[]? recv_counts, int sig, "
        "Tensor(a!)? out=None) -> (Tensor, int[])", &fastpar::shm_all_to_all);

  // Shared-memory point-to-point channels (CPU). Pair segments owned by
  // fastpar/comm/transport/shm_rings.py.
  m.def("shm_p2p_segment_bytes(int tags, int ring_bytes) -> int", &fastpar::shm_p2p_segment_bytes);
  m.def("shm_p2p_init_segment(int base, int rank_lo, int rank_hi, int tags, int ring_bytes) -> ()",
        &fastpar::shm_p2p_init_segment);
  // single_copy_min: the kernel's kDefaultSingleCopyMin (64 KiB); negative: never single-copy.
  m.def("shm_p2p_open(int rank, bool oversubscribed, int[] peers, int[] bases, int tags, "
        "int ring_bytes, float timeout_s, int single_copy_min=65536) -> int",
        &fastpar::shm_p2p_open);
  m.def("shm_p2p_close(int ep) -> ()", &fastpar::shm_p2p_close);
  m.def("shm_p2p_probe(int ep) -> ()", &fastpar::shm_p2p_probe);
  m.def("shm_p2p_single_copy(int ep, int slot) -> bool", &fastpar::shm_p2p_single_copy);
  m.def("shm_p2p_send(int ep, int slot, int tag, Tensor header, Tensor[] parts) -> int",
        &fastpar::shm_p2p_send);
  m.def("shm_p2p_progress(int ep) -> ()", &fastpar::shm_p2p_progress);
  m.def("shm_p2p_recv_header(int ep, int slot, int tag) -> Tensor", &fastpar::shm_p2p_recv_header);
  m.def("shm_p2p_recv_payload(int ep, int slot, int tag, Tensor(a!)[] parts) -> ()",
        &fastpar::shm_p2p_recv_payload);
  m.def("shm_p2p_recv(int ep, int slot, int tag, Tensor(a!) header, Tensor(a!)[] parts) -> int",
        &fastpar::shm_p2p_recv);
  m.def("shm_p2p_sendrecv(int ep, int send_slot, int send_tag, Tensor header, Tensor[] parts, "
        "int recv_slot, int recv_tag, Tensor(a!) recv_header, Tensor(a!)[] recv_parts) "
        "-> (int, int)", &fastpar::shm_p2p_sendrecv);
  m.def("shm_p2p_sendrecv_init(int ep, int send_slot, int send_tag, Tensor header, "
        "Tensor[] parts, int recv_slot, int recv_tag, Tensor(a!) recv_header, "
        "Tensor(a!)[] recv_parts) -> int", &fastpar::shm_p2p_sendrecv_init);
  m.def("shm_p2p_sendrecv_start(int ep, int plan) -> (int, int)",
        &fastpar::shm_p2p_sendrecv_start);
  m.def("shm_p2p_sendrecv_free(int ep, int plan) -> ()", &fastpar::shm_p2p_sendrecv_free);
  m.def("shm_p2p_send_done(int ep, int id) -> bool", &fastpar::shm_p2p_send_done);
  m.def("shm_p2p_wait_send(int ep, int id) -> ()", &fastpar::shm_p2p_wait_send);
  m.def("shm_p2p_flush(int ep) -> ()", &fastpar::shm_p2p_flush);
  m.def("shm_p2p_pending(int ep) -> (int, int)", &fastpar::shm_p2p_pending);

#ifdef FASTPAR_WITH_CUDA
  // CUDA IPC all-reduce. Buffers and handles are owned by fastpar/comm/engines/cuda_ipc.py.
  namespace ipc = fastpar::ipc;
  m.def("ipc_meta_size() -> int", &ipc::ipc_meta_size);
  m.def("ipc_init(int[] signal_ptrs, int[] buffer_ptrs, int rank, int world, int buffer_bytes, "
        "int[] global_ranks, float timeout_s, int device) -> int", &ipc::ipc_init);
  m.def("ipc_set_timeout(int ctx, float timeout_s) -> ()", &ipc::ipc_set_timeout);
  m.def("ipc_all_reduce(int ctx, Tensor(a!) inp_out, int algo) -> ()", &ipc::ipc_all_reduce);
  m.def("ipc_all_reduce_symmetric(int ctx, Tensor(a!) t, int[] buffers) -> ()",
        &ipc::ipc_all_reduce_symmetric);
  m.def("ipc_error(int ctx) -> str", &ipc::ipc_error);
  m.def("ipc_staging(int ctx, ScalarType dtype, int numel) -> Tensor", &ipc::ipc_staging);
  m.def("ipc_wait_idle(int ctx) -> ()", &ipc::ipc_wait_idle);
  m.def("ipc_all_reduce_flagged(int ctx, Tensor(a!) out, Tensor flags, int block_rows, "
        "int expected) -> ()", &ipc::ipc_all_reduce_flagged);
  m.def("ipc_dispose(int ctx) -> ()", &ipc::ipc_dispose);
  m.def("ipc_alloc(int bytes, int device) -> int", &ipc::ipc_alloc);
  m.def("ipc_free(int ptr, int device) -> ()", &ipc::ipc_free);
  m.def("ipc_export(int ptr, int device) -> Tensor", &ipc::ipc_export);
  m.def("ipc_get_handle(Tensor buf) -> (Tensor, int)", &ipc::ipc_get_handle);
  m.def("ipc_open_handle(Tensor handle, int device) -> int", &ipc::ipc_open_handle);
  m.def("ipc_close_handle(int base_ptr, int device) -> ()", &ipc::ipc_close_handle);
  m.def("ipc_p2p_link(int a, int b) -> (bool, bool)", &ipc::ipc_p2p_link);
#endif
}

// Importing fastpar._C loads this library, which registers the ops above as torch.ops.fastpar.*;
// the module itself holds what torch ops cannot carry: the torch.distributed backend.
PYBIND11_MODULE(_C, m) {
  m.def(
      "make_backend",
      [](int64_t rank, int64_t size, c10::intrusive_ptr<c10d::Backend> cpu,
         std::optional<c10::intrusive_ptr<c10d::Backend>> cuda, py::object maker,
         double timeout_s, std::optional<c10::intrusive_ptr<c10d::Backend>> cross,
         py::object intra_maker, int64_t local_size, int64_t hier_min_bytes,
         py::object ipc_maker, std::vector<int64_t> hier_place, py::object mpi_calls,
         py::object cross_mpi, int64_t mpi_min_bytes, int64_t cross_mpi_max_bytes) {
        fastpar::Hier hier;
        if (cross && !intra_maker.is_none()) {
          hier.cross = *cross;
          hier.maker = intra_maker.ptr();
          hier.local_size = local_size;
          hier.min_bytes = hier_min_bytes;
          hier.place = std::move(hier_place);
          hier.cross_mpi = cross_mpi.is_none() ? nullptr : cross_mpi.ptr();
          hier.mpi_min_bytes = mpi_min_bytes;
          hier.cross_mpi_max_bytes = cross_mpi_max_bytes;
        }
        return fastpar::make_backend(rank, size, std::move(cpu), std::move(cuda),
                                     maker.is_none() ? nullptr : maker.ptr(), timeout_s, hier,
                                     ipc_maker.is_none() ? nullptr : ipc_maker.ptr(),
                                     mpi_calls.is_none() ? nullptr : mpi_calls.ptr());
      },
      py::arg("rank"), py::arg("size"), py::arg("cpu"), py::arg("cuda"), py::arg("maker"),
      py::arg("timeout_s"), py::arg("cross") = py::none(), py::arg("intra_maker") = py::none(),
      py::arg("local_size") = 0, py::arg("hier_min_bytes") = 0,
      py::arg("ipc_maker") = py::none(), py::arg("hier_place") = std::vector<int64_t>{},
      py::arg("mpi_calls") = py::none(), py::arg("cross_mpi") = py::none(),
      py::arg("mpi_min_bytes") = 0, py::arg("cross_mpi_max_bytes") = 0);
  m.def("backend_served", &fastpar::backend_served, py::arg("backend"));
  m.def("backend_fallback_only", &fastpar::set_fallback_only, py::arg("on"));
}

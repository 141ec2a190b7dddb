// Torch glue of the shared-memory collectives; see shm_ops.h.
#include <Python.h>  // first, as Python requires

#include "shm_ops.h"

#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "shm/shm_collectives.h"

namespace fastpar {
namespace {

namespace shm = fastpar::shm;

std::mutex comms_mu;
std::map<int64_t, std::unique_ptr<shm::Comm>> comms;
int64_t next_comm = 1;

shm::Comm& get(int64_t handle) {
  std::lock_guard<std::mutex> lock(comms_mu);
  auto it = comms.find(handle);
  TORCH_CHECK(it != comms.end(), "fastpar shm: communicator ", handle,
              " does not exist (already detached?)");
  return *it->second;
}

shm::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return shm::DType::F32;
    case at::kDouble: return shm::DType::F64;
    case at::kBFloat16: return shm::DType::BF16;
    case at::kHalf: return shm::DType::F16;
    default:
      TORCH_CHECK(false, "fastpar shm reduces float32, float64, bfloat16 and float16, not ",
                  t.scalar_type());
  }
}

shm::Op op_of(const std::string& op) {
  if (op == "sum") return shm::Op::Sum;
  if (op == "max") return shm::Op::Max;
  TORCH_CHECK(false, "fastpar shm reduces with 'sum' or 'max', not '", op, "'");
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fastpar shm: ", what, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "fastpar shm: ", what, " must be contiguous");
}

// The kernel reports mismatches and timeouts as shm::Error (std::runtime_error); re-raise as
// c10::Error so Python sees a RuntimeError with the kernel's message, its kind recorded.
template <typename F>
void run(F&& f) {
  shm_record_error(nullptr);
  try {
    f();
  } catch (const std::runtime_error& e) {
    shm_record_error(&e);
    TORCH_CHECK(false, e.what());
  }
}

// What the last kernel call of this thread threw (shm_last_error).
thread_local shm::ErrorKind last_kind = shm::ErrorKind::None;
thread_local shm::ErrorKind last_cause = shm::ErrorKind::None;

}  // namespace

void shm_record_error(const std::exception* e) {
  const auto* typed = dynamic_cast<const shm::Error*>(e);
  last_kind = e == nullptr ? shm::ErrorKind::None
              : typed != nullptr ? typed->kind()
                                 : shm::ErrorKind::Other;
  last_cause = typed != nullptr ? typed->cause() : last_kind;
}

std::tuple<int64_t, int64_t> shm_last_error() {
  std::tuple<int64_t, int64_t> out{int64_t(last_kind), int64_t(last_cause)};
  shm_record_error(nullptr);
  return out;
}

// The kernel's poll hook: ends a long wait when SIGINT (Ctrl-C) has arrived, within ~10 ms
// instead of after the timeout. No Python handler runs here (this is inside a collective):
// PyOS_InterruptOccurred only takes the pending SIGINT (main thread only), the kernel
// poisons the segment and throws, and fastpar/comm/engines/shm.py, once out of the call, raises
// SIGINT again so that the program's own handler runs (by default: KeyboardInterrupt).
const char* shm_poll_sigint() {
  if (!Py_IsInitialized()) return nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  const bool interrupted = PyOS_InterruptOccurred() != 0;
  PyGILState_Release(gil);
  return interrupted ? "was interrupted (SIGINT)" : nullptr;
}

int64_t shm_segment_bytes(int64_t world, int64_t slot_bytes) {
  return static_cast<int64_t>(shm::segment_bytes(static_cast<int>(world), slot_bytes));
}

void shm_init_segment(int64_t base, int64_t world, int64_t slot_bytes) {
  run([&] { shm::init_segment(reinterpret_cast<void*>(base), static_cast<int>(world), slot_bytes); });
}

int64_t shm_attach(int64_t base, int64_t rank, int64_t world, int64_t slot_bytes,
                   double timeout_s, bool oversubscribed) {
  auto comm = std::make_unique<shm::Comm>();
  run([&] {
    *comm = shm::attach(reinterpret_cast<void*>(base), static_cast<int>(rank),
                        static_cast<int>(world), slot_bytes);
  });
  shm::set_oversubscribed(*comm, oversubscribed);
  comm->timeout_s = timeout_s;
  comm->poll = &shm_poll_sigint;
  std::lock_guard<std::mutex> lock(comms_mu);
  comms[next_comm] = std::move(comm);
  return next_comm++;
}

shm::Comm& shm_comm(int64_t handle) { return get(handle); }

void shm_detach(int64_t handle) {
  std::lock_guard<std::mutex> lock(comms_mu);
  comms.erase(handle);
}

void shm_all_reduce(int64_t handle, at::Tensor& t, const std::string& op) {
  check_cpu(t, "tensor");
  auto& c = get(handle);
  auto dt = dtype_of(t);
  auto o = op_of(op);
  run([&] { shm::all_reduce(c, t.data_ptr(), t.numel(), dt, o); });
}

namespace {

// slots[p]: rank p's symmetric buffer in this process; `own` must be this rank's.
void symmetric_slots(const shm::Comm& c, at::IntArrayRef slots, const at::Tensor& own,
                     const char* what, void** ptrs) {
  TORCH_CHECK(int64_t(slots.size()) == c.world, "fastpar shm ", what, " (symmetric): ",
              slots.size(), " slot addresses for a group of ", c.world);
  TORCH_CHECK(slots[c.rank] == reinterpret_cast<int64_t>(own.data_ptr()), "fastpar shm ", what,
              " (symmetric): the tensor is not this rank's slot");
  for (int r = 0; r < c.world; ++r) ptrs[r] = reinterpret_cast<void*>(slots[r]);
}

}  // namespace

void shm_all_reduce_symmetric(int64_t handle, at::Tensor& t, at::IntArrayRef slots,
                              const std::string& op, int64_t sig) {
  check_cpu(t, "tensor");
  auto& c = get(handle);
  void* ptrs[64];
  symmetric_slots(c, slots, t, "all_reduce", ptrs);
  auto dt = dtype_of(t);
  auto o = op_of(op);
  run([&] { shm::all_reduce_symmetric(c, ptrs, t.numel(), dt, o, uint64_t(sig)); });
}

void shm_all_gather_symmetric(int64_t handle, at::Tensor& out, at::IntArrayRef slots,
                              int64_t sig) {
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(out.nbytes() % c.world == 0, "fastpar shm all_gather (symmetric): ",
              out.nbytes(), " bytes do not split into ", c.world, " parts");
  void* ptrs[64];
  symmetric_slots(c, slots, out, "all_gather", ptrs);
  run([&] { shm::all_gather_symmetric(c, ptrs, out.nbytes() / c.world, uint64_t(sig)); });
}

void shm_all_gather_from_symmetric(int64_t handle, const at::Tensor& in, at::IntArrayRef slots,
                                   at::Tensor& out, int64_t sig) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(out.nbytes() == in.nbytes() * c.world && out.is_contiguous(),
              "fastpar shm all_gather (from symmetric): input of ", in.nbytes(), " bytes for ",
              c.world, " ranks, contiguous output of ", out.nbytes());
  void* ptrs[64];
  symmetric_slots(c, slots, in, "all_gather (from symmetric)", ptrs);
  void* to = out.data_ptr();
  run([&] { shm::all_gather_from_symmetric(c, ptrs, to, in.nbytes(), uint64_t(sig)); });
}

void shm_all_to_all_symmetric(int64_t handle, const at::Tensor& in, at::IntArrayRef slots,
                              at::Tensor& out, int64_t sig) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.nbytes() % c.world == 0 && out.nbytes() == in.nbytes() && out.is_contiguous(),
              "fastpar shm all_to_all (symmetric): input of ", in.nbytes(), " bytes for ",
              c.world, " ranks, contiguous output of ", out.nbytes());
  void* ptrs[64];
  symmetric_slots(c, slots, in, "all_to_all", ptrs);
  void* to = out.data_ptr();
  run([&] { shm::all_to_all_symmetric(c, ptrs, to, in.nbytes() / c.world, uint64_t(sig)); });
}

void shm_reduce_scatter_symmetric(int64_t handle, const at::Tensor& in, at::IntArrayRef slots,
                                  at::Tensor& out, const std::string& op, int64_t sig) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "fastpar shm reduce_scatter (symmetric): "
              "input is ", in.scalar_type(), " but output is ", out.scalar_type());
  TORCH_CHECK(in.numel() == out.numel() * c.world, "fastpar shm reduce_scatter (symmetric): "
              "input holds ", in.numel(), " elements, expected ", c.world, " x ", out.numel());
  void* ptrs[64];
  symmetric_slots(c, slots, in, "reduce_scatter", ptrs);
  auto dt = dtype_of(in);
  auto o = op_of(op);
  run([&] { shm::reduce_scatter_symmetric(c, ptrs, out.data_ptr(), out.numel(), dt, o,
                                            uint64_t(sig)); });
}

void shm_all_gather(int64_t handle, const at::Tensor& in, at::Tensor& out, int64_t sig) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "fastpar shm all_gather: input is ",
              in.scalar_type(), " but output is ", out.scalar_type());
  TORCH_CHECK(out.numel() == in.numel() * c.world, "fastpar shm all_gather: output holds ",
              out.numel(), " elements, expected ", c.world, " x ", in.numel());
  run([&] { shm::all_gather(c, in.data_ptr(), out.data_ptr(), in.nbytes(), uint64_t(sig)); });
}

void shm_reduce_scatter(int64_t handle, const at::Tensor& in, at::Tensor& out,
                        const std::string& op) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "fastpar shm reduce_scatter: input is ",
              in.scalar_type(), " but output is ", out.scalar_type());
  TORCH_CHECK(in.numel() == out.numel() * c.world, "fastpar shm reduce_scatter: input holds ",
              in.numel(), " elements, expected ", c.world, " x ", out.numel());
  auto dt = dtype_of(in);
  auto o = op_of(op);
  run([&] { shm::reduce_scatter(c, in.data_ptr(), out.data_ptr(), out.numel(), dt, o); });
}

namespace {

shm::DType quant_dtype_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "fastpar shm ", what, " (int8) quantizes float32 and bfloat16, not ",
              t.scalar_type());
  return dtype_of(t);
}

// The residual's float32 pointer (null without one), checked against the input's elements.
float* residual_of(const std::optional<at::Tensor>& residual, int64_t numel, const char* what) {
  if (!residual.has_value()) return nullptr;
  const at::Tensor& r = *residual;
  check_cpu(r, "residual");
  TORCH_CHECK(r.scalar_type() == at::kFloat && r.numel() == numel, "fastpar shm ", what,
              " (int8): the residual must be float32 of ", numel, " elements, got ",
              r.scalar_type(), " of ", r.numel());
  return r.data_ptr<float>();
}

}  // namespace

void shm_quantized_all_gather(int64_t handle, const at::Tensor& in, at::Tensor& out,
                              int64_t block) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "fastpar shm all_gather (int8): input is ",
              in.scalar_type(), " but output is ", out.scalar_type());
  TORCH_CHECK(out.numel() == in.numel() * c.world, "fastpar shm all_gather (int8): output holds ",
              out.numel(), " elements, expected ", c.world, " x ", in.numel());
  auto dt = quant_dtype_of(in, "all_gather");
  run([&] { shm::quantized_all_gather(c, in.data_ptr(), out.data_ptr(), in.numel(), dt, block); });
}

void shm_quantized_reduce_scatter(int64_t handle, const at::Tensor& in, at::Tensor& out,
                                  int64_t block, const std::optional<at::Tensor>& residual) {
  check_cpu(in, "input");
  check_cpu(out, "output");
  auto& c = get(handle);
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "fastpar shm reduce_scatter (int8): input "
              "is ", in.scalar_type(), " but output is ", out.scalar_type());
  TORCH_CHECK(in.numel() == out.numel() * c.world, "fastpar shm reduce_scatter (int8): input "
              "holds ", in.numel(), " elements, expected ", c.world, " x ", out.numel());
  auto dt = quant_dtype_of(in, "reduce_scatter");
  float* res = residual_of(residual, in.numel(), "reduce_scatter");
  run([&] {
    shm::quantized_reduce_scatter(c, in.data_ptr(), out.data_ptr(), out.numel(), dt, block, res);
  });
}

void shm_quantized_all_reduce(int64_t handle, at::Tensor& t, int64_t block,
                              const std::optional<at::Tensor>& residual) {
  check_cpu(t, "tensor");
  auto& c = get(handle);
  auto dt = quant_dtype_of(t, "all_reduce");
  float* res = residual_of(residual, t.numel(), "all_reduce");
  run([&] { shm::quantized_all_reduce(c, t.data_ptr(), t.numel(), dt, block, res); });
}

void shm_broadcast(int64_t handle, at::Tensor& t, int64_t root, int64_t sig) {
  check_cpu(t, "tensor");
  auto& c = get(handle);
  TORCH_CHECK(root >= 0 && root < c.world, "fastpar shm broadcast: root ", root,
              " is outside the group of ", c.world);
  run([&] {
    shm::broadcast(c, t.data_ptr(), t.nbytes(), static_cast<int>(root), uint64_t(sig));
  });
}

}  // namespace fastpar

// The torch.distributed backend "fastpar": see c10d_backend.h. Which call takes the shm kernels
// and which the fallback is decided here, per call, from the tensors and the op; docs/backend.md
// has the table.
#include "c10d_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <tuple>
#include <utility>

#include "c10d_hier.h"
#include "c10d_ipc.h"
#include "c10d_mpi.h"
#include "c10d_ops.h"
#include "py_call.h"
#include "shm_alltoall_ops.h"
#include "shm_ops.h"

namespace fastpar {
namespace {

using c10d::OpType;
using c10d::ReduceOp;
using Tensors = std::vector<at::Tensor>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using backend_ops::average;
using backend_ops::copy_back;
using backend_ops::premultiply;
using backend_ops::reduces;
using backend_ops::signature;

// A call that finished before it returned (the shm kernels complete on the calling thread;
// the CUDA IPC kernels are enqueued on the caller's current stream): its future already holds
// the result tensors, which DDP's communication hooks read. For CUDA tensors the future
// records an event on the current stream, and wait() (or the future's) makes the waiting
// stream wait for it, as NCCL's Work does.
std::vector<c10::Device> devices(const Tensors& ts) {
  for (const auto& t : ts) {
    if (t.is_cuda()) return {t.device()};
  }
  return {};
}

class DoneWork final : public c10d::Work {
 public:
  DoneWork(Tensors result, OpType type, int rank)
      : c10d::Work(rank, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), devices(result_))) {
    future_->markCompleted(c10::IValue(result_));
    finish();
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    future_->wait();  // CUDA: the current stream waits for the event; CPU: nothing to wait for
    return true;
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  Tensors result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// gloo carries no 16-bit integers, no unsigned ones wider than a byte and (in some operations)
// no complex numbers: the fallback moves them as a float or signed type of their size, complex
// ones as their real view (bits unchanged), and reduces int16 as int32.
bool gloo_lacks(at::ScalarType s) {
  return s == at::kShort || s == at::kUInt16 || s == at::kUInt32 || s == at::kUInt64;
}

at::Tensor as_bits(const at::Tensor& t) {
  if (t.is_cpu() && t.is_complex()) return at::view_as_real(t);
  if (!t.is_cpu() || !gloo_lacks(t.scalar_type())) return t;
  switch (t.element_size()) {
    case 2: return t.view(at::kHalf);
    case 4: return t.view(at::kInt);
    default: return t.view(at::kLong);
  }
}

Tensors as_bits(const Tensors& ts) {
  Tensors out;
  for (const auto& t : ts) out.push_back(as_bits(t));
  return out;
}

std::vector<Tensors> as_bits(const std::vector<Tensors>& tss) {
  std::vector<Tensors> out;
  for (const auto& ts : tss) out.push_back(as_bits(ts));
  return out;
}

// Set by fastpar.comm around the calls it sends to gloo on purpose (a forced engine): they
// take the fallback whatever the kernels could do.
thread_local bool fallback_only = false;

class FastparBackend final : public c10d::Backend {
 public:
  FastparBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> cpu,
                 c10::intrusive_ptr<c10d::Backend> cuda, PyObject* maker, double timeout_s,
                 const Hier& hier, PyObject* ipc_maker, PyObject* mpi_calls)
      : c10d::Backend(rank, size), cpu_(std::move(cpu)), cuda_(std::move(cuda)),
        maker_(maker), hier_(hier, size), ipc_(ipc_maker, size),
        mpi_(mpi_calls),
        timeout_(static_cast<int64_t>(timeout_s * 1000)) {
    Py_XINCREF(maker_);
  }
  ~FastparBackend() override { release(); }

  const std::string getBackendName() const override { return "fastpar"; }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>("fastpar", timeout_);
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
    cpu_->setTimeout(timeout);
    if (cuda_) cuda_->setTimeout(timeout);
    hier_.setTimeout(timeout);
  }

  WorkPtr allreduce(Tensors& ts, const c10d::AllreduceOptions& o) override {
    if (ts.size() == 1 && !fallback_only && ipc_.serves(ts[0], o.reduceOp)) {
      ipc_.all_reduce(ts[0], o.reduceOp);
      return done(ts, OpType::ALLREDUCE, "allreduce", "cuda_ipc");
    }
    if (ts.size() == 1 && here(ts[0]) && reduces(ts[0], o.reduceOp)) {
      reduce_in_place(ts[0], o.reduceOp);
      return done(ts, OpType::ALLREDUCE, "allreduce");
    }
    if (ts.size() == 1 && !fallback_only && hier_.all_reduces(ts[0], o.reduceOp)) {
      hier_.all_reduce(ts[0], o.reduceOp);
      return done(ts, OpType::ALLREDUCE, "allreduce", "hier");
    }
    if (ts.size() == 1 && !fallback_only && mpi_.all_reduces(ts[0], o.reduceOp)) {
      mpi_.all_reduce(ts[0], o.reduceOp, size_);
      return done(ts, OpType::ALLREDUCE, "allreduce", "mpi");
    }
    if (!ts.empty() && ts[0].is_cpu() && ts[0].scalar_type() == at::kShort) {
      for (auto& t : ts) {  // as int32: sums and products wrap as int16's do once narrowed
        Tensors wide{t.to(at::kInt)};
        allreduce(wide, o)->wait();
        t.copy_(wide[0]);
      }
      return done(ts, OpType::ALLREDUCE, nullptr);
    }
    if (ts.empty() || !ts[0].is_cpu() || !emulated(o.reduceOp)) {
      return pass("allreduce", ts).allreduce(ts, o);
    }
    // gloo has no AVG nor PREMUL_SUM: a sum made into them
    if (o.reduceOp.op_ == ReduceOp::PREMUL_SUM) {
      for (auto& t : ts) premultiply(t, o.reduceOp);
    }
    c10d::AllreduceOptions sum = o;
    sum.reduceOp = ReduceOp(ReduceOp::SUM);
    pass("allreduce", ts).allreduce(ts, sum)->wait();
    if (o.reduceOp.op_ == ReduceOp::AVG) {
      for (auto& t : ts) average(t, size_);
    }
    return done(ts, OpType::ALLREDUCE, nullptr);
  }

  WorkPtr allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& o) override {
    bool fused = !ts.empty() && std::all_of(ts.begin(), ts.end(), [&](const at::Tensor& t) {
      return here(t) && t.scalar_type() == ts[0].scalar_type() && reduces(t, o.reduceOp);
    });
    if (!fused) {
      for (auto& t : ts) {  // one call per tensor: the emulated ops and shm's checks apply
        Tensors one{t};
        allreduce(one, o)->wait();
      }
      return done(ts, OpType::ALLREDUCE_COALESCED, nullptr);
    }
    Tensors flat_parts;
    for (auto& t : ts) flat_parts.push_back(t.reshape(-1));
    auto flat = at::cat(flat_parts);
    reduce_in_place(flat, o.reduceOp);
    int64_t at = 0;
    for (auto& t : ts) {
      t.copy_(flat.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
    return done(ts, OpType::ALLREDUCE_COALESCED, "allreduce_coalesced");
  }

  WorkPtr broadcast(Tensors& ts, const c10d::BroadcastOptions& o) override {
    if (ts.size() == 1 && !fallback_only && mpi_.moves(ts[0])) {
      mpi_.broadcast(ts[0], o.rootRank);
      return done(ts, OpType::BROADCAST, "broadcast", "mpi");
    }
    if (ts.size() == 1 && here(ts[0])) {
      auto c = ts[0].contiguous();
      {
        std::lock_guard<std::mutex> busy(busy_);
        shm_broadcast(comm(), c, o.rootRank, signature(c.scalar_type(), c.sizes()));
      }
      copy_back(ts[0], c);
      return done(ts, OpType::BROADCAST, "broadcast");
    }
    auto bits = as_bits(ts);
    return pass("broadcast", ts).broadcast(bits, o);
  }

  WorkPtr reduce(Tensors& ts, const c10d::ReduceOptions& o) override {
    bool ours = ts.size() == 1 && here(ts[0]) && reduces(ts[0], o.reduceOp);
    bool made = ts.size() == 1 && ts[0].is_cpu() &&
                (emulated(o.reduceOp) || ts[0].scalar_type() == at::kShort);
    if (ours || made) {
      // every rank reduces; only the root's tensor takes the result, as gloo leaves the others
      Tensors x{rank_ == o.rootRank ? ts[0] : ts[0].clone()};
      if (ours) {
        reduce_in_place(x[0], o.reduceOp);
        return done(ts, OpType::REDUCE, "reduce");
      }
      c10d::AllreduceOptions all;  // gloo's sum made into AVG or PREMUL_SUM, or int16 widened
      all.reduceOp = o.reduceOp;
      allreduce(x, all)->wait();
      return done(ts, OpType::REDUCE, nullptr);
    }
    return pass("reduce", ts).reduce(ts, o);
  }

  WorkPtr allgather(std::vector<Tensors>& outs, Tensors& ins,
                    const c10d::AllgatherOptions& o) override {
    if (ins.size() == 1 && outs.size() == 1 && gathers(ins[0], outs[0])) {
      auto in = ins[0].contiguous();
      auto flat = at::empty({size_ * in.numel()}, in.options());
      {
        std::lock_guard<std::mutex> busy(busy_);
        shm_all_gather(comm(), in, flat, signature(in.scalar_type(), in.sizes()));
      }
      for (int64_t p = 0; p < size_; ++p) {
        outs[0][p].copy_(flat.narrow(0, p * in.numel(), in.numel()).view(in.sizes()));
      }
      return done(outs[0], OpType::ALLGATHER, "allgather");
    }
    auto outs_bits = as_bits(outs);
    auto ins_bits = as_bits(ins);
    return pass("allgather", ins).allgather(outs_bits, ins_bits, o);
  }

  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    if (!fallback_only && hier_.all_gathers(in, out)) {
      hier_.all_gather(in, out);
      return done({out}, OpType::_ALLGATHER_BASE, "_allgather_base", "hier");
    }
    if (!fallback_only && mpi_.moves(in) && mpi_.moves(out) &&
        in.scalar_type() == out.scalar_type() && out.numel() == size_ * in.numel()) {
      mpi_.all_gather(in, out);
      return done({out}, OpType::_ALLGATHER_BASE, "_allgather_base", "mpi");
    }
    if (here(in) && here(out) && in.scalar_type() == out.scalar_type() &&
        out.numel() == size_ * in.numel()) {
      auto in_c = in.contiguous();
      auto out_c = out.contiguous();
      {
        std::lock_guard<std::mutex> busy(busy_);
        shm_all_gather(comm(), in_c, out_c, signature(in.scalar_type(), in.sizes()));
      }
      copy_back(out, out_c);
      return done({out}, OpType::_ALLGATHER_BASE, "_allgather_base");
    }
    Tensors one{in};
    auto out_bits = as_bits(out), in_bits = as_bits(in);
    return pass("_allgather_base", one)._allgather_base(out_bits, in_bits, o);
  }

  WorkPtr allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                          const c10d::AllgatherOptions& o) override {
    if (!ins.empty() && ins[0].is_cpu()) {
      for (size_t i = 0; i < ins.size(); ++i) _allgather_base(outs[i], ins[i], o)->wait();
      return done(outs, OpType::COALESCED, nullptr);
    }
    return pass("allgather_into_tensor_coalesced", ins)
        .allgather_into_tensor_coalesced(outs, ins, o);
  }

  WorkPtr reduce_scatter(Tensors& outs, std::vector<Tensors>& ins,
                         const c10d::ReduceScatterOptions& o) override {
    if (outs.size() != 1 || ins.size() != 1 || !outs[0].is_cpu()) {
      return pass("reduce_scatter", outs).reduce_scatter(outs, ins, o);
    }
    Tensors parts;
    for (auto& t : ins[0]) parts.push_back(t.reshape(-1));
    auto flat = at::cat(parts);  // a copy: the ops made from sum and max may work on it
    return scatter_reduced(flat, outs[0], o, OpType::REDUCE_SCATTER);
  }

  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    if (!out.is_cpu()) {
      Tensors one{in};
      return pass("_reduce_scatter_base", one)._reduce_scatter_base(out, in, o);
    }
    TORCH_CHECK(in.numel() == size_ * out.numel(), "fastpar backend: reduce_scatter input of ",
                in.numel(), " elements for an output of ", out.numel(), " on ", size_, " ranks");
    if (!fallback_only && hier_.reduce_scatters(in, out, o.reduceOp)) {
      hier_.reduce_scatter(in, out, o.reduceOp);
      return done({out}, OpType::_REDUCE_SCATTER_BASE, "reduce_scatter", "hier");
    }
    auto flat = in.reshape(-1);
    bool shared = flat.data_ptr() == in.data_ptr() && out.numel() > 0 &&
                  static_cast<const char*>(out.data_ptr()) <
                      static_cast<const char*>(in.data_ptr()) + in.nbytes() &&
                  static_cast<const char*>(in.data_ptr()) <
                      static_cast<const char*>(out.data_ptr()) + out.nbytes();
    // the caller's input stays as it was: a copy where this call would change it (the ops
    // made from sum and max, the fallback's allreduce) or where the output lies in it
    bool keeps = scatters(flat, out, o.reduceOp) && !shared &&
                 (o.reduceOp.op_ == ReduceOp::SUM || o.reduceOp.op_ == ReduceOp::MAX ||
                  o.reduceOp.op_ == ReduceOp::AVG);
    auto work = keeps ? flat.contiguous() : flat.clone(at::MemoryFormat::Contiguous);
    return scatter_reduced(work, out, o, OpType::_REDUCE_SCATTER_BASE);
  }

  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                          const c10d::ReduceScatterOptions& o) override {
    if (!ins.empty() && ins[0].is_cpu()) {
      for (size_t i = 0; i < ins.size(); ++i) _reduce_scatter_base(outs[i], ins[i], o)->wait();
      return done(outs, OpType::COALESCED, nullptr);
    }
    return pass("reduce_scatter_tensor_coalesced", ins)
        .reduce_scatter_tensor_coalesced(outs, ins, o);
  }

  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits,
                        const c10d::AllToAllOptions& o) override {
    if (here(in) && here(out) && in.dim() >= 1 && out.dim() == in.dim() &&
        out.sizes().slice(1) == in.sizes().slice(1) && in.scalar_type() == out.scalar_type() &&
        splits_fit(in, in_splits) &&
        splits_fit(out, out_splits)) {
      auto send = rows(in, in_splits), recv = rows(out, out_splits);
      auto in_c = in.contiguous();
      auto out_c = out.contiguous();
      {
        std::lock_guard<std::mutex> busy(busy_);
        shm_all_to_all(comm(), in_c, send, recv, signature(in.scalar_type(), in.sizes().slice(1)),
                       out_c);
      }
      copy_back(out, out_c);
      return done({out}, OpType::ALLTOALL_BASE, "alltoall_base");
    }
    if (!fallback_only && mpi_.moves(in) && mpi_.moves(out) && in.dim() >= 1 &&
        out.dim() == in.dim() && out.sizes().slice(1) == in.sizes().slice(1) &&
        in.scalar_type() == out.scalar_type() && splits_fit(in, in_splits) &&
        splits_fit(out, out_splits)) {
      mpi_.all_to_all(in, out, rows(in, in_splits), rows(out, out_splits));
      return done({out}, OpType::ALLTOALL_BASE, "alltoall_base", "mpi");
    }
    Tensors one{in};
    auto out_bits = as_bits(out), in_bits = as_bits(in);
    return pass("alltoall_base", one).alltoall_base(out_bits, in_bits, out_splits, in_splits, o);
  }

  // The rest takes the fallback as it is.
  WorkPtr allgather_coalesced(std::vector<Tensors>& outs, Tensors& ins,
                              const c10d::AllgatherOptions& o) override {
    auto outs_bits = as_bits(outs);
    auto ins_bits = as_bits(ins);
    return pass("allgather_coalesced", ins).allgather_coalesced(outs_bits, ins_bits, o);
  }
  WorkPtr alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) override {
    auto outs_bits = as_bits(outs), ins_bits = as_bits(ins);
    return pass("alltoall", ins).alltoall(outs_bits, ins_bits, o);
  }
  WorkPtr gather(std::vector<Tensors>& outs, Tensors& ins,
                 const c10d::GatherOptions& o) override {
    auto outs_bits = as_bits(outs);
    auto ins_bits = as_bits(ins);
    return pass("gather", ins).gather(outs_bits, ins_bits, o);
  }
  WorkPtr scatter(Tensors& outs, std::vector<Tensors>& ins,
                  const c10d::ScatterOptions& o) override {
    auto outs_bits = as_bits(outs);
    auto ins_bits = as_bits(ins);
    return pass("scatter", outs).scatter(outs_bits, ins_bits, o);
  }
  WorkPtr send(Tensors& ts, int dst, int tag) override {
    auto bits = as_bits(ts);
    return pass("send", ts).send(bits, dst, tag);
  }
  WorkPtr recv(Tensors& ts, int src, int tag) override {
    auto bits = as_bits(ts);
    return pass("recv", ts).recv(bits, src, tag);
  }
  WorkPtr recvAnysource(Tensors& ts, int tag) override {
    auto bits = as_bits(ts);
    return pass("recv_anysource", ts).recvAnysource(bits, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    count("barrier", cpu_->getBackendName());
    return cpu_->barrier(o);  // gloo's waits for this group's calls still in flight too
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    count("monitored_barrier", cpu_->getBackendName());
    cpu_->monitoredBarrier(o, wait_all_ranks);
  }

  // The group's count of calls (torch's desync checks and object collectives read it): every
  // call, whichever engine runs it, alike on every rank.
  void setSequenceNumberForGroup() override { sequence_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return sequence_; }

  void abort() override {  // the fallbacks first: a call hung in one of them returns
    cpu_->abort();
    if (cuda_) cuda_->abort();
    hier_.abort();
    ipc_.close(false);
    mpi_.close(false);
    release();
  }
  void shutdown() override {
    ipc_.close(true);  // collective, over cpu_: destroy_process_group shuts groups down in order
    mpi_.close(true);
    release();
    hier_.shutdown();
    cpu_->shutdown();
    if (cuda_) cuda_->shutdown();
  }

  std::map<std::string, std::map<std::string, int64_t>> served() {
    std::lock_guard<std::mutex> lock(stats_);
    return served_;
  }

 private:
  // Whether the shm kernels take this tensor: the group has a segment, a dense CPU tensor.
  // Never its layout: ranks may pass the same call with different strides, and all must take
  // the same engine (the kernels work on a contiguous copy where a tensor is not).
  bool here(const at::Tensor& t) const {
    return maker_ != nullptr && !fallback_only && t.is_cpu() && t.layout() == at::kStrided;
  }

  // The group's shm communicator, made at the first call that needs it (busy_ held): the
  // maker is collective over the group, and every rank reaches its first such call in the
  // same order, since which calls take the kernels depends only on what the ranks share.
  int64_t comm() {
    if (shm_ == 0) std::tie(shm_, owner_) = backend_ops::call_shm_maker(maker_, failed_);
    return shm_;
  }

  bool gathers(const at::Tensor& in, const Tensors& outs) const {
    if (!here(in) || static_cast<int64_t>(outs.size()) != size_) {
      return false;
    }
    return std::all_of(outs.begin(), outs.end(), [&](const at::Tensor& t) {
      return t.is_cpu() && t.scalar_type() == in.scalar_type() && t.sizes() == in.sizes();
    });
  }
  // Whether the kernels reduce-scatter flat into out by op.
  bool scatters(const at::Tensor& flat, const at::Tensor& out, const ReduceOp& op) const {
    return here(out) && flat.is_cpu() && flat.scalar_type() == out.scalar_type() &&
           !flat.is_complex() && reduces(flat, op);
  }
  static bool emulated(const ReduceOp& op) {
    return op.op_ == ReduceOp::AVG || op.op_ == ReduceOp::PREMUL_SUM;
  }
  bool splits_fit(const at::Tensor& t, const std::vector<int64_t>& splits) const {
    if (splits.empty()) return t.size(0) % size_ == 0;
    int64_t total = 0;
    for (auto s : splits) total += s;
    return static_cast<int64_t>(splits.size()) == size_ && total == t.size(0);
  }
  std::vector<int64_t> rows(const at::Tensor& t, const std::vector<int64_t>& splits) const {
    return splits.empty() ? std::vector<int64_t>(size_, t.size(0) / size_) : splits;
  }

  // t = op over the group of t, on the kernels (reduces(t, op) holds).
  void reduce_in_place(at::Tensor& t, const ReduceOp& op) {
    at::Tensor c = t.contiguous();
    at::Tensor x = c.is_complex() ? at::view_as_real(c) : c;
    {
      std::lock_guard<std::mutex> busy(busy_);
      switch (op.op_) {
        case ReduceOp::MIN:  // min(x) = -max(-x), exactly
          x.neg_();
          shm_all_reduce(comm(), x, "max");
          x.neg_();
          break;
        case ReduceOp::MAX:
          shm_all_reduce(comm(), x, "max");
          break;
        case ReduceOp::PREMUL_SUM:
          premultiply(x, op);
          shm_all_reduce(comm(), x, "sum");
          break;
        default:
          shm_all_reduce(comm(), x, "sum");
          if (op.op_ == ReduceOp::AVG) average(x, size_);
      }
    }
    copy_back(t, c);
  }

  // out = this rank's block of op(flat) over the group; flat is contiguous and, for the ops
  // made from sum and max, a copy this call may change.
  WorkPtr scatter_reduced(at::Tensor& flat, at::Tensor& out, const c10d::ReduceScatterOptions& o,
                          OpType type) {
    const auto& op = o.reduceOp;
    if (!scatters(flat, out, op)) {  // the whole sum through allreduce (and its emulations), then our block
      Tensors all{flat};
      c10d::AllreduceOptions a;
      a.reduceOp = op;
      allreduce(all, a)->wait();
      out.copy_(flat.narrow(0, rank_ * out.numel(), out.numel()).view(out.sizes()));
      return done({out}, type, nullptr);
    }
    if (op.op_ == ReduceOp::MIN) flat.neg_();
    if (op.op_ == ReduceOp::PREMUL_SUM) premultiply(flat, op);
    auto out_c = out.contiguous();
    {
      std::lock_guard<std::mutex> busy(busy_);
      shm_reduce_scatter(comm(), flat, out_c,
                         op.op_ == ReduceOp::MAX || op.op_ == ReduceOp::MIN ? "max" : "sum");
    }
    if (op.op_ == ReduceOp::MIN) out_c.neg_();
    if (op.op_ == ReduceOp::AVG) average(out_c, size_);
    copy_back(out, out_c);
    return done({out}, type, "reduce_scatter");
  }

  // The fallback for these tensors' device, counted as serving `op`.
  c10d::Backend& pass(const char* op, const Tensors& ts) {
    bool cuda = !ts.empty() && ts[0].is_cuda();
    TORCH_CHECK(!cuda || cuda_, "fastpar backend: ", op, " of a CUDA tensor, but this group "
                "has no CUDA backend (a CPU-only torch, or the group was made for \"cpu\" "
                "only: use backend=\"cpu:fastpar,cuda:nccl\" or \"fastpar\" on a CUDA build)");
    auto& fb = cuda ? *cuda_ : *cpu_;
    count(op, fb.getBackendName());
    return fb;
  }

  WorkPtr done(Tensors ts, OpType type, const char* shm_op, const char* engine = "shm") {
    if (shm_op != nullptr) count(shm_op, engine);
    return c10::make_intrusive<DoneWork>(std::move(ts), type, rank_);
  }

  void count(const std::string& op, const std::string& engine) {
    std::lock_guard<std::mutex> lock(stats_);
    served_[op][engine] += 1;
    ++sequence_;
  }

  // Stop using the segment and let its Python owner close it (after any call in flight).
  void release() {
    PyObject* owner = nullptr;
    PyObject* maker = nullptr;
    {
      std::lock_guard<std::mutex> busy(busy_);
      shm_ = 0;
      std::swap(owner, owner_);
      std::swap(maker, maker_);
    }
    call_and_release(owner, "close");  // detaches the shm communicator
    release_python(maker);
  }

  c10::intrusive_ptr<c10d::Backend> cpu_, cuda_;
  int64_t shm_ = 0;             // the shm communicator's handle, once made
  PyObject* owner_ = nullptr;   // its Python owner (close() detaches it)
  PyObject* maker_;             // makes both; None where the group spans hosts
  HierPath hier_;               // a spanning group's hierarchy (off: none)
  std::string failed_;          // why a shm set-up failed (empty: none did)
  IpcAllReduce ipc_;            // CUDA tensors' all-reduce within a host (CUDA builds)
  MpiPath mpi_;                 // a spanning group's flat calls, in an MPI-launched job
  std::chrono::milliseconds timeout_;
  std::mutex busy_;  // one shm call at a time: ranks must agree on the order
  std::mutex stats_;
  std::atomic<uint64_t> sequence_{0};
  std::map<std::string, std::map<std::string, int64_t>> served_;
};

}  // namespace

bool set_fallback_only(bool on) {
  bool before = fallback_only;
  fallback_only = on;
  return before;
}

c10::intrusive_ptr<c10d::Backend> make_backend(int64_t rank, int64_t size,
                                               c10::intrusive_ptr<c10d::Backend> cpu,
                                               std::optional<c10::intrusive_ptr<c10d::Backend>> cuda,
                                               PyObject* maker, double timeout_s,
                                               const Hier& hier, PyObject* ipc_maker,
                                               PyObject* mpi_calls) {
  TORCH_CHECK(cpu, "fastpar backend: no CPU fallback backend given");
  return c10::make_intrusive<FastparBackend>(static_cast<int>(rank), static_cast<int>(size),
                                             std::move(cpu), cuda ? *cuda : nullptr, maker,
                                             timeout_s, hier, ipc_maker, mpi_calls);
}

std::map<std::string, std::map<std::string, int64_t>> backend_served(
    const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto* ours = dynamic_cast<FastparBackend*>(backend.get());
  return ours == nullptr ? std::map<std::string, std::map<std::string, int64_t>>{}
                         : ours->served();
}

}  // namespace fastpar

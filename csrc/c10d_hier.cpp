// The fastpar backend's hierarchical path: see c10d_hier.h.
#include "c10d_hier.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "c10d_ops.h"
#include "py_call.h"
#include "shm_ops.h"

namespace fastpar {

using backend_ops::average;
using backend_ops::copy_back;
using backend_ops::premultiply;
using backend_ops::reduces;
using backend_ops::signature;
using c10d::ReduceOp;

namespace {

// A contiguous tensor's memory as a flat uint8 view (complex ones through their real view).
at::Tensor bytes_of(const at::Tensor& contiguous) {
  const at::Tensor t = contiguous.is_complex() ? at::view_as_real(contiguous) : contiguous;
  return t.reshape(-1).view(at::kByte);
}

bool on_cpu(const at::Tensor& t) { return t.is_cpu() && t.layout() == at::kStrided; }

}  // namespace

HierPath::HierPath(const Hier& hier, int64_t size)
    : hier_(hier), size_(size), hosts_(1), cross_mpi_(hier.cross && hier.maker ? hier.cross_mpi
                                                                               : nullptr) {
  hier_.cross_mpi = nullptr;  // held by cross_mpi_
  if (!on()) {
    hier_ = Hier{};
    return;
  }
  TORCH_CHECK(hier_.local_size >= 2 && size_ % hier_.local_size == 0 &&
                  static_cast<int64_t>(hier_.place.size()) == size_,
              "fastpar backend: a hierarchy of ", hier_.local_size, " ranks per host, ",
              hier_.place.size(), " places, for a group of ", size_);
  hosts_ = size_ / hier_.local_size;
  std::vector<int64_t> sorted = hier_.place;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t g = 0; g < size_; ++g) {
    TORCH_CHECK(sorted[g] == g, "fastpar backend: the hierarchy's places are not a permutation "
                "of the group's ", size_, " ranks");
  }
  place_ = at::tensor(hier_.place, at::kLong);
  order_ = at::empty_like(place_);
  order_.index_put_({place_}, at::arange(size_, at::kLong));
  Gil gil;
  Py_INCREF(hier_.maker);
}

HierPath::~HierPath() { release(); }

int64_t HierPath::least(at::ScalarType s) const {
  return cross_mpi_.on() && MpiPath::carries(s) ? hier_.mpi_min_bytes : hier_.min_bytes;
}

bool HierPath::mpi_across(at::ScalarType s, int64_t nbytes) const {
  return cross_mpi_.on() && MpiPath::carries(s) && nbytes < hier_.cross_mpi_max_bytes;
}

bool HierPath::all_reduces(const at::Tensor& t, const ReduceOp& op) const {
  return on() && on_cpu(t) && reduces(t, op) &&
         static_cast<int64_t>(t.nbytes()) >= least(t.scalar_type());
}

bool HierPath::all_gathers(const at::Tensor& in, const at::Tensor& out) const {
  return on() && on_cpu(in) && on_cpu(out) && in.scalar_type() == out.scalar_type() &&
         out.numel() == size_ * in.numel() &&
         static_cast<int64_t>(out.nbytes()) >= least(at::kByte);  // moved as bytes
}

bool HierPath::reduce_scatters(const at::Tensor& in, const at::Tensor& out,
                               const ReduceOp& op) const {
  return on() && on_cpu(in) && on_cpu(out) && in.scalar_type() == out.scalar_type() &&
         !in.is_complex() && reduces(in, op) && in.numel() == size_ * out.numel() &&
         static_cast<int64_t>(in.nbytes()) >= least(in.scalar_type());
}

// Reduce-scatter within the host (the kernels), all-reduce of the shard across the hosts
// (the ranks of the same local index, on gloo), all-gather within the host (the kernels).
void HierPath::all_reduce(at::Tensor& t, const ReduceOp& op) {
  at::Tensor c = t.contiguous();
  at::Tensor flat = (c.is_complex() ? at::view_as_real(c) : c).reshape(-1);
  const int64_t n = flat.numel(), k = hier_.local_size, per = (n + k - 1) / k;
  at::Tensor buf = at::zeros({per * k}, flat.options());  // padded to k equal shards
  buf.narrow(0, 0, n).copy_(flat);
  const bool by_max = op.op_ == ReduceOp::MAX || op.op_ == ReduceOp::MIN;
  if (op.op_ == ReduceOp::MIN) buf.neg_();  // min(x) = -max(-x)
  if (op.op_ == ReduceOp::PREMUL_SUM) premultiply(buf, op);
  at::Tensor shard = at::empty({per}, flat.options());
  {
    std::lock_guard<std::mutex> busy(busy_);
    shm_reduce_scatter(intra(), buf, shard, by_max ? "max" : "sum");
  }
  c10d::AllreduceOptions across;
  across.reduceOp = ReduceOp(by_max ? ReduceOp::MAX : ReduceOp::SUM);
  if (mpi_across(shard.scalar_type(), shard.nbytes())) {
    cross_mpi_.all_reduce(shard, across.reduceOp, hosts_);
  } else {
    std::vector<at::Tensor> part{shard};
    hier_.cross->allreduce(part, across)->wait();
  }
  {
    std::lock_guard<std::mutex> busy(busy_);
    shm_all_gather(intra(), shard, buf, signature(shard.scalar_type(), shard.sizes()));
  }
  if (op.op_ == ReduceOp::MIN) buf.neg_();
  flat.copy_(buf.narrow(0, 0, n));
  if (op.op_ == ReduceOp::AVG) average(flat, size_);
  copy_back(t, c);
}

// Across the hosts first (each rank carries its own block to its local index's peers), then
// within the host (every rank gets the host's gathered blocks), then into group order.
void HierPath::all_gather(const at::Tensor& in, at::Tensor& out) {
  at::Tensor src = bytes_of(in.contiguous());
  const int64_t nb = src.numel(), k = hier_.local_size;
  at::Tensor across = at::empty({hosts_ * nb}, src.options());  // [h]: (host h, my index)'s
  if (mpi_across(at::kByte, across.nbytes())) {
    cross_mpi_.all_gather(src, across);
  } else {
    hier_.cross->_allgather_base(across, src)->wait();
  }
  at::Tensor gathered = at::empty({k * hosts_ * nb}, src.options());  // [j][h]
  {
    std::lock_guard<std::mutex> busy(busy_);
    shm_all_gather(intra(), across, gathered, signature(at::kByte, across.sizes()));
  }
  at::Tensor out_c = out.contiguous();
  bytes_of(out_c).view({size_, nb}).copy_(gathered.view({k * hosts_, nb}).index_select(0, place_));
  copy_back(out, out_c);
}

// Within the host first, on the blocks in [j][h] order (local index j gets the host's sum of
// every host's blocks of index j), then across the hosts (host h gets the sum of block h).
void HierPath::reduce_scatter(const at::Tensor& in, at::Tensor& out, const ReduceOp& op) {
  const int64_t n = out.numel();
  at::Tensor rows = in.reshape({size_, n}).index_select(0, order_);  // a copy, [j][h]
  const bool by_max = op.op_ == ReduceOp::MAX || op.op_ == ReduceOp::MIN;
  if (op.op_ == ReduceOp::MIN) rows.neg_();
  if (op.op_ == ReduceOp::PREMUL_SUM) premultiply(rows, op);
  at::Tensor pieces = at::empty({hosts_ * n}, rows.options());
  {
    std::lock_guard<std::mutex> busy(busy_);
    shm_reduce_scatter(intra(), rows.view(-1), pieces, by_max ? "max" : "sum");
  }
  c10d::ReduceScatterOptions across;
  across.reduceOp = ReduceOp(by_max ? ReduceOp::MAX : ReduceOp::SUM);
  at::Tensor out_c = out.contiguous();
  at::Tensor flat = out_c.view(-1);
  if (mpi_across(pieces.scalar_type(), pieces.nbytes())) {
    cross_mpi_.reduce_scatter(pieces, flat, by_max);
  } else {
    hier_.cross->_reduce_scatter_base(flat, pieces, across)->wait();
  }
  if (op.op_ == ReduceOp::MIN) out_c.neg_();
  if (op.op_ == ReduceOp::AVG) average(out_c, size_);
  copy_back(out, out_c);
}

int64_t HierPath::intra() {
  if (intra_ == 0) std::tie(intra_, intra_owner_) = backend_ops::call_shm_maker(hier_.maker, failed_);
  return intra_;
}

void HierPath::setTimeout(std::chrono::milliseconds timeout) {
  if (hier_.cross) hier_.cross->setTimeout(timeout);
}

void HierPath::abort() {
  if (hier_.cross) hier_.cross->abort();
  cross_mpi_.close(false);
  release();
}

void HierPath::shutdown() {
  cross_mpi_.close(true);
  release();
  if (hier_.cross) hier_.cross->shutdown();
}

void HierPath::release() {
  PyObject* owner = nullptr;
  PyObject* maker = nullptr;
  {
    std::lock_guard<std::mutex> busy(busy_);
    intra_ = 0;
    std::swap(owner, intra_owner_);
    std::swap(maker, hier_.maker);
  }
  call_and_release(owner, "close");
  release_python(maker);
}

}  // namespace fastpar

// Torch glue of the shared-memory point-to-point channels; see shm_p2p_ops.h.
#include <Python.h>  // first, as Python requires

#include "shm_p2p_ops.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "shm/shm_p2p.h"
#include "shm_ops.h"  // shm_poll_sigint

namespace fastpar {
namespace {

namespace p2p = fastpar::shm::p2p;

// A persistent sendrecv (MPI_Send_init + MPI_Recv_init): its tensors, bound once.
struct Plan {
  int send_slot, send_tag, recv_slot, recv_tag;
  std::vector<at::Tensor> keep;  // header, parts, recv header, recv parts: alive with the plan
  const void* header;
  size_t header_bytes;
  void* recv_header;
  size_t recv_header_bytes;
  std::vector<p2p::Part> out;
  std::vector<p2p::Span> in;
};

struct Channels {
  p2p::Endpoint ep;
  std::map<int64_t, Plan> plans;
  int64_t next_plan = 1;
};

std::mutex endpoints_mu;
std::map<int64_t, std::unique_ptr<Channels>> endpoints;
int64_t next_endpoint = 1;

Channels& channels(int64_t handle) {
  std::lock_guard<std::mutex> lock(endpoints_mu);
  auto it = endpoints.find(handle);
  TORCH_CHECK(it != endpoints.end(), "fastpar shm p2p: endpoint ", handle,
              " does not exist (already closed?)");
  return *it->second;
}

p2p::Endpoint& get(int64_t handle) { return channels(handle).ep; }

// Misuse (a ValueError in Python): nothing was sent or received.
void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fastpar shm p2p: ", what,
                    " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "fastpar shm p2p: ", what, " must be contiguous, got ",
                    "strides ", t.strides());
}

void check_header(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu() &&
                        t.is_contiguous(),
                    "fastpar shm p2p: the header must be a contiguous 1-D int64 CPU tensor of "
                    "at most ", p2p::kMaxHeaderBytes / 8, " elements, got ", t.scalar_type(),
                    " ", t.sizes(), " on ", t.device());
}

// The byte ranges of `parts` (contiguous CPU tensors), in `spans` (reused: no allocation once
// it has grown to the longest list).
template <typename S>
void spans_of(at::TensorList parts, std::vector<S>& spans) {
  spans.clear();
  for (const at::Tensor& t : parts) {
    check_cpu(t, "a payload part");
    spans.push_back({t.data_ptr(), t.nbytes()});
  }
}

// Lets other Python threads run while this one blocks in a wait (the poll hook takes the GIL
// back for its SIGINT check). A no-op when called without the GIL (e.g. from C++).
class GilReleased {
 public:
  GilReleased() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilReleased() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// The kernel throws shm::Error (protocol errors, a std::runtime_error) and
// std::invalid_argument (misuse); re-raise as c10 errors so Python sees RuntimeError /
// ValueError with the kernel's message, its kind recorded (shm_last_error).
template <typename F>
auto run(F&& f) -> decltype(f()) {
  shm_record_error(nullptr);
  try {
    return f();
  } catch (const c10::Error& e) {
    shm_record_error(&e);
    throw;
  } catch (const std::invalid_argument& e) {
    shm_record_error(&e);
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::exception& e) {
    shm_record_error(&e);
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

int64_t shm_p2p_segment_bytes(int64_t tags, int64_t ring_bytes) {
  TORCH_CHECK_VALUE(ring_bytes > 0, "fastpar shm p2p: ring_bytes ", ring_bytes, " must be > 0");
  return run([&] {
    return static_cast<int64_t>(p2p::segment_bytes(static_cast<int>(tags), size_t(ring_bytes)));
  });
}

void shm_p2p_init_segment(int64_t base, int64_t rank_lo, int64_t rank_hi, int64_t tags,
                          int64_t ring_bytes) {
  TORCH_CHECK_VALUE(base != 0 && ring_bytes > 0, "fastpar shm p2p: bad segment");
  run([&] {
    p2p::init_segment(reinterpret_cast<void*>(base), static_cast<int>(rank_lo),
                      static_cast<int>(rank_hi), static_cast<int>(tags), size_t(ring_bytes));
  });
}

int64_t shm_p2p_open(int64_t rank, bool oversubscribed, std::vector<int64_t> peers,
                     std::vector<int64_t> bases, int64_t tags, int64_t ring_bytes,
                     double timeout_s, int64_t single_copy_min) {
  TORCH_CHECK_VALUE(peers.size() == bases.size(), "fastpar shm p2p: ", peers.size(),
                    " peers but ", bases.size(), " segment bases");
  TORCH_CHECK_VALUE(ring_bytes > 0, "fastpar shm p2p: ring_bytes ", ring_bytes, " must be > 0");
  auto ch = std::make_unique<Channels>();
  p2p::Endpoint* ep = &ch->ep;
  run([&] {
    *ep = p2p::open(static_cast<int>(rank), oversubscribed, timeout_s);
    for (size_t i = 0; i < peers.size(); ++i)
      p2p::attach(*ep, reinterpret_cast<void*>(bases[i]), static_cast<int>(peers[i]),
                  static_cast<int>(tags), size_t(ring_bytes));
  });
  ep->poll = &shm_poll_sigint;
  ep->single_copy_min = single_copy_min < 0 ? SIZE_MAX : size_t(single_copy_min);
  std::lock_guard<std::mutex> lock(endpoints_mu);
  endpoints[next_endpoint] = std::move(ch);
  return next_endpoint++;
}

void shm_p2p_close(int64_t handle) {
  std::lock_guard<std::mutex> lock(endpoints_mu);
  endpoints.erase(handle);
}

int64_t shm_p2p_send(int64_t handle, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts) {
  check_header(header);
  thread_local std::vector<p2p::Part> spans;
  spans_of(parts, spans);
  auto& ep = get(handle);
  return run([&] {
    return static_cast<int64_t>(p2p::send(ep, static_cast<int>(slot), static_cast<int>(tag),
                                          header.data_ptr(), header.nbytes(), spans.data(),
                                          spans.size()));
  });
}

void shm_p2p_progress(int64_t handle) {
  auto& ep = get(handle);
  run([&] { p2p::progress(ep); });
}

at::Tensor shm_p2p_recv_header(int64_t handle, int64_t slot, int64_t tag) {
  auto& ep = get(handle);
  alignas(8) char buf[p2p::kMaxHeaderBytes];
  size_t n = run([&] {
    GilReleased unlocked;
    return p2p::recv_header(ep, static_cast<int>(slot), static_cast<int>(tag), buf, sizeof(buf));
  });
  TORCH_CHECK(n % 8 == 0, "fastpar shm p2p: a header of ", n, " bytes is not int64 elements");
  at::Tensor out = at::empty({int64_t(n / 8)}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) std::memcpy(out.data_ptr(), buf, n);
  return out;
}

int64_t shm_p2p_recv(int64_t handle, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts) {
  check_header(header);
  thread_local std::vector<p2p::Span> spans;
  spans_of(parts, spans);
  auto& ep = get(handle);
  bool taken = false;
  const size_t n = run([&] {
    GilReleased unlocked;
    return p2p::recv(ep, static_cast<int>(slot), static_cast<int>(tag), header.data_ptr(),
                     header.nbytes(), spans.data(), spans.size(), &taken);
  });
  TORCH_CHECK(n % 8 == 0, "fastpar shm p2p: a header of ", n, " bytes is not int64 elements");
  const int64_t words = int64_t(n / 8);
  return taken ? words : -1 - words;
}

namespace {

// Send, then receive; when the payload was taken too, wait for the send (MPI_Sendrecv). When it
// was not, the send stays pending: waiting for it could deadlock with a peer that waits for
// this rank's recv_payload. Returns (the send id, or 0 once complete; the header length in
// words, or -1 - it when the payload waits for recv_payload).
std::tuple<int64_t, int64_t> sendrecv(p2p::Endpoint& ep, int send_slot, int send_tag,
                                      const void* header, size_t header_bytes,
                                      const std::vector<p2p::Part>& out, int recv_slot,
                                      int recv_tag, void* recv_header, size_t recv_header_bytes,
                                      const std::vector<p2p::Span>& in) {
  uint64_t id = run([&] {
    return p2p::send(ep, send_slot, send_tag, header, header_bytes, out.data(), out.size());
  });
  bool taken = false;
  const size_t n = run([&] {
    GilReleased unlocked;
    const size_t got = p2p::recv(ep, recv_slot, recv_tag, recv_header, recv_header_bytes,
                                 in.data(), in.size(), &taken);
    if (taken && id != 0) {
      p2p::wait_send(ep, id);
      id = 0;
    }
    return got;
  });
  TORCH_CHECK(n % 8 == 0, "fastpar shm p2p: a header of ", n, " bytes is not int64 elements");
  const int64_t words = int64_t(n / 8);
  return {static_cast<int64_t>(id), taken ? words : -1 - words};
}

}  // namespace

std::tuple<int64_t, int64_t> shm_p2p_sendrecv(int64_t handle, int64_t send_slot,
                                              int64_t send_tag, const at::Tensor& header,
                                              at::TensorList parts, int64_t recv_slot,
                                              int64_t recv_tag, const at::Tensor& recv_header,
                                              at::TensorList recv_parts) {
  check_header(header);
  check_header(recv_header);
  thread_local std::vector<p2p::Part> out;
  thread_local std::vector<p2p::Span> in;
  spans_of(parts, out);
  spans_of(recv_parts, in);
  return sendrecv(get(handle), static_cast<int>(send_slot), static_cast<int>(send_tag),
                  header.data_ptr(), header.nbytes(), out, static_cast<int>(recv_slot),
                  static_cast<int>(recv_tag), recv_header.data_ptr(), recv_header.nbytes(), in);
}

int64_t shm_p2p_sendrecv_init(int64_t handle, int64_t send_slot, int64_t send_tag,
                              const at::Tensor& header, at::TensorList parts, int64_t recv_slot,
                              int64_t recv_tag, const at::Tensor& recv_header,
                              at::TensorList recv_parts) {
  check_header(header);
  check_header(recv_header);
  Plan plan{static_cast<int>(send_slot), static_cast<int>(send_tag),
            static_cast<int>(recv_slot), static_cast<int>(recv_tag)};
  spans_of(parts, plan.out);
  spans_of(recv_parts, plan.in);
  plan.keep = {header, recv_header};
  plan.keep.insert(plan.keep.end(), parts.begin(), parts.end());
  plan.keep.insert(plan.keep.end(), recv_parts.begin(), recv_parts.end());
  plan.header = header.data_ptr();
  plan.header_bytes = header.nbytes();
  plan.recv_header = recv_header.data_ptr();
  plan.recv_header_bytes = recv_header.nbytes();
  Channels& ch = channels(handle);
  ch.plans.emplace(ch.next_plan, std::move(plan));
  return ch.next_plan++;
}

std::tuple<int64_t, int64_t> shm_p2p_sendrecv_start(int64_t handle, int64_t plan) {
  Channels& ch = channels(handle);
  auto it = ch.plans.find(plan);
  TORCH_CHECK_VALUE(it != ch.plans.end(), "fastpar shm p2p: no sendrecv plan ", plan,
                    " (already freed?)");
  const Plan& p = it->second;
  return sendrecv(ch.ep, p.send_slot, p.send_tag, p.header, p.header_bytes, p.out, p.recv_slot,
                  p.recv_tag, p.recv_header, p.recv_header_bytes, p.in);
}

void shm_p2p_sendrecv_free(int64_t handle, int64_t plan) { channels(handle).plans.erase(plan); }

void shm_p2p_recv_payload(int64_t handle, int64_t slot, int64_t tag, at::TensorList parts) {
  thread_local std::vector<p2p::Span> spans;
  spans_of(parts, spans);
  auto& ep = get(handle);
  run([&] {
    GilReleased unlocked;
    p2p::recv_payload(ep, static_cast<int>(slot), static_cast<int>(tag), spans.data(),
                      spans.size());
  });
}

bool shm_p2p_send_done(int64_t handle, int64_t id) {
  auto& ep = get(handle);
  return run([&] {
    p2p::progress(ep);
    return p2p::send_done(ep, uint64_t(id));
  });
}

void shm_p2p_wait_send(int64_t handle, int64_t id) {
  auto& ep = get(handle);
  run([&] {
    GilReleased unlocked;
    p2p::wait_send(ep, uint64_t(id));
  });
}

void shm_p2p_flush(int64_t handle) {
  auto& ep = get(handle);
  run([&] {
    GilReleased unlocked;
    p2p::flush(ep);
  });
}

std::tuple<int64_t, int64_t> shm_p2p_pending(int64_t handle) {
  auto& ep = get(handle);
  run([&] { p2p::progress(ep); });
  return {static_cast<int64_t>(ep.pending), static_cast<int64_t>(ep.unacked)};
}

void shm_p2p_probe(int64_t handle) {
  auto& ep = get(handle);
  run([&] {
    for (size_t slot = 0; slot < ep.peers.size(); ++slot)
      p2p::probe_single_copy(ep, static_cast<int>(slot));
  });
}

bool shm_p2p_single_copy(int64_t handle, int64_t slot) {
  auto& ep = get(handle);
  return run([&] { return p2p::single_copy(ep, static_cast<int>(slot)); });
}

}  // namespace fastpar

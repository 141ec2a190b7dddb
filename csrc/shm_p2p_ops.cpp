// Torch glue of the shared-memory point-to-point channels; see shm_p2p_ops.h.
#include <Python.h>  // first, as Python requires

#include "shm_p2p_ops.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "shm/shm_p2p.h"
#include "shm_ops.h"  // shm_poll_sigint

namespace fastpar {
namespace {

namespace p2p = fastpar::shm::p2p;

std::mutex endpoints_mu;
std::map<int64_t, std::unique_ptr<p2p::Endpoint>> endpoints;
int64_t next_endpoint = 1;

p2p::Endpoint& get(int64_t handle) {
  std::lock_guard<std::mutex> lock(endpoints_mu);
  auto it = endpoints.find(handle);
  TORCH_CHECK(it != endpoints.end(), "fastpar shm p2p: endpoint ", handle,
              " does not exist (already closed?)");
  return *it->second;
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fastpar shm p2p: ", what, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "fastpar shm p2p: ", what, " must be contiguous");
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

// The kernel throws std::runtime_error (protocol errors) and std::invalid_argument (misuse);
// re-raise as c10 errors so Python sees RuntimeError / ValueError with the kernel's message.
template <typename F>
auto run(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::exception& e) {
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
                     double timeout_s) {
  TORCH_CHECK_VALUE(peers.size() == bases.size(), "fastpar shm p2p: ", peers.size(),
                    " peers but ", bases.size(), " segment bases");
  TORCH_CHECK_VALUE(ring_bytes > 0, "fastpar shm p2p: ring_bytes ", ring_bytes, " must be > 0");
  auto ep = std::make_unique<p2p::Endpoint>();
  run([&] {
    *ep = p2p::open(static_cast<int>(rank), oversubscribed, timeout_s);
    for (size_t i = 0; i < peers.size(); ++i)
      p2p::attach(*ep, reinterpret_cast<void*>(bases[i]), static_cast<int>(peers[i]),
                  static_cast<int>(tags), size_t(ring_bytes));
  });
  ep->poll = &shm_poll_sigint;
  std::lock_guard<std::mutex> lock(endpoints_mu);
  endpoints[next_endpoint] = std::move(ep);
  return next_endpoint++;
}

void shm_p2p_close(int64_t handle) {
  std::lock_guard<std::mutex> lock(endpoints_mu);
  endpoints.erase(handle);
}

int64_t shm_p2p_send(int64_t handle, int64_t slot, int64_t tag, const at::Tensor& header,
                     at::TensorList parts) {
  check_cpu(header, "header");
  TORCH_CHECK_VALUE(header.dim() == 1 && header.scalar_type() == at::kLong,
                    "fastpar shm p2p: the header must be a 1-D int64 tensor, got ",
                    header.scalar_type(), " with ", header.dim(), " dims");
  std::vector<p2p::Part> spans;
  spans.reserve(parts.size());
  for (const at::Tensor& t : parts) {
    check_cpu(t, "a payload part");
    spans.push_back({t.data_ptr(), t.nbytes()});
  }
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

void shm_p2p_recv_payload(int64_t handle, int64_t slot, int64_t tag, at::TensorList parts) {
  std::vector<p2p::Span> spans;
  spans.reserve(parts.size());
  for (const at::Tensor& t : parts) {
    check_cpu(t, "a payload part");
    spans.push_back({t.data_ptr(), t.nbytes()});
  }
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

int64_t shm_p2p_pending(int64_t handle) { return static_cast<int64_t>(get(handle).pending); }

}  // namespace fastpar

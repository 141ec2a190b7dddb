// Torch glue of the shared-memory collectives; see shm_ops.h.
#include <Python.h>  // first, as Python requires

#include "shm_ops.h"

#include <c10/util/Exception.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

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

// The kernel's poll hook: runs Python's signal handlers from inside a long wait, so that
// Ctrl-C ends a collective within ~10 ms instead of after the timeout. A handler that raised
// ends the wait (the kernel poisons the segment and throws); its exception is cleared here,
// and fastpar/comm/shm.py raises KeyboardInterrupt again from the message.
const char* poll_python_signals(void*) {
  if (!Py_IsInitialized()) return nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  const char* why = nullptr;
  if (PyErr_CheckSignals() != 0) {  // only the main thread runs handlers; others get 0
    why = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)
              ? "was interrupted (KeyboardInterrupt)"
              : "was interrupted (a signal handler raised)";
    PyErr_Clear();
  }
  PyGILState_Release(gil);
  return why;
}

// The kernel reports mismatches and timeouts as std::runtime_error; re-raise as c10::Error
// so Python sees a RuntimeError with the kernel's message.
template <typename F>
void run(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// ---- names of segments still being set up -----------------------------------------
// Between shm_open and the moment every member has mapped it, a segment has a name in
// /dev/shm. If its creator dies in that window, SIGKILL included, a reaper unlinks it: a
// child forked at shm_open that waits on a pipe; the creator writes to it once the name is
// gone, and if the creator dies first the pipe closes and the child unlinks the name. The
// child only calls async-signal-safe functions (safe after fork in a threaded process) and
// leaves the process group, so a launcher that kills the job's group does not take it along.

}  // namespace

std::vector<int64_t> shm_reaper_start(const std::string& name) {
  char path[256];
  TORCH_CHECK(name.size() < sizeof(path), "fastpar shm: segment name too long: ", name);
  std::memcpy(path, name.c_str(), name.size() + 1);
  int fds[2];
  TORCH_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "fastpar shm: pipe2 failed: ", std::strerror(errno));
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setsid();
    ::close(fds[1]);
    char c;
    ssize_t n;
    do {
      n = ::read(fds[0], &c, 1);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) ::shm_unlink(path);  // the creator died before the name was removed
    ::_exit(0);
  }
  ::close(fds[0]);
  if (pid < 0) {
    ::close(fds[1]);
    TORCH_CHECK(false, "fastpar shm: fork of the segment reaper failed: ", std::strerror(errno));
  }
  return {fds[1], pid};
}

void shm_reaper_stop(int64_t fd, int64_t pid) {
  ssize_t ignored = ::write(static_cast<int>(fd), "d", 1);
  (void)ignored;
  ::close(static_cast<int>(fd));
  int status;
  while (::waitpid(static_cast<pid_t>(pid), &status, 0) < 0 && errno == EINTR) {
  }
}

int64_t shm_segment_bytes(int64_t world, int64_t slot_bytes) {
  return static_cast<int64_t>(shm::segment_bytes(static_cast<int>(world), slot_bytes));
}

void shm_init_segment(int64_t base, int64_t world, int64_t slot_bytes) {
  run([&] { shm::init_segment(reinterpret_cast<void*>(base), static_cast<int>(world), slot_bytes); });
}

int64_t shm_attach(int64_t base, int64_t rank, int64_t world, int64_t slot_bytes,
                   double timeout_s) {
  auto comm = std::make_unique<shm::Comm>();
  run([&] {
    *comm = shm::attach(reinterpret_cast<void*>(base), static_cast<int>(rank),
                        static_cast<int>(world), slot_bytes);
  });
  comm->timeout_s = timeout_s;
  comm->poll = &poll_python_signals;
  std::lock_guard<std::mutex> lock(comms_mu);
  comms[next_comm] = std::move(comm);
  return next_comm++;
}

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

// How the shm kernels wait for a peer process; internal to csrc/shm, shared by
// shm_collectives.cpp and shm_p2p.cpp (README.md, "Protocol" and "Errors").
//
// * wait_until: pause-spin (adaptive budget), then sched_yield, then sleep until a peer rings
//   the waiter's Bell (a futex in the shared segment; 20 us naps where there is none); between
//   yields the caller's `idle` runs its checks, using a WaitClock for the slow ones.
// * Bell / ring: the waker's half: after a store a peer may wait for, ring that peer's bell
//   (a syscall only when the peer sleeps).
// * Ident: who a rank's process is (pid, start time, pid namespace), recorded at attach, so
//   that a waiting peer can tell a dead rank from a slow one.
// * poison / await_poison_message / poison_cause: the first error of a segment and its kind,
//   kept in the segment.
#pragma once

#include "shm_errors.h"
#include "x86_simd.h"

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace fastpar {
namespace shm {
namespace detail {

// Pause-spins before a wait falls back to sched_yield: long enough to catch a peer running
// on another core, short when ranks outnumber cores (then the peer needs our core).
constexpr int kSpinIters = 2000;
constexpr int kSpinItersOversubscribed = 50;
constexpr int kSpinItersMin = 16;
constexpr uint64_t kYieldsBeforeSleep = 16384;
constexpr uint64_t kYieldsBeforeSleepOversubscribed = 128;

// How a waiter of a Comm or an Endpoint spins and yields before it sleeps. `oversubscribed`:
// the busy-waiting ranks of this host outnumber the CPUs they may run on, so the peer a wait
// awaits may need this very core.
struct Tuning {
  int spin_iters;
  uint64_t yields_before_sleep;
};
inline Tuning tuning(bool oversubscribed) {
  return oversubscribed ? Tuning{kSpinItersOversubscribed, kYieldsBeforeSleepOversubscribed}
                        : Tuning{kSpinIters, kYieldsBeforeSleep};
}
constexpr long kSleepNs = 20000;
// A sleeping waiter wakes at least this often (its checks: poison, signals, liveness, timeout).
constexpr long kBellSleepNs = 10000000;
// Inside a wait that has passed its spin phase: how often the poll hook runs (signals) and how
// often the awaited peer's process is checked for life.
constexpr double kPollS = 0.01;
constexpr double kLivenessS = 0.1;

// ---- waiting --------------------------------------------------------------------------

// Time since a wait's spin phase ended, and when its periodic checks are due.
class WaitClock {
 public:
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  // True at most once per kPollS (resp. kLivenessS) of `s` = seconds().
  bool poll_due(double s) { return due(s, &next_poll_, kPollS); }
  bool liveness_due(double s) { return due(s, &next_liveness_, kLivenessS); }

 private:
  static bool due(double s, double* next, double period) {
    if (s < *next) return false;
    *next = s + period;
    return true;
  }
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  double next_poll_ = kPollS, next_liveness_ = kLivenessS;
};

// ---- bells ---------------------------------------------------------------------------

// Where one waiter sleeps, in memory every peer maps: the waiter futex-waits on `seq` while
// `sleeping` says so; a peer that publishes something the waiter may wait for rings it. One
// waiting thread per bell (a Comm or an Endpoint is driven by one thread at a time).
struct Bell {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleeping;
};
static_assert(sizeof(Bell) == 8 && std::atomic<uint32_t>::is_always_lock_free,
              "a bell is two lock-free words");

// Wakes the bell's waiter if it sleeps. Call after the store it may wait for: the fence orders
// that store before the load of `sleeping`, as the waiter orders its `sleeping` store before
// its last look at the data (a Dekker pair: one of the two sees the other's store).
// ring_fenced: the same, for a caller that has fenced since its store (several bells, one
// fence). One waiter sleeps on a bell: FUTEX_WAKE wakes one.
inline void ring_fenced(Bell& b) {
  if (b.sleeping.load(std::memory_order_relaxed) == 0) return;
  b.seq.fetch_add(1, std::memory_order_relaxed);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&b.seq), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}
inline void ring(Bell& b) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  ring_fenced(b);
}

// Sleeps on `b` until rung, a signal or kBellSleepNs, unless ready() already holds once the
// bell is armed (the waiter's half of ring's Dekker pair).
template <typename Ready>
inline void sleep_on(Bell& b, Ready&& ready) {
  const uint32_t seq = b.seq.load(std::memory_order_acquire);
  b.sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!ready()) {
    const timespec limit{0, kBellSleepNs};
    // Shared (not FUTEX_PRIVATE): the word lives in a segment other processes map. Returns at
    // once if a ring moved `seq` since it was read.
    if (::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&b.seq), FUTEX_WAIT, seq, &limit,
                  nullptr, 0) != 0 &&
        errno != EAGAIN && errno != ETIMEDOUT && errno != EINTR) {
      const timespec nap{0, kSleepNs};  // no futex here (a sandbox's filter): nap instead
      nanosleep(&nap, nullptr);
    }
  }
  b.sleeping.store(0, std::memory_order_relaxed);
}

// Returns once ready() is true: up to spin_now pause-spins (cheap when the peer runs on another
// core), then sched_yield so an oversubscribed core runs the peer, then, after
// yields_before_sleep yields, sleeps: on the Bell that bell() returns (woken by the peer that
// makes ready() true; no CPU spent meanwhile), or in 20 us naps where it returns nullptr (CFS
// keeps running a task that yields; a nap hands the core over).
// After each yield, nap or sleep that found ready() false, idle(it, clock) runs (it = 1, 2, ...;
// it may throw); do slow checks only when (it & 63) == 0 (after a bell sleep it always is).
// The spin budget adapts: a wait the spin served grows it by an eighth (up to spin_iters); a
// wait whose peer came at the first or second yield halves it (down to kSpinItersMin): that
// peer was waiting for our core, so spinning only delayed it. A peer that was merely late
// leaves it alone.
template <typename Ready, typename Idle, typename BellOf>
inline void wait_until(int& spin_now, int spin_iters, uint64_t yields_before_sleep,
                       Ready&& ready, Idle&& idle, BellOf&& bell) {
  for (int i = 0; i < spin_now; ++i) {
    if (ready()) {
      spin_now = std::min(spin_iters, spin_now + spin_now / 8 + 1);
      return;
    }
    cpu_relax();
  }
  WaitClock clock;
  for (uint64_t it = 1;; ++it) {
    if (it < yields_before_sleep) {
      sched_yield();
    } else if (Bell* b = bell()) {
      sleep_on(*b, ready);
      it = (it + 63) & ~uint64_t(63);  // a sleep lasts up to 10 ms: run the slow checks
    } else {
      const timespec nap{0, kSleepNs};
      nanosleep(&nap, nullptr);
    }
    if (ready()) {
      if (it <= 2) spin_now = std::max(kSpinItersMin, spin_now / 2);
      return;
    }
    idle(it, clock);
  }
}

// Whether `procs` busy-waiting processes outnumber the CPUs this process may run on (a
// launcher's binding, taskset), else all online ones.
inline bool oversubscribed(int procs) {
  cpu_set_t allowed;
  long cpus = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                  ? long(CPU_COUNT(&allowed))
                  : sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 && procs > cpus;
}

// ---- liveness -------------------------------------------------------------------------

// Who a rank is, for liveness checks: written once by its owner at attach.
struct Ident {
  int32_t pid;
  uint32_t pad;
  uint64_t start;  // process start time (field 22 of /proc/<pid>/stat), against pid reuse
  uint64_t pidns;  // inode of /proc/self/ns/pid: pids compare only within one namespace
};

// Start time and state of process `pid`; false if it does not exist.
inline bool read_stat(int pid, uint64_t* start, char* state) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses; skip to the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  *state = p[2];
  // After ')': state is field 3, start time field 22.
  const char* q = p + 2;
  for (int field = 3; field < 22 && q != nullptr; ++field) {
    q = std::strchr(q, ' ');
    if (q != nullptr) ++q;
  }
  *start = q != nullptr ? std::strtoull(q, nullptr, 10) : 0;
  return true;
}

// Whether /proc/self is /proc/<pid> (same pid namespace as the mounted /proc).
inline bool own_pid_in_proc(int pid) {
  char buf[64];
  ssize_t n = ::readlink("/proc/self", buf, sizeof(buf) - 1);
  if (n <= 0) return false;
  buf[n] = '\0';
  return std::strtol(buf, nullptr, 10) == pid;
}

inline uint64_t own_pidns() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : 0;
}

// This process's identity. Liveness checks of it stay off (pid 0) unless /proc shows this very
// process under its pid (a pid namespace without its own /proc mount would not).
inline void record_ident(Ident* me) {
  uint64_t start = 0;
  char state = '?';
  const int pid = int(::getpid());
  me->start = read_stat(pid, &start, &state) && own_pid_in_proc(pid) ? start : 0;
  me->pidns = own_pidns();
  me->pid = me->start != 0 ? pid : 0;
}

// Whether the process `id` names has died. Only when that is certain: it recorded itself (pid
// known), it lives in our pid namespace, and /proc says it is gone, a zombie, or a newer one.
inline bool ident_dead(const Ident& id) {
  if (id.pid <= 0 || id.start == 0 || id.pidns == 0 || id.pidns != own_pidns()) return false;
  uint64_t start = 0;
  char state = '?';
  if (!read_stat(id.pid, &start, &state)) return true;
  return state == 'Z' || state == 'X' || (id.start != 0 && start != id.start);
}

// ---- poisoning --------------------------------------------------------------------------

// Records `msg` (an error of `kind`) as the segment's first error: `state` goes 0 -> 1 (being
// written) -> 2 (message and `cause` written); a later error leaves the first one in place.
inline void poison(std::atomic<uint32_t>& state, char* message, size_t cap, uint32_t* cause,
                   ErrorKind kind, const std::string& msg) {
  uint32_t expected = 0;
  if (state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    std::strncpy(message, msg.c_str(), cap - 1);
    message[cap - 1] = '\0';
    *cause = uint32_t(kind);
    state.store(2, std::memory_order_release);
  }
}

// The poisoning rank writes its message right after marking the segment; give it up to a
// second to finish (it may have been descheduled in between on an oversubscribed host) so
// that every rank reports the cause, not a placeholder.
inline void await_poison_message(const std::atomic<uint32_t>& state) {
  const auto t0 = std::chrono::steady_clock::now();
  while (state.load(std::memory_order_acquire) == 1 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1))
    std::this_thread::yield();
}

// The kind of the error that poisoned the segment (Other while its message is being written).
inline ErrorKind poison_cause(const std::atomic<uint32_t>& state, const uint32_t& cause) {
  return state.load(std::memory_order_acquire) == 2 ? ErrorKind(cause) : ErrorKind::Other;
}

}  // namespace detail
}  // namespace shm
}  // namespace fastpar

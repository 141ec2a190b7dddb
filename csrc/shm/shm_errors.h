// What a failed shm call reports: an exception whose type, and code (ErrorKind), say what
// happened, so that a caller tells a timeout from an interrupt without reading the message.
// Part of the kernel's interface (shm_collectives.h, shm_p2p.h); no torch here.
//
// The codes cross into Python (csrc/shm_ops.cpp records the last one per thread,
// fastpar/comm/engines/native_errors.py reads it): keep the numbers.
#pragma once

#include <stdexcept>
#include <string>

namespace fastpar {
namespace shm {

enum class ErrorKind : int {
  None = 0,         // no error recorded
  Other = 1,        // anything else (a bad argument, a corrupt frame, a failed copy)
  Timeout = 2,      // a wait ran past the timeout
  Interrupted = 3,  // the poll hook ended a wait (SIGINT)
  PeerDead = 4,     // the awaited peer's process is gone
  Poisoned = 5,     // an earlier error poisoned the segment (cause(): that error's kind)
  Mismatch = 6,     // ranks passed calls that disagree (collectives' descriptors)
};

// Base of the kernel's protocol errors. `cause`: for Poisoned, the kind of the error that
// poisoned the segment; for every other kind the kind itself.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg, ErrorKind cause = ErrorKind::None)
      : std::runtime_error(msg), kind_(kind), cause_(cause == ErrorKind::None ? kind : cause) {}
  ErrorKind kind() const noexcept { return kind_; }
  ErrorKind cause() const noexcept { return cause_; }

 private:
  ErrorKind kind_, cause_;
};

struct TimeoutError : Error {
  explicit TimeoutError(const std::string& msg) : Error(ErrorKind::Timeout, msg) {}
};
struct InterruptedError : Error {
  explicit InterruptedError(const std::string& msg) : Error(ErrorKind::Interrupted, msg) {}
};
struct PeerDeadError : Error {
  explicit PeerDeadError(const std::string& msg) : Error(ErrorKind::PeerDead, msg) {}
};
struct PoisonedError : Error {
  PoisonedError(const std::string& msg, ErrorKind cause)
      : Error(ErrorKind::Poisoned, msg, cause) {}
};
struct MismatchError : Error {
  explicit MismatchError(const std::string& msg) : Error(ErrorKind::Mismatch, msg) {}
};

// Throws the typed error of `kind` with `msg`.
[[noreturn]] inline void throw_error(ErrorKind kind, const std::string& msg) {
  switch (kind) {
    case ErrorKind::Timeout: throw TimeoutError(msg);
    case ErrorKind::Interrupted: throw InterruptedError(msg);
    case ErrorKind::PeerDead: throw PeerDeadError(msg);
    case ErrorKind::Mismatch: throw MismatchError(msg);
    default: throw Error(kind, msg);
  }
}

}  // namespace shm
}  // namespace fastpar

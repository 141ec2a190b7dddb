// Build facts of the native extension, parsed by fastpar._native.status() (`python -m fastpar
// info` shows the cuda flag: "built (cpu)" or "built (cpu+cuda)").
// Pure C++ (no torch): the bindings file exposes it as the op fastpar::build_info.
#include "build_info.h"

#include <sstream>

namespace fastpar {

std::string build_info() {
  std::ostringstream out;
  out << "version=" << FASTPAR_VERSION_STRING;
#if defined(__clang__)
  out << ";compiler=clang " << __clang_major__ << "." << __clang_minor__;
#elif defined(__GNUC__)
  out << ";compiler=gcc " << __GNUC__ << "." << __GNUC_MINOR__;
#endif
  out << ";cpp=" << __cplusplus;
#ifdef FASTPAR_WITH_CUDA
  out << ";cuda=1";
#else
  out << ";cuda=0";
#endif
  return out.str();
}

}  // namespace fastpar

// The x86 intrinsics of csrc/shm in one place: the intrinsics header, per-function target
// attributes and run-time CPU feature checks.
//
// The build never raises the baseline ISA (no -march=native): a function marked
// FASTPAR_TARGET_AVX2 / _AVX512 / _F16C may use those instructions, and its caller runs it only
// after cpu_has_avx2() / cpu_has_avx512f() / cpu_has_f16c() said yes, keeping a plain path for
// other CPUs.
// FASTPAR_X86 is defined only on x86; code outside `#ifdef FASTPAR_X86` stays portable.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FASTPAR_X86 1
#define FASTPAR_TARGET_AVX2 __attribute__((target("avx2")))
#define FASTPAR_TARGET_F16C __attribute__((target("avx,f16c")))
// AVX-512F brings FMA with it: GCC then fuses a multiply and an add, intrinsics included, unless
// the translation unit is built with -ffp-contract=off (setup.py does), which the int8 codec's
// bitwise results need.
#define FASTPAR_TARGET_AVX512 __attribute__((target("avx512f")))
#endif

namespace fastpar {
namespace shm {

#ifdef FASTPAR_X86
// Features of the CPU we run on (not the one we were built on).
inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
inline bool cpu_has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
inline bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#endif

// Spin-wait hint: tells the core (and a hyperthread sibling) that we are busy-waiting.
inline void cpu_relax() {
#if defined(FASTPAR_X86)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace shm
}  // namespace fastpar

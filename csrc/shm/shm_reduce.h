// Element-wise layer of the shared-memory collectives: reduce `nsrc` arrays into one.
#pragma once

#include <cstddef>

#include "shm_collectives.h"

namespace fastpar {
namespace shm {

// dst[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) for i < n, in source order 0..nsrc-1 (so every
// rank computing the same reduction gets bitwise the same result). 16-bit dtypes accumulate in
// float32 and round once; max propagates NaN. dst may alias srcs[0].
void reduce_into(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, Op op);

}  // namespace shm
}  // namespace fastpar

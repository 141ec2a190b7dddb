// fastpar shared-memory all-to-all: the pure kernel (no torch, owns no memory). It runs over the
// collectives' segment and Comm (shm_collectives.h): same rounds, flags, waits and errors.
// Protocol: README.md, "all_to_all".
#pragma once

#include "shm_collectives.h"

#include <cstddef>
#include <cstdint>
#include <functional>

namespace fastpar {
namespace shm {

// Rank r's input holds, in rank order, send_rows[p] rows of row_bytes bytes for each rank p.
// Every rank publishes its send_rows (and recv_rows, when it passes them) in its half of the
// first round, so each rank reads what it will receive from shared memory: no extra round trip.
// Once the first round is in, got_rows[r] = the rows rank r sends this rank, and
// alloc(total bytes) is called for the output (owned by the caller); the output is every rank's
// slice for this rank, concatenated in rank order.
// recv_rows (nullable): what this rank expects from each rank; any rank whose expectation
// differs from what is sent makes every rank throw the same MismatchError, as do ranks that
// disagree on row_bytes or sig (the caller's dtype and row shape).
// Large messages go through the slot in rounds of (half - head) / world bytes per pair.
void all_to_all(Comm& c, const void* in, const uint64_t* send_rows, const uint64_t* recv_rows,
                uint64_t row_bytes, uint64_t sig, uint64_t* got_rows,
                const std::function<void*(size_t)>& alloc);

}  // namespace shm
}  // namespace fastpar

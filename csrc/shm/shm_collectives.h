// fastpar shared-memory collectives: the pure kernel layer.
//
// No torch, no Python, owns no memory: every function operates on a segment base
// pointer that the caller mapped (shm_open + mmap) and on raw host pointers.
// Protocol and segment layout: csrc/shm/README.md.
//
// Usage (one process per rank, all mapping the same segment):
//   creator: init_segment(base, world, slot_bytes);   // once, before anyone attaches
//   (out-of-band barrier, e.g. the torch store)
//   each rank: Comm c = attach(base, rank, world, slot_bytes);
//              all_reduce(c, ptr, count, DType::F32, Op::Sum);
//
// Every rank of the segment must issue the same sequence of calls with the same
// op / dtype / count / root; a mismatch throws MismatchError on every rank. Protocol errors
// are shm::Error (a std::runtime_error) whose type and kind() say what happened
// (shm_errors.h: timeout, interrupt, dead peer, poisoned segment, mismatch).
// Any error (mismatch, timeout) poisons the segment: later calls on it throw at once.
// A Comm is thread-compatible: one thread at a time per Comm.
#pragma once

#include "shm_errors.h"

#include <cstddef>
#include <cstdint>

namespace fastpar {
namespace shm {

enum class DType : uint32_t { F32 = 0, F64 = 1, BF16 = 2, F16 = 3 };
enum class Op : uint32_t { Sum = 0, Max = 1 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);

// Defaults: a 4 MiB slot per rank, used as two 2 MiB halves (see README).
// all_reduce of up to small_max_bytes (32 KiB) takes one round in which every rank reduces
// everything. A larger one goes chunk_bytes (1 MiB) of the message at a time (not per
// rank): each rank copies the chunk, less its own 1/world slice, into its half and
// signals; reduces its slice across all ranks into its half and signals; then copies
// every rank's reduced slice out. all_gather and broadcast also move chunk_bytes per
// round; reduce_scatter fills a whole half per round. init_segment caps both knobs at
// half a slot and raises chunk_bytes to at least 4096.
constexpr size_t kDefaultSlotBytes = size_t(4) << 20;
constexpr size_t kDefaultSmallMaxBytes = size_t(32) << 10;
constexpr size_t kDefaultChunkBytes = size_t(1) << 20;
constexpr double kDefaultTimeoutS = 300.0;

// Bytes the caller must map for `world` ranks with `slot_bytes` per rank
// (slot_bytes: a multiple of 4096, at least 8192).
size_t segment_bytes(int world, size_t slot_bytes);

// Writes the header and zeroes the control blocks (not the data slots). Called once
// by the creating process before any rank attaches. The protocol tuning knobs live in
// the segment so that every rank necessarily uses the same ones.
void init_segment(void* base, int world, size_t slot_bytes,
                  size_t small_max_bytes = kDefaultSmallMaxBytes,
                  size_t chunk_bytes = kDefaultChunkBytes);

// Per-rank view of a segment. Plain value; holds no resources.
struct Comm {
  void* base = nullptr;
  int rank = 0;
  int world = 1;
  size_t slot_bytes = 0;
  size_t small_max_bytes = 0;  // copied from the segment header
  size_t chunk_bytes = 0;      // copied from the segment header
  uint64_t flag = 0;           // signals this rank has published so far
  uint64_t rounds = 0;         // data rounds so far; parity picks the slot half
  uint64_t calls = 0;          // collective calls so far
  double timeout_s = kDefaultTimeoutS;  // per wait; set freely between calls
  int spin_iters = 2000;  // pause-spins before sched_yield; lower when oversubscribed
  // The spin budget in force: halved by a wait whose spin found nothing but whose peer came
  // at the first yield (it was waiting for our core), grown back slowly by waits the spin
  // served. Two ranks that the scheduler put on one core spin against each other (each
  // pause-spin keeps the peer it waits for off the core: ~100 us a call with 2000 pauses);
  // the budget then falls to a few pauses within a few calls.
  int spin_now = spin_iters;
  // sched_yields before a wait sleeps on its bell: short when ranks outnumber cores (the late
  // peer needs our core), long otherwise (a sleep and its wake cost microseconds per sync).
  uint64_t yields_before_sleep = 16384;
  // Called from inside long waits, at most every 10 ms: a non-null message ends the
  // call with that message (and poisons the segment, as any error). The torch glue uses it to
  // let Ctrl-C through; the kernel itself stays free of Python.
  const char* (*poll)() = nullptr;
  // Whether this rank can read its peers' memory (process_vm_readv), probed by the first large
  // all_to_all (shm_alltoall.cpp): 0 not yet, 1 yes, 2 no.
  int peers_readable = 0;
};

// Validates the header (magic, version, world, slot size) and returns a fresh Comm.
// Throws std::runtime_error naming the expected and found numbers on mismatch.
// Records this process's identity (pid, start time, pid namespace) in its control line, so
// that a peer waiting for it can tell a dead rank from a slow one: a wait for a rank whose
// process is gone (same pid namespace, /proc/<pid> missing, a zombie, or a reused pid) fails
// at once naming it, instead of after the timeout.
// Its waits spin and yield as for `world` busy-waiting ranks on this host's CPUs; a caller that
// knows better (other ranks of the host wait too) says so with set_oversubscribed.
Comm attach(void* base, int rank, int world, size_t slot_bytes);

// How c's waits spin and yield before they sleep: briefly when `yes` (the busy-waiting ranks of
// this host outnumber its CPUs, so the peer may need this core), long otherwise.
void set_oversubscribed(Comm& c, bool yes);

// True once an error has poisoned the segment; poison_message() says why.
bool is_poisoned(const Comm& c);
const char* poison_message(const Comm& c);

// In place: data[0:count] = op over ranks 0..world-1 (fixed order, bitwise identical
// on every rank). 16-bit dtypes accumulate in float32, round to nearest-even once.
void all_reduce(Comm& c, void* data, size_t count, DType dt, Op op);

// In place over a symmetric buffer: slots[p] is rank p's `count` elements, as this process
// maps them (every rank maps the same segment; slots[rank] is this rank's own data). Rank r
// reduces slice r of all slots in rank order 0..world-1 into an L1 block and writes it into
// slice r of every slot: each byte is read once and written once per rank, no copy in or out.
// The call's flags are this Comm's (two signals: entry, then every slice written). Bitwise the
// result of all_reduce: same reduction code, same order. A rank passing a plain all_reduce
// where the others pass this one gets the descriptor mismatch error.
// `sig` (every symmetric call): the caller's description of which symmetric memory this is
// (fastpar/comm/symmetric.py hashes the segment, the offset in the slot, dtype and shape into
// it), compared across ranks like the count: ranks that pass different symmetric tensors, or
// views at different offsets, fail on every rank instead of reading each other's other bytes.
void all_reduce_symmetric(Comm& c, void* const* slots, size_t count, DType dt, Op op,
                          uint64_t sig = 0);

// Over a symmetric buffer of world*bytes per rank: slots[p] is rank p's buffer, whose block p
// (bytes [p*bytes, (p+1)*bytes)) rank p filled before the call. Rank r copies block p of
// slots[p] into block p of its own buffer for every p != r: each byte read and written once.
// (Implemented in shm_symmetric.cpp, like the other two symmetric calls.)
void all_gather_symmetric(Comm& c, void* const* slots, size_t bytes, uint64_t sig = 0);

// Every rank's source in symmetric memory, the output plain: srcs[p] is rank p's `bytes` as
// this process maps them; block p of `out` (world*bytes) = srcs[p], this rank's own included.
// Entry round, one read and one write per byte, exit signal (nobody reads a source any more,
// so its owner may change it): ZeRO-3 gathers its parameters straight from the peers' master
// shards into a buffer of its own. `out` must not overlap a source.
void all_gather_from_symmetric(Comm& c, void* const* srcs, void* out, size_t bytes,
                               uint64_t sig = 0);

// Equal-split all-to-all over symmetric inputs of world*bytes per rank: block p of `out` is
// block r (this rank) of slots[p]; each byte is read once and written once, no copy in.
// `out` must not be a symmetric input of this call (peers read those until the exit signal).
void all_to_all_symmetric(Comm& c, void* const* slots, void* out, size_t bytes, uint64_t sig = 0);

// Over symmetric inputs of world*count elements: out[0:count] = op over ranks p, in rank order,
// of slots[p][rank*count : (rank+1)*count]; bitwise reduce_scatter's result. `out` may be this
// rank's own block of its input (slots[rank] + rank*count).
void reduce_scatter_symmetric(Comm& c, void* const* slots, void* out, size_t count, DType dt,
                              Op op, uint64_t sig = 0);

// out[r*bytes:(r+1)*bytes] = in of rank r. `out` holds world*bytes; `in` may alias
// out + rank*bytes.
// `sig`: what the bytes are (the caller's dtype and shape, packed into 64 bits; 0 if it has
// none); ranks that pass different signatures get the mismatch error, as for a size.
void all_gather(Comm& c, const void* in, void* out, size_t bytes, uint64_t sig = 0);

// in holds world*count elements; out[0:count] = op over ranks of in[rank*count:+count].
// `out` must not overlap `in`.
void reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType dt, Op op);

// In place: data[0:bytes] on every rank = data of rank `root`.
// `sig` as for all_gather.
void broadcast(Comm& c, void* data, size_t bytes, int root, uint64_t sig = 0);

// ---- int8 (fastpar/comm/quant.py's codec, bit for bit; shm_quantized.cpp) -----------------
// float32 or bfloat16 data, blocks of `block` elements (a multiple of 16, 16..65536) from the
// start of each rank's piece. A rank quantizes its input while it copies it into its slot, its
// peers dequantize while they copy it out: a quarter of float32's bytes cross the slots, and no
// pass over memory is added. Sums dequantize every rank's piece and add them in float32 in rank
// order 0..world-1 (acc = y_0; acc += y_1; ...), then round once to the dtype. Every rank's
// result is bitwise the same as fastpar/comm/quantized.py's. `residual` (float32, the input's
// element count, or null): error feedback, updated in place; the call quantizes x + residual
// and leaves in it what the receivers will not see (zeros in a block that is not finite, which
// is sent as NaN: the error it carried is dropped). A block whose round does not fit half a
// slot (world pieces of it, for the sums) fails on every rank, as does any mismatch of kind,
// dtype, count or block.

// out[r*count : (r+1)*count] = rank r's `in`, quantized and dequantized (this rank's too).
// `in` may alias out + rank*count.
void quantized_all_gather(Comm& c, const void* in, void* out, size_t count, DType dt,
                          size_t block);

// in holds world*count elements; out[0:count] = the float32 sum over ranks p, in rank order, of
// rank p's in[rank*count : +count] quantized (blocks restart at each rank's chunk), rounded
// once to dt. residual: world*count. `out` may alias in + rank*count (a round encodes its
// window of every chunk before it writes the sums of that window); no other overlap.
void quantized_reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType dt,
                              size_t block, float* residual);

// In place: data[0:count] = the sum over ranks, through two quantizations. The data is cut in
// world chunks of m = ceil(count / world) (zeros past the end); rank r sums chunk r as
// reduce_scatter does, quantizes that float32 sum again, and every rank dequantizes every sum.
// residual: count; rank r also adds the rounding of its sum's quantization at chunk r.
void quantized_all_reduce(Comm& c, void* data, size_t count, DType dt, size_t block,
                          float* residual);

// --- exposed for tests -------------------------------------------------------
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);  // portable bit manipulation, RNE, subnormals, inf, nan
float f16_to_f32(uint16_t h);
// Converts n values with the fastest available path (F16C when the CPU has it).
void f16_to_f32_n(const uint16_t* in, float* out, size_t n);
void f32_to_f16_n(const float* in, uint16_t* out, size_t n);

}  // namespace shm
}  // namespace fastpar

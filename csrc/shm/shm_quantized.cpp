// fastpar shared-memory collectives in int8: the copying collectives' rounds with the codec
// (shm_quant.h) in their copy loops. A rank quantizes its input straight into its slot half
// (each piece's scales, then its int8 values), and its peers dequantize straight out of the
// halves, summing in float32 where the call reduces: nothing is staged in float32, and no pass
// over memory is added to the copies the full-precision kernels make. Rounds, signals and the
// reuse of halves are the copying protocol's (shm_collectives.cpp); README.md has the layout.
// Results are bitwise fastpar/comm/quantized.py's: same codec, same pieces, same sums.
#include "shm_collectives.h"
#include "shm_protocol.h"
#include "shm_quant.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

namespace fastpar {
namespace shm {

using namespace proto;

namespace {

constexpr size_t kLine = 64;    // pieces start on a cache line: a reader touches only its own
constexpr size_t kTile = 4096;  // float32 sums kept in L1 at a time (whole blocks)

// How a call cuts its data into rounds: `elems` elements (whole blocks) of each piece per round,
// pieces `stride` bytes apart in a half. `why`: why the call cannot run (empty: it can); every
// rank finds the same once the descriptors agree.
struct Plan {
  size_t block = 0, elems = 0, stride = 0;
  std::string why;
};

// Whole blocks (4-byte scale + int8 values each) per piece when `pieces` pieces share `budget`.
size_t blocks_fitting(size_t budget, int pieces, size_t block) {
  const size_t each = budget / size_t(pieces);
  return each > kLine ? (each - kLine) / (sizeof(float) + block) : 0;
}

// `pieces` pieces per round in `budget` bytes of a half; a block too large for the budget takes a
// whole half per round.
Plan plan(const Comm& c, DType dt, size_t block, int pieces, size_t budget) {
  Plan p;
  p.block = block;
  if (dt != DType::F32 && dt != DType::BF16) {
    p.why = std::string("quantizes float32 and bfloat16, not ") + dtype_name(dt);
    return p;
  }
  if (block < 16 || block > 65536 || block % 16 != 0) {
    p.why = "a block must be a multiple of 16 elements from 16 to 65536, not " +
            std::to_string(block);
    return p;
  }
  size_t k = blocks_fitting(budget, pieces, block);
  if (k == 0) k = blocks_fitting(half_bytes(c), pieces, block);
  if (k == 0) {
    p.why = "a round holds " + std::to_string(pieces) + " piece(s) of at least one block of " +
            std::to_string(block) + " elements (" + std::to_string(pieces) + " x " +
            std::to_string(sizeof(float) + block) + " bytes), more than half a slot (" +
            std::to_string(half_bytes(c)) + " bytes)";
    return p;
  }
  p.elems = k * block;
  p.stride = (k * (sizeof(float) + block) + kLine - 1) / kLine * kLine;
  return p;
}

// A quantized piece of n elements in a half: its ceil(n / block) scales, then its int8 values.
struct Piece {
  float* scales;
  int8_t* q;
};

Piece piece(char* half_base, const Plan& p, int j, size_t n) {
  char* at = half_base + size_t(j) * p.stride;
  return {reinterpret_cast<float*>(at),
          reinterpret_cast<int8_t*>(at + sizeof(float) * quant_blocks(n, p.block))};
}

// The call's first signal: the descriptors compared (a mismatch fails every rank), then the
// plan's verdict, which every rank shares once they agree on the arguments.
void first_round(Comm& c, const Desc& d, const Plan& p) {
  first_round_sync(c, d);
  if (!p.why.empty())
    fail(c, ErrorKind::Other,
         std::string("fastpar shm ") + kind_name(Kind(d.kind)) + ": " + p.why);
}

// Sums are taken a tile of whole blocks at a time (about kTile elements, or one larger block),
// so that a tile's partial sums stay in L1 while every rank's piece is added to them.
size_t tile_elems(size_t block) { return block > kTile ? block : kTile / block * block; }

// Where sums are kept when they cannot be taken where they lie: a tile, on the stack unless a
// block is larger.
class Tile {
 public:
  explicit Tile(size_t block) : n_(tile_elems(block)) {
    if (n_ > kTile) heap_.reset(new float[n_]);
  }
  float* data() { return heap_ ? heap_.get() : stack_; }

 private:
  size_t n_;
  alignas(64) float stack_[kTile];
  std::unique_ptr<float[]> heap_;
};

// The float32 sum, in rank order 0..world-1, of piece j (n elements) of every rank's half of
// this round, a tile at a time: each block's sum is complete when emit(t0, sums, len) sees it,
// which may then overwrite those blocks of this rank's own piece j. in_place: the sums of
// elements [t0, t0 + len) go to acc + t0 (acc holds n float32: a float32 output is summed where
// it lies, as copying it out of a tile would be one more pass over it); else every tile's go
// to acc itself (a Tile).
template <class Emit>
void sum_pieces(const Comm& c, const Plan& p, int j, size_t n, float* acc, bool in_place,
                QuantPath path, Emit emit) {
  Piece in[kMaxWorld];
  for (int r = 0; r < c.world; ++r) in[r] = piece(half(c, r, c.rounds), p, j, n);
  const size_t step = tile_elems(p.block);
  for (size_t t0 = 0; t0 < n; t0 += step) {
    const size_t len = std::min(step, n - t0);
    float* sums = in_place ? acc + t0 : acc;
    for (int r = 0; r < c.world; ++r)
      quant_accumulate(path, in[r].scales + t0 / p.block, in[r].q + t0, len, p.block, sums,
                       r == 0);
    emit(t0, sums, len);
  }
}

}  // namespace

void quantized_all_gather(Comm& c, const void* in, void* out, size_t count, DType dt,
                          size_t block) {
  const Desc d = begin_call(c, Kind::QuantAllGather, dt, Op::Sum, count, 0, block);
  const Plan p = plan(c, dt, block, 1, c.chunk_bytes);
  const QuantPath path = quant_path();
  const size_t es = dtype_size(dt);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // One piece per rank per round; at least one round, so a rank with nothing still meets the
  // others. Own piece decoded from the half too: `in` may alias out + rank * count.
  size_t off = 0;
  do {
    const size_t n = std::min(p.elems, count - off);
    if (p.why.empty()) {
      const Piece mine = piece(half(c, c.rank, c.rounds), p, 0, n);
      quant_encode(path, src + off * es, dt, n, nullptr, 0, Feedback::None, n, block,
                   mine.scales, mine.q);
    }
    if (off == 0)
      first_round(c, d, p);
    else
      signal_and_wait(c, Kind::QuantAllGather);
    for (int r = 0; r < c.world; ++r) {
      const Piece theirs = piece(half(c, r, c.rounds), p, 0, n);
      quant_decode(path, theirs.scales, theirs.q, n, block,
                   dst + (size_t(r) * count + off) * es, dt);
    }
    ++c.rounds;
    off += n;
  } while (off < count);
}

void quantized_reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType dt,
                              size_t block, float* residual) {
  const Desc d = begin_call(c, Kind::QuantReduceScatter, dt, Op::Sum, count, 0, block);
  const Plan p = plan(c, dt, block, c.world, half_bytes(c));
  const QuantPath path = quant_path();
  const size_t es = dtype_size(dt);
  const Feedback fb = residual != nullptr ? Feedback::Replace : Feedback::None;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // A float32 output holds its own sums; a bfloat16 one is summed in a tile, then rounded out.
  std::optional<Tile> tile;
  if (dt != DType::F32) tile.emplace(p.elems != 0 ? block : 16);
  // Per round, piece j of this rank's half holds elements [off, off + n) of its chunk j
  // (in[j*count + off ...], blocks counted from the chunk's start); rank r sums piece r of
  // every half straight into `out`.
  size_t off = 0;
  do {
    const size_t n = std::min(p.elems, count - off);
    if (p.why.empty()) {
      char* mine = half(c, c.rank, c.rounds);
      for (int j = 0; j < c.world; ++j) {
        const size_t at = size_t(j) * count + off;
        const Piece to = piece(mine, p, j, n);
        quant_encode(path, src + at * es, dt, n, residual ? residual + at : nullptr, n, fb, n,
                     block, to.scales, to.q);
      }
    }
    if (off == 0)
      first_round(c, d, p);
    else
      signal_and_wait(c, Kind::QuantReduceScatter);
    if (tile) {
      sum_pieces(c, p, c.rank, n, tile->data(), false, path,
                 [&](size_t t0, const float* sums, size_t len) {
                   quant_narrow(path, sums, len, dst + (off + t0) * es, dt);
                 });
    } else {  // `out` may be this rank's chunk of `in`: its window was encoded above already
      sum_pieces(c, p, c.rank, n, reinterpret_cast<float*>(dst) + off, true, path,
                 [](size_t, const float*, size_t) {});
    }
    ++c.rounds;
    off += n;
  } while (off < count);
}

void quantized_all_reduce(Comm& c, void* data, size_t count, DType dt, size_t block,
                          float* residual) {
  const Desc d = begin_call(c, Kind::QuantAllReduce, dt, Op::Sum, count, 0, block);
  const Plan p = plan(c, dt, block, c.world, c.chunk_bytes);
  const QuantPath path = quant_path();
  const size_t es = dtype_size(dt);
  const Feedback fb = residual != nullptr ? Feedback::Replace : Feedback::None;
  char* buf = static_cast<char*>(data);
  Tile tile(p.elems != 0 ? block : 16);  // each chunk's sum, quantized again out of it
  // Chunk j is [j*m, (j+1)*m) of the data, zeros past `count`; a round takes the window
  // [off, off + n) of every chunk. held(j): how much of chunk j's window the data holds.
  const size_t m = (count + c.world - 1) / c.world;
  size_t off = 0, n = 0;
  auto held = [&](int j) {
    const size_t g = size_t(j) * m + off;
    return g < count ? std::min(n, count - g) : size_t(0);
  };
  do {
    n = std::min(p.elems, m - off);
    char* mine = half(c, c.rank, c.rounds);
    if (p.why.empty()) {
      for (int j = 0; j < c.world; ++j) {
        const size_t g = size_t(j) * m + off, v = held(j);
        const Piece to = piece(mine, p, j, n);
        quant_encode(path, v ? buf + g * es : nullptr, dt, v,
                     v && residual ? residual + g : nullptr, v, fb, n, block, to.scales, to.q);
      }
    }
    if (off == 0)
      first_round(c, d, p);
    else
      signal_and_wait(c, Kind::QuantAllReduce);
    // This rank's chunk: the sum of every rank's piece, quantized again into this rank's own
    // piece of it, which only this rank read; the rounding of that goes into the residual.
    const Piece own = piece(mine, p, c.rank, n);
    const size_t g = size_t(c.rank) * m + off, v = held(c.rank);
    sum_pieces(c, p, c.rank, n, tile.data(), false, path,
               [&](size_t t0, const float* acc, size_t len) {
                 const size_t vr = residual && v > t0 ? std::min(len, v - t0) : 0;
                 quant_encode(path, acc, DType::F32, len, vr ? residual + g + t0 : nullptr, vr,
                              residual ? Feedback::Add : Feedback::None, len, block,
                              own.scales + t0 / block, own.q + t0);
               });
    signal_and_wait(c, Kind::QuantAllReduce);  // every chunk's sum is in its owner's half
    for (int r = 0; r < c.world; ++r) {
      const Piece sum = piece(half(c, r, c.rounds), p, r, n);
      quant_decode(path, sum.scales, sum.q, held(r), block, buf + (size_t(r) * m + off) * es,
                   dt);
    }
    ++c.rounds;
    off += n;
  } while (off < m);
}

}  // namespace shm
}  // namespace fastpar

// Standalone multi-process test + timing for the shm collectives kernel (no torch).
//
//   g++ -O3 -std=c++17 -ffp-contract=off -pthread csrc/shm/*.cpp -o /tmp/shm_selftest  # repo root
//   /tmp/shm_selftest                          # conversions, worlds 1,2,3,4, then timing
//   /tmp/shm_selftest --bench-only [--sweep]   # world-2 timing only
//   /tmp/shm_selftest --no-bench               # correctness only (tests/test_shm_kernel.py)
//
// Each world forks `world` children that share MAP_SHARED|MAP_ANONYMOUS segments mapped
// (and initialised) by the parent before the fork. A child reports failure by exit code.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shm_collectives.h"
#include "shm_quant.h"

using namespace fastpar::shm;

namespace {

#define CHECK(cond, ...)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      char buf_[512];                                                         \
      std::snprintf(buf_, sizeof buf_, __VA_ARGS__);                          \
      throw std::runtime_error(std::string(#cond " failed: ") + buf_);        \
    }                                                                         \
  } while (0)

void* map_segment(int world, size_t slot, size_t small_max = kDefaultSmallMaxBytes,
                  size_t chunk = kDefaultChunkBytes) {
  void* p = mmap(nullptr, segment_bytes(world, slot), PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
  init_segment(p, world, slot, small_max, chunk);
  return p;
}

// Runs fn(rank) in `world` forked children; true if all exit 0.
bool run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<pid_t> pids;
  std::fflush(stdout);
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      try {
        fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "  [world %d rank %d] FAIL: %s\n", world, r, e.what());
        std::fflush(stderr);
        _exit(1);
      }
      std::fflush(stdout);
      _exit(0);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  return ok;
}

// ---- typed values ----------------------------------------------------------------

double load(DType dt, const void* p, size_t i) {
  switch (dt) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0;
}
void store(DType dt, void* p, size_t i, double v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(p)[i] = float(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(float(v)); break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(float(v)); break;
  }
}
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
// Input of `rank` at index i, exactly representable in dt. Integers in [-3, 3] make sums
// exact in every dtype; uniform floats in [-1, 1) exercise rounding.
double gen(DType dt, bool integer, int rank, size_t i, uint64_t salt) {
  uint64_t h = mix(i * 1315423911ULL + uint64_t(rank) * 2654435761ULL + salt);
  double v = integer ? double(int(h % 7) - 3) : double(h >> 11) * 0x1p-52 - 1.0;
  uint8_t tmp[8];
  store(dt, tmp, 0, v);
  return load(dt, tmp, 0);
}
double eps(DType dt) {
  switch (dt) {
    case DType::F32: return 0x1p-23;
    case DType::F64: return 0x1p-52;
    case DType::BF16: return 0x1p-7;
    case DType::F16: return 0x1p-10;
  }
  return 0;
}
uint64_t hash_bytes(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ULL;
  return h;
}
// Every rank's output must be bitwise identical: all_gather the hashes and compare.
void check_identical(Comm& c, const void* p, size_t n, const char* what) {
  uint64_t h = hash_bytes(p, n);
  std::vector<uint64_t> all(c.world);
  all_gather(c, &h, all.data(), sizeof h);
  for (int r = 0; r < c.world; ++r)
    CHECK(all[r] == all[0], "%s: rank %d output differs bitwise from rank 0", what, r);
}

const DType kDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
const Op kOps[] = {Op::Sum, Op::Max};
// The largest spans two 1 MiB chunks in float32 and float64 (the tiny segment below chunks
// every dtype many times).
const size_t kSizes[] = {1, 7, 4099, (size_t(1) << 18) + 3};

void check_reduced(DType dt, Op op, bool integer, const void* out, size_t n, int world,
                   const std::function<double(int, size_t)>& input, const char* what) {
  for (size_t i = 0; i < n; ++i) {
    double ref = input(0, i), mag = std::fabs(ref);
    for (int r = 1; r < world; ++r) {
      double x = input(r, i);
      ref = op == Op::Sum ? ref + x : std::max(ref, x);
      mag += std::fabs(x);
    }
    double got = load(dt, out, i);
    double tol = (op == Op::Max || integer) ? 0.0 : 2 * eps(dt) * mag;
    CHECK(std::fabs(got - ref) <= tol, "%s %s n=%zu i=%zu: got %.9g want %.9g", what,
          dtype_name(dt), n, i, got, ref);
  }
}

// ---- int8: the codec's loops (one process) and the quantized collectives -----------------

const QuantPath kPaths[] = {QuantPath::Scalar, QuantPath::Avx2, QuantPath::Avx512};

bool same_bytes(const void* a, const void* b, size_t n) { return std::memcmp(a, b, n) == 0; }

// The codec's definition written out (shm_quant.h), apart from the kernel's loops.
void ref_quantize(const float* x, size_t n, size_t block, float* scales, int8_t* q) {
  for (size_t b = 0; b < n; b += block) {
    const size_t len = std::min(block, n - b);
    float amax = 0;
    bool finite = true;
    for (size_t i = 0; i < len; ++i) {
      finite = finite && std::isfinite(x[b + i]);
      amax = std::max(amax, std::fabs(x[b + i]));
    }
    float scale = 0, inv = 0;
    if (!finite) {
      scale = NAN;
    } else if (amax > 0) {
      scale = amax / 127.0f;
      inv = 127.0f / amax;
    }
    scales[b / block] = scale;
    for (size_t i = 0; i < len; ++i) {
      const float p = x[b + i] * inv;  // NaN: 0 * inf where 127 / amax overflowed
      q[b + i] = !finite || p != p
                     ? 0
                     : int8_t(std::nearbyint(std::fmin(127.f, std::fmax(-127.f, p))));
    }
  }
}

// Blocks of every kind: random magnitudes, elements at the rounding ties of x * inv, a zero
// block, +inf, -inf, NaN, a block whose 127 / amax overflows, subnormals.
std::vector<float> codec_input(size_t n, size_t block, uint64_t salt) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = mix(i * 7919 + salt);
    x[i] = float(gen(DType::F32, false, 0, i, salt) * std::ldexp(1.0, int(h % 40) - 20));
  }
  for (size_t b = 0, kind = 0; b < n; b += block, ++kind) {
    const size_t len = std::min(block, n - b);
    float* blk = x.data() + b;
    switch (kind % 8) {
      case 1: std::fill(blk, blk + len, 0.0f); break;
      case 2: blk[len / 2] = INFINITY; break;
      case 3: blk[len - 1] = -INFINITY; break;
      case 4: blk[0] = NAN; break;
      case 5:  // 127 / amax overflows: q is +-127 by sign, 0 for zeros
        for (size_t i = 0; i < len; ++i) blk[i] = i % 3 == 0 ? 0.0f : (i % 2 ? 1e-38f : -2e-39f);
        break;
      case 6: {  // ties: amax 1, elements at (k + 0.5) / inv and their neighbours
        const float inv = 127.0f / 1.0f;
        blk[0] = 1.0f;
        for (size_t i = 1; i < len; ++i) {
          const float t = float((double(i % 127) + 0.5) / inv);
          blk[i] = i % 3 == 0 ? t : std::nextafter(t, i % 3 == 1 ? 0.0f : 2.0f);
        }
        break;
      }
      case 7: blk[1] = 1e-42f; break;  // a subnormal among normals
    }
  }
  return x;
}

// Every path's encode, decode, accumulate and narrow against the scalar path, bitwise, and
// the scalar path's q and scales against the definition; f32 and bf16, each feedback mode, a
// piece padded past its data, odd lengths (vector tails), pointers off alignment.
bool test_codec() {
  bool ok = true;
  auto expect = [&](bool cond, const char* what, QuantPath path, DType dt, size_t block) {
    if (!cond) std::printf("codec %s: %s path, %s, block %zu\n", what, quant_path_name(path),
                           dtype_name(dt), block);
    ok = ok && cond;
  };
  for (size_t block : {16, 48, 256}) {
    const size_t n = 19 * block + 5, nb = quant_blocks(n, block), nx = n - block - 3;
    const std::vector<float> x32 = codec_input(n, block, block);
    for (DType dt : {DType::F32, DType::BF16}) {
      const size_t es = dtype_size(dt);
      std::vector<uint8_t> xs((n + 1) * es);
      const void* x = xs.data() + es;  // off alignment
      std::vector<float> padded(n, 0.0f);  // what the codec sees: x in dt, widened, zeros past nx
      for (size_t i = 0; i < n; ++i) {
        store(dt, xs.data(), i + 1, x32[i]);
        if (i < nx) padded[i] = float(load(dt, x, i));
      }
      std::vector<float> ref_s(nb), res0(n);
      std::vector<int8_t> ref_q(n);
      ref_quantize(padded.data(), n, block, ref_s.data(), ref_q.data());
      for (size_t i = 0; i < n; ++i) res0[i] = float(gen(DType::F32, false, 5, i, block)) * 1e-3f;
      struct Out {
        std::vector<float> s, res, acc, f32;
        std::vector<int8_t> q;
        std::vector<uint16_t> b16;
      };
      Out want[3];
      for (QuantPath path : kPaths) {
        if (!set_quant_path(path)) continue;
        Out o[3];
        for (int f = 0; f < 3; ++f) {
          o[f].s.assign(nb, 0);
          o[f].q.assign(n, 1);
          o[f].res = res0;
          // Add: the residual covers less than the data, as an all_reduce owner's last chunk
          const size_t nres = f == 2 ? nx - 7 : nx;
          quant_encode(path, x, dt, nx, f ? o[f].res.data() : nullptr, f ? nres : 0, Feedback(f),
                       n, block, o[f].s.data(), o[f].q.data());
          o[f].acc.assign(n, 3.0f);
          quant_accumulate(path, o[f].s.data(), o[f].q.data(), n, block, o[f].acc.data(), f == 0);
          o[f].f32.assign(n + 1, 0);
          o[f].b16.assign(n + 1, 0);
          quant_decode(path, o[f].s.data(), o[f].q.data(), n, block, o[f].f32.data() + 1,
                       DType::F32);
          quant_decode(path, o[f].s.data(), o[f].q.data(), n, block, o[f].b16.data() + 1,
                       DType::BF16);
          quant_narrow(path, o[f].acc.data(), n, o[f].b16.data(), DType::BF16);
        }
        if (path == QuantPath::Scalar) {
          std::copy(o, o + 3, want);
          expect(same_bytes(o[0].s.data(), ref_s.data(), nb * 4) &&
                 same_bytes(o[0].q.data(), ref_q.data(), n), "definition", path, dt, block);
          // with Replace the codec quantizes x + res: the definition on that sum
          std::vector<float> sum(n, 0.0f), s2(nb);
          std::vector<int8_t> q2(n);
          for (size_t i = 0; i < nx; ++i) sum[i] = padded[i] + res0[i];
          ref_quantize(sum.data(), n, block, s2.data(), q2.data());
          expect(same_bytes(o[1].s.data(), s2.data(), nb * 4) &&
                 same_bytes(o[1].q.data(), q2.data(), n), "definition (x + res)", path, dt, block);
          continue;
        }
        for (int f = 0; f < 3; ++f)
          expect(same_bytes(o[f].s.data(), want[f].s.data(), nb * 4) &&
                 same_bytes(o[f].q.data(), want[f].q.data(), n) &&
                 same_bytes(o[f].res.data(), want[f].res.data(), n * 4) &&
                 same_bytes(o[f].acc.data(), want[f].acc.data(), n * 4) &&
                 same_bytes(o[f].f32.data(), want[f].f32.data(), (n + 1) * 4) &&
                 same_bytes(o[f].b16.data(), want[f].b16.data(), (n + 1) * 2),
                 f == 0 ? "vs scalar" : f == 1 ? "vs scalar (replace)" : "vs scalar (add)",
                 path, dt, block);
      }
      // the special blocks, as defined: zeros, NaN scale, +-127 where inv overflowed
      const std::vector<float>& s = want[0].s;
      const std::vector<int8_t>& q = want[0].q;
      expect(s[1] == 0 && q[block] == 0 && std::isnan(s[2]) && std::isnan(s[3]) &&
             std::isnan(s[4]) && q[2 * block] == 0 && std::isnan(want[0].f32[2 * block + 1]) &&
             q[5 * block] == 0 && q[5 * block + 1] == 127 && q[5 * block + 2] == -127 &&
             want[0].f32[block + 1] == 0.0f, "special blocks", QuantPath::Scalar, dt, block);
      for (size_t i = nx; i < n; ++i) expect(q[i] == 0, "padding", QuantPath::Scalar, dt, block);
      // error feedback drops what a non-finite block (2: inf, 3: -inf, 4: NaN) carried: its
      // residual is 0 (were it src - y, NaN, every later call would quantize x + NaN there),
      // and a finite block's is finite
      for (int f = 1; f < 3; ++f) {
        bool dropped = true;
        for (size_t i = 0; i < (f == 2 ? nx - 7 : nx); ++i) {
          const bool special = i >= 2 * block && i < 5 * block;
          dropped = dropped && (special ? want[f].res[i] == 0.0f : std::isfinite(want[f].res[i]));
        }
        expect(dropped, f == 1 ? "non-finite residual (replace)" : "non-finite residual (add)",
               QuantPath::Scalar, dt, block);
      }
    }
  }
  std::printf("int8 codec: %s (paths:", ok ? "PASS" : "FAIL");
  for (QuantPath path : kPaths)  // the last that runs stays chosen: the fastest
    if (set_quant_path(path)) std::printf(" %s", quant_path_name(path));
  std::printf(")\n");
  return ok;
}

// ---- correctness per world ---------------------------------------------------------

void test_reductions(Comm& c) {
  const int w = c.world;
  for (DType dt : kDTypes)
    for (Op op : kOps)
      for (size_t n : kSizes)
        for (bool integer : {true, false}) {
          uint64_t salt = n * 31 + uint64_t(dt) * 7 + uint64_t(op) + integer;
          auto input = [&](int r, size_t i) { return gen(dt, integer, r, i, salt); };
          const size_t es = dtype_size(dt);
          // all_reduce
          std::vector<uint8_t> buf(n * es);
          for (size_t i = 0; i < n; ++i) store(dt, buf.data(), i, input(c.rank, i));
          all_reduce(c, buf.data(), n, dt, op);
          check_reduced(dt, op, integer, buf.data(), n, w, input, "all_reduce");
          check_identical(c, buf.data(), buf.size(), "all_reduce");
          // reduce_scatter: rank r's block j is input(r, j*n + i)
          std::vector<uint8_t> in(w * n * es), out(n * es);
          for (size_t i = 0; i < w * n; ++i) store(dt, in.data(), i, input(c.rank, i));
          reduce_scatter(c, in.data(), out.data(), n, dt, op);
          auto block = [&](int r, size_t i) { return input(r, c.rank * n + i); };
          check_reduced(dt, op, integer, out.data(), n, w, block, "reduce_scatter");
        }
}

void test_gather_broadcast(Comm& c) {
  const int w = c.world;
  for (size_t n : kSizes) {
    auto byte = [&](int r, size_t i) { return uint8_t(mix(i * 977 + r * 131 + n)); };
    std::vector<uint8_t> in(n), out(w * n);
    for (size_t i = 0; i < n; ++i) in[i] = byte(c.rank, i);
    all_gather(c, in.data(), out.data(), n);
    for (int r = 0; r < w; ++r)
      for (size_t i = 0; i < n; ++i)
        CHECK(out[r * n + i] == byte(r, i), "all_gather n=%zu block %d byte %zu", n, r, i);
    // in place: `in` aliases out + rank * n
    std::fill(out.begin(), out.end(), 0);
    std::memcpy(out.data() + c.rank * n, in.data(), n);
    all_gather(c, out.data() + c.rank * n, out.data(), n);
    for (int r = 0; r < w; ++r)
      for (size_t i = 0; i < n; ++i)
        CHECK(out[r * n + i] == byte(r, i), "in-place all_gather n=%zu block %d", n, r);
    for (int root : {0, w - 1}) {
      std::vector<uint8_t> b(n);
      for (size_t i = 0; i < n; ++i) b[i] = byte(c.rank, i);
      broadcast(c, b.data(), n, root);
      for (size_t i = 0; i < n; ++i)
        CHECK(b[i] == byte(root, i), "broadcast n=%zu root %d byte %zu", n, root, i);
    }
  }
}

void test_many_tiny(Comm& c) {
  const int w = c.world, iters = 5000;
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it) {
    float x = float(c.rank + it);
    all_reduce(c, &x, 1, DType::F32, Op::Sum);
    CHECK(x == float(w * it + w * (w - 1) / 2), "tiny call %d: got %g", it, x);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (c.rank == 0) std::printf("  world %d: %d tiny all_reduces in %.1f ms\n", w, iters, s * 1e3);
}

// Segment a (all ranks) and b (even ranks, a tiny 16 KiB slot so big calls chunk a lot)
// used alternately must not interfere.
void test_two_segments(Comm& a, Comm* b) {
  for (int it = 0; it < 1000; ++it) {
    size_t na = it % 100 == 0 ? 70001 : 3, nb = it % 100 == 50 ? 50003 : 5;
    std::vector<float> va(na, float(a.rank + it)), vb(nb, float(2 * it));
    all_reduce(a, va.data(), na, DType::F32, Op::Sum);
    float want = float(a.world * it + a.world * (a.world - 1) / 2);
    CHECK(va[0] == want && va[na - 1] == want, "segment a iter %d", it);
    if (b) {
      vb[nb - 1] = float(b->rank);
      all_reduce(*b, vb.data(), nb, DType::F32, Op::Max);
      CHECK(vb[0] == float(2 * it) && vb[nb - 1] == float(b->world - 1), "segment b iter %d", it);
    }
  }
}

// A piece of n elements quantized by the scalar path, whole (no rounds): the reference.
struct RefPiece {
  std::vector<float> s;
  std::vector<int8_t> q;
};
RefPiece ref_piece(const void* x, DType dt, size_t nx, float* res, size_t nres, Feedback fb,
                   size_t n, size_t block) {
  RefPiece p{std::vector<float>(quant_blocks(n, block)), std::vector<int8_t>(n)};
  quant_encode(QuantPath::Scalar, x, dt, nx, res, nres, fb, n, block, p.s.data(), p.q.data());
  return p;
}

// The int8 collectives against the codec applied by hand to every rank's input: every path,
// float32 and bfloat16, with and without a residual, bitwise. On a segment with a 16 KiB slot
// every call takes many rounds.
void test_quantized(Comm& c, std::initializer_list<size_t> sizes) {
  const int w = c.world, me = c.rank;
  for (DType dt : {DType::F32, DType::BF16})
    for (size_t block : {16, 256})
      for (size_t n : sizes) {
        const size_t es = dtype_size(dt), total = w * n, m = (n + w - 1) / w;
        const uint64_t salt = n * 131 + block + uint64_t(dt);
        std::vector<std::vector<uint8_t>> xs(w);  // rank r's input: w*n elements, a zero block
        std::vector<std::vector<float>> rs(w);    // and its residual
        for (int r = 0; r < w; ++r) {
          xs[r].resize(total * es);
          rs[r].resize(total);
          for (size_t i = 0; i < total; ++i) {
            const double v = (i / block) % 5 == 1 ? 0.0 : gen(dt, false, r, i, salt) * (r + 1);
            store(dt, xs[r].data(), i, v);
            rs[r][i] = float(gen(DType::F32, false, r + 7, i, salt)) * 1e-2f;
          }
        }
        auto x_at = [&](int r, size_t i) { return xs[r].data() + i * es; };
        // all_gather of each rank's first n elements
        std::vector<uint8_t> want(total * es), out(total * es);
        for (int r = 0; r < w; ++r) {
          const RefPiece p = ref_piece(x_at(r, 0), dt, n, nullptr, 0, Feedback::None, n, block);
          quant_decode(QuantPath::Scalar, p.s.data(), p.q.data(), n, block,
                       want.data() + r * n * es, dt);
        }
        for (QuantPath path : kPaths) {
          if (!set_quant_path(path)) continue;
          quantized_all_gather(c, x_at(me, 0), out.data(), n, dt, block);
          CHECK(same_bytes(out.data(), want.data(), out.size()),
                "int8 all_gather %s %s block %zu n=%zu", quant_path_name(path), dtype_name(dt),
                block, n);
        }
        for (bool feedback : {false, true}) {
          const Feedback fb = feedback ? Feedback::Replace : Feedback::None;
          // reduce_scatter: this rank's chunk of every rank, summed in rank order
          std::vector<float> acc(std::max(n, m)), want_res = rs[me];
          std::vector<uint8_t> want_rs(n * es), got(n * es);
          for (int p = 0; p < w; ++p) {
            std::vector<float> res = rs[p];
            float* r = feedback ? res.data() + me * n : nullptr;
            const RefPiece pc = ref_piece(x_at(p, me * n), dt, n, r, n, fb, n, block);
            quant_accumulate(QuantPath::Scalar, pc.s.data(), pc.q.data(), n, block, acc.data(),
                             p == 0);
          }
          quant_narrow(QuantPath::Scalar, acc.data(), n, want_rs.data(), dt);
          for (int j = 0; feedback && j < w; ++j)
            ref_piece(x_at(me, j * n), dt, n, want_res.data() + j * n, n, fb, n, block);
          for (QuantPath path : kPaths) {
            if (!set_quant_path(path)) continue;
            std::vector<float> res = rs[me];
            quantized_reduce_scatter(c, x_at(me, 0), got.data(), n, dt, block,
                                     feedback ? res.data() : nullptr);
            CHECK(same_bytes(got.data(), want_rs.data(), got.size()) &&
                  (!feedback || same_bytes(res.data(), want_res.data(), res.size() * 4)),
                  "int8 reduce_scatter %s %s block %zu n=%zu feedback %d", quant_path_name(path),
                  dtype_name(dt), block, n, feedback);
            // in place: out is this rank's own chunk of in (a float32 output sums into it)
            std::vector<uint8_t> inout(xs[me]);
            res = rs[me];
            quantized_reduce_scatter(c, inout.data(), inout.data() + me * n * es, n, dt, block,
                                     feedback ? res.data() : nullptr);
            CHECK(same_bytes(inout.data() + me * n * es, want_rs.data(), got.size()) &&
                  (!feedback || same_bytes(res.data(), want_res.data(), res.size() * 4)),
                  "int8 reduce_scatter in place %s %s block %zu n=%zu feedback %d",
                  quant_path_name(path), dtype_name(dt), block, n, feedback);
          }
          // all_reduce of each rank's first n elements: chunks of m, zeros past n, each
          // chunk's float32 sum quantized again (its owner's rounding into its residual)
          std::vector<uint8_t> want_ar(n * es), data(n * es);
          want_res.assign(rs[me].begin(), rs[me].begin() + n);
          for (int j = 0; j < w; ++j) {
            const size_t at = j * m, held = at < n ? std::min(m, n - at) : 0;
            for (int p = 0; p < w; ++p) {
              std::vector<float> res = rs[p];
              const RefPiece pc = ref_piece(held ? x_at(p, at) : nullptr, dt, held,
                                            feedback && held ? res.data() + at : nullptr, held,
                                            fb, m, block);
              if (p == me && feedback)
                std::copy(res.begin() + at, res.begin() + at + held, want_res.begin() + at);
              quant_accumulate(QuantPath::Scalar, pc.s.data(), pc.q.data(), m, block, acc.data(),
                               p == 0);
            }
            const bool mine = feedback && j == me && held;
            const RefPiece sum =
                ref_piece(acc.data(), DType::F32, m, mine ? want_res.data() + at : nullptr,
                          mine ? held : 0, mine ? Feedback::Add : Feedback::None, m, block);
            quant_decode(QuantPath::Scalar, sum.s.data(), sum.q.data(), held, block,
                         want_ar.data() + at * es, dt);
          }
          for (QuantPath path : kPaths) {
            if (!set_quant_path(path)) continue;
            std::vector<float> res(rs[me].begin(), rs[me].begin() + n);
            std::memcpy(data.data(), x_at(me, 0), n * es);
            quantized_all_reduce(c, data.data(), n, dt, block, feedback ? res.data() : nullptr);
            CHECK(same_bytes(data.data(), want_ar.data(), data.size()) &&
                  (!feedback || same_bytes(res.data(), want_res.data(), n * 4)),
                  "int8 all_reduce %s %s block %zu n=%zu feedback %d", quant_path_name(path),
                  dtype_name(dt), block, n, feedback);
          }
        }
      }
}

void expect_throw(const std::function<void()>& f, std::vector<std::string> needles,
                  const char* what) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    for (const std::string& s : needles)
      CHECK(msg.find(s) != std::string::npos, "%s: message lacks '%s': %s", what, s.c_str(),
            msg.c_str());
    return;
  }
  CHECK(false, "%s: expected an exception", what);
}

bool run_world(int world) {
  const size_t slot = kDefaultSlotBytes, tiny_slot = 16384;
  void* seg = map_segment(world, slot);
  const int sub_world = (world + 1) / 2;
  void* sub = map_segment(sub_world, tiny_slot, 2048, 4096);
  void* mm[3] = {map_segment(world, slot), map_segment(world, slot), map_segment(world, slot)};
  void* tmo = map_segment(world, slot);
  void* qtiny = map_segment(world, tiny_slot, 2048, 4096);
  void* qmm[5];
  for (void*& q : qmm) q = map_segment(world, tiny_slot, 2048, 4096);
  auto t0 = std::chrono::steady_clock::now();
  bool ok = run_ranks(world, [&](int rank) {
    Comm c = attach(seg, rank, world, slot);
    test_reductions(c);
    test_gather_broadcast(c);
    test_many_tiny(c);
    Comm sc;
    if (rank % 2 == 0) sc = attach(sub, rank / 2, sub_world, tiny_slot);
    test_two_segments(c, rank % 2 == 0 ? &sc : nullptr);
    test_quantized(c, {1, 33, 4099});
    Comm qc = attach(qtiny, rank, world, tiny_slot);
    test_quantized(qc, {1000, 20011});  // many rounds per call
    if (world < 2) return;
    // Mismatches: every rank must throw the same message, then fail fast.
    struct Case { size_t n1; DType dt1; const char* want1; const char* want0; };
    const Case cases[3] = {{1024, DType::F32, "1024 float32", "2048 float32"},
                           {2048, DType::BF16, "2048 bfloat16", "2048 float32"},
                           {size_t(1) << 20, DType::F32, "1048576 float32", "2048 float32"}};
    for (int k = 0; k < 3; ++k) {
      Comm m = attach(mm[k], rank, world, slot);
      m.timeout_s = 20;
      bool odd = rank == 1;
      size_t n = odd ? cases[k].n1 : 2048;
      DType dt = odd ? cases[k].dt1 : DType::F32;
      std::vector<double> buf(size_t(1) << 20);
      expect_throw([&] { all_reduce(m, buf.data(), n, dt, Op::Sum); },
                   {"all_reduce", "rank 1 passed", cases[k].want1, "rank 0 passed",
                    cases[k].want0}, "mismatch");
      expect_throw([&] { all_reduce(m, buf.data(), 4, DType::F32, Op::Sum); }, {"poisoned"},
                   "after mismatch");
    }
    // int8 mismatches (block, dtype, kind, count) and a block too large for the slot: every
    // rank throws the same message, then fails fast.
    std::vector<float> qbuf(size_t(world) * 4096), qout(qbuf.size());
    const bool odd = rank == 1;
    const std::function<void(Comm&)> qcases[5] = {
        [&](Comm& m) {
          quantized_all_reduce(m, qbuf.data(), 1000, DType::F32, odd ? 64 : 256, nullptr);
        },
        [&](Comm& m) {
          quantized_all_reduce(m, qbuf.data(), 1000, odd ? DType::BF16 : DType::F32, 256, nullptr);
        },
        [&](Comm& m) {
          if (odd) return all_reduce(m, qbuf.data(), 1000, DType::F32, Op::Sum);
          quantized_all_reduce(m, qbuf.data(), 1000, DType::F32, 256, nullptr);
        },
        [&](Comm& m) {
          quantized_reduce_scatter(m, qbuf.data(), qout.data(), odd ? 999 : 1000, DType::F32, 64,
                                   nullptr);
        },
        [&](Comm& m) { quantized_all_gather(m, qbuf.data(), qout.data(), 64, DType::F32, 8192); }};
    const std::vector<std::string> qwant[5] = {
        {"all_reduce (int8)", "rank 1 passed 1000 float32 elements in blocks of 64",
         "rank 0 passed 1000 float32 elements in blocks of 256"},
        {"all_reduce (int8)", "rank 1 passed 1000 bfloat16", "rank 0 passed 1000 float32"},
        {"rank 1 passed all_reduce of 1000 float32 elements (sum)",
         "rank 0 passed all_reduce (int8) of 1000 float32 elements in blocks of 256"},
        {"reduce_scatter (int8)", "rank 1 passed 999 float32", "rank 0 passed 1000 float32"},
        {"all_gather (int8)", "1 piece(s) of at least one block of 8192 elements (1 x 8196 "
                              "bytes), more than half a slot (8192 bytes)"}};
    for (int k = 0; k < 5; ++k) {
      Comm m = attach(qmm[k], rank, world, tiny_slot);
      m.timeout_s = 20;
      expect_throw([&] { qcases[k](m); }, qwant[k], "int8 mismatch");
      expect_throw([&] { quantized_all_gather(m, qbuf.data(), qout.data(), 4, DType::F32, 16); },
                   {"poisoned"}, "after int8 mismatch");
    }
    // A peer that never arrives: the others time out naming it; it then fails fast.
    Comm t = attach(tmo, rank, world, slot);
    t.timeout_s = 0.3;
    float x = 1;
    if (rank == world - 1) {
      usleep(1500 * 1000);
      expect_throw([&] { all_reduce(t, &x, 1, DType::F32, Op::Sum); }, {"poisoned"}, "late");
    } else {
      std::string peer = "waiting for rank " + std::to_string(world - 1);
      expect_throw([&] { all_reduce(t, &x, 1, DType::F32, Op::Sum); }, {"all_reduce", peer},
                   "timeout");
    }
  });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("world %d: %s (%.1f s)\n", world, ok ? "PASS" : "FAIL", s);
  return ok;
}

// ---- conversions (single process) ----------------------------------------------------

bool same_float(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

bool test_conversions() {
  // fp16 -> fp32: portable scalar vs bulk (F16C where present), all 65536 inputs.
  std::vector<uint16_t> h(65536);
  std::vector<float> f(65536);
  for (int i = 0; i < 65536; ++i) h[i] = uint16_t(i);
  f16_to_f32_n(h.data(), f.data(), h.size());
  for (int i = 0; i < 65536; ++i)
    if (!same_float(f16_to_f32(uint16_t(i)), f[i])) {
      std::printf("f16_to_f32 mismatch at 0x%04x\n", i);
      return false;
    }
  // fp32 -> fp16: every half's value, the midpoints between neighbours (ties) and their
  // float neighbours, plus a stride through all 2^32 bit patterns.
  std::vector<float> xs;
  for (int i = 0; i < 0x7c00; ++i) {
    double lo = f16_to_f32(uint16_t(i)), hi = f16_to_f32(uint16_t(i + 1));
    float mid = float((lo + hi) / 2);
    for (float v : {float(lo), mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)})
      xs.insert(xs.end(), {v, -v});
  }
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 9973) {
    uint32_t b = uint32_t(u);
    float v;
    std::memcpy(&v, &b, 4);
    xs.push_back(v);
  }
  std::vector<uint16_t> bulk(xs.size());
  f32_to_f16_n(xs.data(), bulk.data(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    if (f32_to_f16(xs[i]) != bulk[i]) {
      std::printf("f32_to_f16(%a) = 0x%04x, bulk 0x%04x\n", xs[i], f32_to_f16(xs[i]), bulk[i]);
      return false;
    }
    // bf16: nearest of the two truncation neighbours, ties to even (finite inputs)
    float x = xs[i];
    if (!std::isfinite(x) || std::fabs(x) > 3e38f) continue;
    uint32_t b;
    std::memcpy(&b, &x, 4);
    uint16_t lo = uint16_t(b >> 16), got = f32_to_bf16(x);
    double dlo = std::fabs(double(bf16_to_f32(lo)) - x);
    double dhi = std::fabs(double(bf16_to_f32(uint16_t(lo + 1))) - x);
    uint16_t want = dlo < dhi ? lo : dhi < dlo ? uint16_t(lo + 1) : (lo & 1 ? lo + 1 : lo);
    if (got != want) {
      std::printf("f32_to_bf16(%a) = 0x%04x, want 0x%04x\n", x, got, want);
      return false;
    }
  }
  std::printf("conversions: PASS (%zu fp32 inputs)\n", xs.size());
  return true;
}

// ---- timing (world 2) --------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void bench(bool sweep) {
  const int world = 2;
  // Tuning overrides for experiments: FASTPAR_SHM_SMALL_MAX / FASTPAR_SHM_CHUNK (bytes).
  auto env = [](const char* k, size_t d) { const char* v = getenv(k); return v ? size_t(atoll(v)) : d; };
  void* seg = map_segment(world, kDefaultSlotBytes, env("FASTPAR_SHM_SMALL_MAX", kDefaultSmallMaxBytes),
                          env("FASTPAR_SHM_CHUNK", kDefaultChunkBytes));
  run_ranks(world, [&](int rank) {
    Comm c = attach(seg, rank, world, kDefaultSlotBytes);
    auto time_ar = [&](size_t bytes, DType dt, int reps) {
      std::vector<uint8_t> buf(bytes, 0);
      size_t n = bytes / dtype_size(dt);
      std::vector<double> t;
      for (int i = 0; i < reps + reps / 10 + 1; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        all_reduce(c, buf.data(), n, dt, Op::Sum);
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      t.erase(t.begin(), t.begin() + reps / 10 + 1);  // warm-up
      if (rank == 0 && getenv("FASTPAR_SHM_SHOW_MIN"))
        std::printf("  (min %.2f us)\n", *std::min_element(t.begin(), t.end()) * 1e6);
      return median(t);
    };
    auto report = [&](const char* name, size_t bytes, double s) {
      double busbw = 2.0 * (world - 1) / world * bytes / s / 1e9;
      if (rank == 0)
        std::printf("  %-22s %10zu B  %10.2f us  algbw %6.2f GB/s  busbw %6.2f GB/s\n", name,
                    bytes, s * 1e6, bytes / s / 1e9, busbw);
    };
    report("all_reduce f32", 4096, time_ar(4096, DType::F32, 20000));
    report("all_reduce f32", 16 << 20, time_ar(16 << 20, DType::F32, 30));
    report("all_reduce bf16", 16 << 20, time_ar(16 << 20, DType::BF16, 30));
    // int8, blocks of 256 (the Python default), 16 MiB of float32 (all_gather: its output)
    auto time_q = [&](const std::function<void()>& call, int reps) {
      std::vector<double> t;
      for (int i = 0; i < reps + 3; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        call();
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      t.erase(t.begin(), t.begin() + 3);
      return median(t);
    };
    const size_t n = (16 << 20) / 4;
    std::vector<float> x(n, 1.0f), y(n, 0.0f);
    report("all_reduce int8 f32", 16 << 20, time_q([&] {
      quantized_all_reduce(c, x.data(), n, DType::F32, 256, nullptr); }, 30));
    report("all_gather int8 f32", 16 << 20, time_q([&] {
      quantized_all_gather(c, x.data(), y.data(), n / world, DType::F32, 256); }, 30));
    report("reduce_scatter int8 f32", 16 << 20, time_q([&] {
      quantized_reduce_scatter(c, x.data(), y.data(), n / world, DType::F32, 256, nullptr); }, 30));
    if (sweep)
      for (size_t b = 1024; b <= (size_t(64) << 20); b *= 2)
        report("sweep all_reduce f32", b, time_ar(b, DType::F32, b < (1 << 20) ? 2000 : 20));
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool bench_only = false, sweep = false, no_bench = false;
  for (int i = 1; i < argc; ++i) {
    bench_only |= std::strcmp(argv[i], "--bench-only") == 0;
    sweep |= std::strcmp(argv[i], "--sweep") == 0;
    no_bench |= std::strcmp(argv[i], "--no-bench") == 0;
  }
  bool ok = true;
  if (!bench_only) {
    ok = test_conversions() && ok;
    ok = test_codec() && ok;
    for (int world : {1, 2, 3, 4}) ok = run_world(world) && ok;
  }
  if (!no_bench) {
    std::printf("timing, world 2 (median):\n");
    bench(sweep);
  }
  std::printf("%s\n", ok ? "ALL PASS" : "SOME TESTS FAILED");
  return ok ? 0 : 1;
}

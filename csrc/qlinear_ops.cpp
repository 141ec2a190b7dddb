// Loops of the weight-only quantized linear on CPU tensors; see qlinear_ops.h.
//
// One task per run of weight rows n: each row is read once per kRows rows of x, converted to
// float 8 columns at a time and multiplied into one vector accumulator per row of x; a group's
// accumulators are scaled into the row's totals when the group ends (one horizontal sum per row
// of the output, not per group). AVX-512, else AVX2 + FMA, when the CPU has them (chosen at run
// time; FASTPAR_QLINEAR_ISA=avx2 or scalar caps it), else the same loops in scalar code.
#include "qlinear_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fastpar {
namespace {

constexpr int kRows = 8;  // rows of x one pass over a weight row serves

struct Args {
  const float* x;        // (M, K)
  int64_t M, K, N;
  const uint8_t* q;      // (N, qstride) bytes
  int64_t qstride;
  const float* scales;   // (groups, N)
  const float* offsets;  // (groups, N) or null
  const float* xsum;     // (M, groups): x summed over each group (offsets only)
  int64_t groups, group, lead;
  int bits;
  float* out;            // (M, N)
};

inline float qvalue(const Args& a, const uint8_t* row, int64_t k) {
  if (a.bits == 8) return static_cast<float>(static_cast<int8_t>(row[k]));
  const uint8_t b = row[k >> 1];
  return static_cast<float>((k & 1) ? (b >> 4) : (b & 15));
}

// The end of local group j's columns (the last group stops at K), and its start.
inline int64_t group_end(const Args& a, int64_t j) {
  return std::min<int64_t>(a.K, (j + 1) * a.group - a.lead);
}

void row_scalar(const Args& a, int64_t n, int64_t m0, int rows) {
  const uint8_t* row = a.q + n * a.qstride;
  float total[kRows] = {};
  for (int64_t j = 0, k = 0; k < a.K; ++j) {
    const int64_t end = group_end(a, j);
    float part[kRows] = {};
    for (; k < end; ++k) {
      const float w = qvalue(a, row, k);
      for (int m = 0; m < rows; ++m) part[m] += a.x[(m0 + m) * a.K + k] * w;
    }
    const float s = a.scales[j * a.N + n];
    for (int m = 0; m < rows; ++m) total[m] += s * part[m];
    if (a.offsets != nullptr) {
      const float o = a.offsets[j * a.N + n];
      for (int m = 0; m < rows; ++m) total[m] += o * a.xsum[(m0 + m) * a.groups + j];
    }
  }
  for (int m = 0; m < rows; ++m) a.out[(m0 + m) * a.N + n] = total[m];
}

#if defined(__x86_64__)
// Columns k .. k + 7 of a weight row as floats (int4: k even, so 4 whole bytes).
__attribute__((target("avx2,fma"))) inline __m256 load8(const Args& a, const uint8_t* row,
                                                         int64_t k) {
  if (a.bits == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  int32_t four;
  std::memcpy(&four, row + (k >> 1), 4);
  const __m128i b = _mm_cvtsi32_si128(four);
  const __m128i low = _mm_and_si128(b, _mm_set1_epi8(15));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  // bytes low0 high0 low1 high1 ...: columns k, k + 1, ... in order
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
}

// U independent accumulators per row of x: an FMA waits for the last one into its register
// (4 cycles), so a single row keeps 4 chains in flight.
template <int R>
__attribute__((target("avx2,fma"))) void row_avx2(const Args& a, int64_t n, int64_t m0) {
  constexpr int U = R == 1 ? 4 : (R < 4 ? 2 : 1);
  const uint8_t* row = a.q + n * a.qstride;
  __m256 total[R];
  float tail[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps(), tail[m] = 0.0f;
  for (int64_t j = 0, k = 0; k < a.K; ++j) {
    const int64_t end = group_end(a, j);
    __m256 part[R][U];
    float rest[R];
    for (int m = 0; m < R; ++m) {
      for (int u = 0; u < U; ++u) part[m][u] = _mm256_setzero_ps();
      rest[m] = 0.0f;
    }
    for (; k + 8 * U <= end; k += 8 * U)
      for (int u = 0; u < U; ++u) {
        const __m256 w = load8(a, row, k + 8 * u);
        for (int m = 0; m < R; ++m)
          part[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + (m0 + m) * a.K + k + 8 * u), w,
                                       part[m][u]);
      }
    for (; k + 8 <= end; k += 8) {
      const __m256 w = load8(a, row, k);
      for (int m = 0; m < R; ++m)
        part[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.x + (m0 + m) * a.K + k), w, part[m][0]);
    }
    for (; k < end; ++k) {
      const float w = qvalue(a, row, k);
      for (int m = 0; m < R; ++m) rest[m] += a.x[(m0 + m) * a.K + k] * w;
    }
    const float s = a.scales[j * a.N + n];
    const __m256 sv = _mm256_set1_ps(s);
    for (int m = 0; m < R; ++m) {
      for (int u = 1; u < U; ++u) part[m][0] = _mm256_add_ps(part[m][0], part[m][u]);
      total[m] = _mm256_fmadd_ps(sv, part[m][0], total[m]);
      tail[m] += s * rest[m];
    }
    if (a.offsets != nullptr) {
      const float o = a.offsets[j * a.N + n];
      for (int m = 0; m < R; ++m) tail[m] += o * a.xsum[(m0 + m) * a.groups + j];
    }
  }
  for (int m = 0; m < R; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(total[m]), _mm256_extractf128_ps(total[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    a.out[(m0 + m) * a.N + n] = _mm_cvtss_f32(s) + tail[m];
  }
}

// The same loops 16 columns at a time (AVX-512: half the instructions per weight of AVX2, which
// a decode step on the int8 conversions is bound by).
#define FASTPAR_AVX512 __attribute__((target("avx512f,avx512bw,fma")))

FASTPAR_AVX512 inline __m512 load16(const Args& a, const uint8_t* row, int64_t k) {
  if (a.bits == 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k >> 1)));
  const __m128i low = _mm_and_si128(b, _mm_set1_epi8(15));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
}

template <int R>
FASTPAR_AVX512 void row_avx512(const Args& a, int64_t n, int64_t m0) {
  constexpr int U = R == 1 ? 4 : (R < 4 ? 2 : 1);
  const uint8_t* row = a.q + n * a.qstride;
  __m512 total[R];
  float tail[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps(), tail[m] = 0.0f;
  for (int64_t j = 0, k = 0; k < a.K; ++j) {
    const int64_t end = group_end(a, j);
    __m512 part[R][U];
    float rest[R];
    for (int m = 0; m < R; ++m) {
      for (int u = 0; u < U; ++u) part[m][u] = _mm512_setzero_ps();
      rest[m] = 0.0f;
    }
    for (; k + 16 * U <= end; k += 16 * U)
      for (int u = 0; u < U; ++u) {
        const __m512 w = load16(a, row, k + 16 * u);
        for (int m = 0; m < R; ++m)
          part[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + (m0 + m) * a.K + k + 16 * u), w,
                                       part[m][u]);
      }
    for (; k + 16 <= end; k += 16) {
      const __m512 w = load16(a, row, k);
      for (int m = 0; m < R; ++m)
        part[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(a.x + (m0 + m) * a.K + k), w, part[m][0]);
    }
    for (; k < end; ++k) {
      const float w = qvalue(a, row, k);
      for (int m = 0; m < R; ++m) rest[m] += a.x[(m0 + m) * a.K + k] * w;
    }
    const float s = a.scales[j * a.N + n];
    const __m512 sv = _mm512_set1_ps(s);
    for (int m = 0; m < R; ++m) {
      for (int u = 1; u < U; ++u) part[m][0] = _mm512_add_ps(part[m][0], part[m][u]);
      total[m] = _mm512_fmadd_ps(sv, part[m][0], total[m]);
      tail[m] += s * rest[m];
    }
    if (a.offsets != nullptr) {
      const float o = a.offsets[j * a.N + n];
      for (int m = 0; m < R; ++m) tail[m] += o * a.xsum[(m0 + m) * a.groups + j];
    }
  }
  for (int m = 0; m < R; ++m)
    a.out[(m0 + m) * a.N + n] = _mm512_reduce_add_ps(total[m]) + tail[m];
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma");
  return yes;
}

void row_512(const Args& a, int64_t n, int64_t m0, int rows) {
  switch (rows) {
    case 1: return row_avx512<1>(a, n, m0);
    case 2: return row_avx512<2>(a, n, m0);
    case 3: return row_avx512<3>(a, n, m0);
    case 4: return row_avx512<4>(a, n, m0);
    case 5: return row_avx512<5>(a, n, m0);
    case 6: return row_avx512<6>(a, n, m0);
    case 7: return row_avx512<7>(a, n, m0);
    default: return row_avx512<8>(a, n, m0);
  }
}

void row_fast(const Args& a, int64_t n, int64_t m0, int rows) {
  switch (rows) {
    case 1: return row_avx2<1>(a, n, m0);
    case 2: return row_avx2<2>(a, n, m0);
    case 3: return row_avx2<3>(a, n, m0);
    case 4: return row_avx2<4>(a, n, m0);
    case 5: return row_avx2<5>(a, n, m0);
    case 6: return row_avx2<6>(a, n, m0);
    case 7: return row_avx2<7>(a, n, m0);
    default: return row_avx2<8>(a, n, m0);
  }
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
void row_fast(const Args& a, int64_t n, int64_t m0, int rows) { row_scalar(a, n, m0, rows); }
void row_512(const Args& a, int64_t n, int64_t m0, int rows) { row_scalar(a, n, m0, rows); }
#endif

void check_2d(const at::Tensor& t, const char* what, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 2,
              "fastpar qlinear: ", what, " must be a contiguous 2-D CPU tensor, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "fastpar qlinear: ", what, " must be ", dtype, ", got ",
              t.scalar_type());
}

}  // namespace

void qlinear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
             const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t lead,
             at::Tensor& out) {
  TORCH_CHECK(bits == 8 || bits == 4, "fastpar qlinear: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(group > 0 && group % 16 == 0, "fastpar qlinear: group must be a positive multiple "
              "of 16, got ", group);
  TORCH_CHECK(lead >= 0 && lead < group && (bits == 8 || lead % 2 == 0), "fastpar qlinear: "
              "lead ", lead, " must lie in [0, ", group, ")", bits == 4 ? " and be even" : "");
  check_2d(x, "x", at::kFloat);
  check_2d(q, "q", bits == 8 ? at::kChar : at::kByte);
  check_2d(scales, "scales", at::kFloat);
  check_2d(out, "out", at::kFloat);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const int64_t groups = K > 0 ? (lead + K - 1) / group + 1 : 0;
  TORCH_CHECK(q.size(1) == (bits == 8 ? K : (K + 1) / 2), "fastpar qlinear: q ", q.sizes(),
              " does not hold ", K, " columns of int", bits);
  TORCH_CHECK(scales.size(0) == groups && scales.size(1) == N, "fastpar qlinear: scales ",
              scales.sizes(), " are not (", groups, ", ", N, ")");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "fastpar qlinear: out ", out.sizes(),
              " is not (", M, ", ", N, ")");
  TORCH_CHECK(offsets.has_value() == (bits == 4), "fastpar qlinear: int4 takes offsets, int8 "
              "none");
  std::vector<float> xsum;
  Args a{x.data_ptr<float>(), M, K, N, static_cast<const uint8_t*>(q.data_ptr()), q.size(1),
         scales.data_ptr<float>(), nullptr, nullptr, groups, group, lead,
         static_cast<int>(bits), out.data_ptr<float>()};
  if (offsets.has_value()) {
    check_2d(*offsets, "offsets", at::kFloat);
    TORCH_CHECK(offsets->sizes() == scales.sizes(), "fastpar qlinear: offsets ",
                offsets->sizes(), " differ from scales ", scales.sizes());
    a.offsets = offsets->data_ptr<float>();
    xsum.assign(static_cast<size_t>(M * groups), 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0, k = 0; k < K; ++j)
        for (const int64_t end = group_end(a, j); k < end; ++k)
          xsum[m * groups + j] += a.x[m * K + k];
    a.xsum = xsum.data();
  }
  if (M == 0 || N == 0) return;
  // FASTPAR_QLINEAR_ISA=avx2|scalar caps the instruction set (the tests run every path)
  static const std::string isa = [] {
    const char* cap = std::getenv("FASTPAR_QLINEAR_ISA");
    return std::string(cap != nullptr ? cap : "");
  }();
  const bool wide = has_avx512() && isa.empty();
  const bool fast = has_avx2() && isa != "scalar";
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K * M, 1));
  // one pass over each weight row (rows of a task in order: the integers stream from memory);
  // cutting K into passes that keep x in L1 broke that stream and ran 2-4x slower
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        if (wide) row_512(a, n, m0, rows);
        else if (fast) row_fast(a, n, m0, rows);
        else row_scalar(a, n, m0, rows);
      }
  });
}

}  // namespace fastpar

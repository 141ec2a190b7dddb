// Torch glue of the int8 codec on CPU tensors; see quant_ops.h.
#include "quant_ops.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <vector>

#include "shm/shm_quant.h"

namespace fastpar {
namespace {

namespace shm = fastpar::shm;

size_t packed_bytes(size_t m, size_t block) {
  return 4 * shm::quant_blocks(m, block) + (m + 3) / 4 * 4;
}

shm::DType value_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "fastpar int8 codec: ", what, " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? shm::DType::F32 : shm::DType::BF16;
}

void check(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "fastpar int8 codec: ", what,
              " must be a contiguous CPU tensor");
}

// Rows of `buf` (uint8, rows x packed bytes of m elements): their count, checked.
int64_t packed_rows(const at::Tensor& buf, int64_t m, int64_t block) {
  check(buf, "the packed buffer");
  TORCH_CHECK(buf.scalar_type() == at::kByte, "fastpar int8 codec: the packed buffer must be "
              "uint8, got ", buf.scalar_type());
  TORCH_CHECK(block > 0 && block % 16 == 0, "fastpar int8 codec: block must be a positive "
              "multiple of 16, got ", block);
  TORCH_CHECK(m >= 0, "fastpar int8 codec: m must be >= 0, got ", m);
  const auto per = static_cast<int64_t>(packed_bytes(m, block));
  TORCH_CHECK(per > 0 ? buf.numel() % per == 0 : buf.numel() == 0, "fastpar int8 codec: ",
              buf.numel(), " packed bytes are not whole rows of ", per, " (", m,
              " elements, block ", block, ")");
  return per > 0 ? buf.numel() / per : 0;
}

}  // namespace

void quant_pack_rows(const at::Tensor& x, int64_t block, at::Tensor& out,
                     const std::optional<at::Tensor>& residual, const std::string& feedback) {
  check(x, "the input");
  TORCH_CHECK(x.dim() == 2, "fastpar int8 codec: pack_rows takes 2-D rows, got ", x.sizes());
  const auto dt = value_dtype(x, "the input");
  const int64_t rows = x.size(0), m = x.size(1);
  TORCH_CHECK(packed_rows(out, m, block) == rows, "fastpar int8 codec: the output holds ",
              out.numel(), " bytes, expected ", rows, " rows of ", packed_bytes(m, block));
  shm::Feedback fb = shm::Feedback::None;
  float* res = nullptr;
  int64_t nres = 0;
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    check(r, "the residual");
    TORCH_CHECK(r.scalar_type() == at::kFloat && r.numel() <= rows * m, "fastpar int8 codec: "
                "the residual must be float32 of at most ", rows * m, " elements, got ",
                r.scalar_type(), " of ", r.numel());
    TORCH_CHECK(feedback == "replace" || feedback == "add", "fastpar int8 codec: feedback must "
                "be 'replace' or 'add' with a residual, got '", feedback, "'");
    fb = feedback == "replace" ? shm::Feedback::Replace : shm::Feedback::Add;
    res = r.data_ptr<float>();
    nres = r.numel();
  }
  const size_t nb = shm::quant_blocks(m, block), per = packed_bytes(m, block);
  const size_t esize = dt == shm::DType::F32 ? 4 : 2;
  const auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const auto path = shm::quant_path();
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = dst + r * per;
    const char* xr = src + r * m * esize;
    auto* scales = reinterpret_cast<float*>(row);
    auto* q = reinterpret_cast<int8_t*>(row + 4 * nb);
    // this row's part of the residual (the flat rows cut to nres elements): k elements
    const int64_t lo = std::min(r * m, nres), k = std::min((r + 1) * m, nres) - lo;
    // replace on a row the residual ends inside: its first k elements, the rest zeros
    const int64_t nx = k > 0 && fb == shm::Feedback::Replace ? k : m;
    shm::quant_encode(path, xr, dt, nx, k > 0 ? res + lo : nullptr, k,
                      k > 0 ? fb : shm::Feedback::None, m, block, scales, q);
    std::memset(row + 4 * nb + m, 0, per - 4 * nb - m);
  }
}

void quant_unpack_rows(const at::Tensor& buf, int64_t m, int64_t block, at::Tensor& out) {
  const int64_t rows = packed_rows(buf, m, block);
  check(out, "the output");
  const auto dt = value_dtype(out, "the output");
  TORCH_CHECK(out.numel() == rows * m, "fastpar int8 codec: the output holds ", out.numel(),
              " elements, expected ", rows, " x ", m);
  const size_t nb = shm::quant_blocks(m, block), per = packed_bytes(m, block);
  const size_t esize = dt == shm::DType::F32 ? 4 : 2;
  const auto* src = static_cast<const uint8_t*>(buf.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const auto path = shm::quant_path();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * per;
    shm::quant_decode(path, reinterpret_cast<const float*>(row),
                      reinterpret_cast<const int8_t*>(row + 4 * nb), m, block,
                      dst + r * m * esize, dt);
  }
}

void quant_sum_packed_rows(const at::Tensor& buf, int64_t m, int64_t block, at::Tensor& out) {
  const int64_t rows = packed_rows(buf, m, block);
  check(out, "the output");
  const auto dt = value_dtype(out, "the output");
  TORCH_CHECK(rows > 0, "fastpar int8 codec: sum_packed_rows needs at least one row");
  TORCH_CHECK(out.numel() == m, "fastpar int8 codec: the output holds ", out.numel(),
              " elements, expected ", m);
  const size_t nb = shm::quant_blocks(m, block), per = packed_bytes(m, block);
  const auto* src = static_cast<const uint8_t*>(buf.data_ptr());
  const auto path = shm::quant_path();
  std::vector<float> scratch;
  float* acc = nullptr;
  if (dt == shm::DType::F32) {
    acc = out.data_ptr<float>();
  } else {
    scratch.resize(m);
    acc = scratch.data();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * per;
    shm::quant_accumulate(path, reinterpret_cast<const float*>(row),
                          reinterpret_cast<const int8_t*>(row + 4 * nb), m, block, acc, r == 0);
  }
  if (dt != shm::DType::F32) shm::quant_narrow(path, acc, m, out.data_ptr(), dt);
}

}  // namespace fastpar

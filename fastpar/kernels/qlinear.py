"""A Triton GEMM of a weight-only quantized weight: ``y = x @ W.T``, W dequantized in the K loop.

    y = qlinear(x, q, scales, offsets, bits, group, lead)   # x (M, K) -> y (M, N), x's dtype

The format is ``fastpar.nn.qweight``'s: W[n, k] = scales[j, n] * q[n, k] (+ offsets[j, n]) with
j = (lead + k) // group; int8 ``q`` (N, K), int4 two columns per byte (N, ceil(K / 2)), the low
nibble the even column. Each program computes a BLOCK_M x BLOCK_N tile of y: per BLOCK_K step it
loads the integers of a (BLOCK_K, BLOCK_N) tile of W.T, the scale (and offset) of each element's
group, dequantizes in float32, and accumulates ``x_tile @ w_tile`` in float32 (``tl.dot``,
"ieee" precision: no TF32); y is stored in x's dtype. Only W's integers and scales cross the
memory bus: the saving of a decode step, which is bound by reading the weight.

CPU tensors run only through Triton's interpreter (``TRITON_INTERPRET=1`` before importing
fastpar.kernels), as the tests run it; ``fastpar.nn.qweight.qmatmul`` calls it for CUDA tensors.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qlinear_kernel(
    x_ptr,  # (M, K) activations, row-major
    q_ptr,  # (N, K) int8, or (N, ceil(K / 2)) uint8 for int4; row stride stride_qn
    s_ptr,  # (groups, N) float32 scales
    o_ptr,  # (groups, N) float32 offsets; read only when BITS == 4
    y_ptr,  # (M, N) output, x's dtype
    M, N, K, stride_qn, group, lead,
    BITS: tl.constexpr,  # 8 or 4
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0).to(tl.float32)
        inside = (rk[:, None] < K) & (rn[None, :] < N)  # (BLOCK_K, BLOCK_N) of W.T
        if BITS == 8:
            qv = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=inside, other=0)
            w = qv.to(tl.float32)
        else:
            byte = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None] // 2, mask=inside,
                           other=0).to(tl.int32)
            w = ((byte >> ((rk[:, None] % 2) * 4)) & 15).to(tl.float32)
        j = (lead + rk[:, None]) // group  # each element's local group
        scale = tl.load(s_ptr + j * N + rn[None, :], mask=inside, other=0.0)
        w = w * scale
        if BITS == 4:
            w = w + tl.load(o_ptr + j * N + rn[None, :], mask=inside, other=0.0)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def qlinear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, offsets, bits: int,
            group: int, lead: int) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W.T in x's dtype (float32, float16 or bfloat16); see above."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"qlinear: x must be 2-D float32, float16 or bfloat16, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if bits not in (8, 4) or (bits == 4) != (offsets is not None):
        raise ValueError(f"qlinear: bits must be 8 (no offsets) or 4 (offsets), got {bits}")
    x = x.contiguous()
    M, K = x.shape
    N = q.shape[0]
    scales = scales.float().contiguous()
    offsets = scales if offsets is None else offsets.float().contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _qlinear_kernel[grid](x, q.contiguous(), scales, offsets, y, M, N, K, q.shape[1], group, lead,
                          BITS=bits, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
    return y

"""The GEMM of ``linear`` publishing row-block completion flags: the producer side of an
overlapped GEMM + communication (a CUDA IPC consumer reads finished rows while later ones are
still being computed).

    flags = torch.zeros(triton.cdiv(M, 128), dtype=torch.int32, device=x2d.device)
    y = linear_with_flags(x2d, weight, flags)        # y = x2d @ weight.T, (M, N)
    # consumer: once flags[m] == cdiv(N, 128) (read with acquire), rows m*128 .. m*128+127 of y
    # are written and visible.

The kernel is ``_linear_kernel`` with FLAGS on: each program stores its (block_m, block_n) tile of
y, then (after a CTA barrier) does ``atomic_add(flags[pid_m], 1, sem="release", scope="sys")``.
The launch is not autotuned: the consumer must know block_m and block_n, and autotuning would run
the kernel several times and add to the flags each time. Tiles go row-major (GROUP_M = 1): row
block 0's tiles first, so the first row blocks finish early (grouped orders finish every row
block of a group in the same last wave, leaving the consumer nothing to start on).
"""

import torch
import triton

from .gemm import INTERPRETED, _input_precision, _linear_kernel, check_operands


def linear_with_flags(x2d, weight, flags, *, block_m=128, block_n=128, out=None):
    """y = x2d @ weight.T, (M, K) @ (K, N) -> (M, N), adding 1 to flags[m] for each finished
    (block_m, block_n) tile of row block m: row block m is complete once flags[m] has grown by
    cdiv(N, block_n). flags: int32, (cdiv(M, block_m),), on x2d's device; it is added to, not
    reset, so zero it first (or wait for the previous value plus cdiv(N, block_n)).
    Forward only (no autograd). block_m, block_n: powers of two >= 16 (tl.dot's minimum).
    out: a contiguous (M, N) tensor of x2d's dtype and device to write y into (e.g. a CUDA IPC
    staging buffer that a consumer reduces from), else a new one.
    """
    name = "fastpar.kernels.linear_with_flags"
    check_operands(name, x2d, weight)
    if x2d.dim() != 2:
        raise ValueError(f"{name}: x2d must be 2-D (M, K), got shape {tuple(x2d.shape)}")
    for what, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}: {what} must be a power of two >= 16, got {b}")
    M, K = x2d.shape
    N = weight.shape[0]
    n_row_blocks = triton.cdiv(M, block_m)
    if flags.dtype != torch.int32 or tuple(flags.shape) != (n_row_blocks,) \
            or flags.device != x2d.device or not flags.is_contiguous():
        raise ValueError(f"{name}: flags must be a contiguous int32 tensor of shape "
                         f"(cdiv(M, block_m),) = ({n_row_blocks},) on {x2d.device}, got "
                         f"{flags.dtype} {tuple(flags.shape)} on {flags.device}")
    if out is None:
        y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)  # (M, N)
    elif tuple(out.shape) != (M, N) or out.dtype != x2d.dtype or out.device != x2d.device \
            or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {x2d.dtype} tensor of shape "
                         f"({M}, {N}) on {x2d.device}, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")
    else:
        y = out
    if M == 0 or N == 0:
        return y
    block_k = 16 if INTERPRETED else 32 if x2d.dtype == torch.float32 else 64  # 3 stages fit
    big = block_m * block_n >= 128 * 128
    grid = (n_row_blocks * triton.cdiv(N, block_n),)
    _linear_kernel[grid](
        x2d, weight, y, y, y, flags,  # no bias, no z: their pointers are unused
        M, N, K, triton.next_power_of_2(M), x2d.stride(0), x2d.stride(1), weight.stride(0),
        weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=False, ACTIVATION="none", SAVE_PRE=False, FLAGS=True,
        INPUT_PRECISION=_input_precision(x2d.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=1, num_warps=8 if big else 4, num_stages=3)
    return y

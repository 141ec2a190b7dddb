"""A Triton GEMM with a fused bias + activation epilogue: ``fastpar.kernels.linear``.

    y = linear(x, weight, bias, activation="gelu")   # act(F.linear(x, weight, bias)), one kernel

forward:  z = x @ w.T + b     x: (..., K), w: (N, K), b: (N,); fp32 accumulation   (Triton)
          y = act(z)          act: None, relu, gelu (erf), gelu_tanh, silu; y in x.dtype
dgrad:    dz = dy * act'(z)   act' from the pre-activation z the forward kernel stored
          dx = dz @ w         (M, N) @ (N, K) -> (M, K)                           (torch.matmul)
wgrad:    dw = dz.T @ x       (N, M) @ (M, K) -> (N, K);  db = dz.sum(0)          (torch.matmul)

CPU tensors run only through Triton's interpreter, which Triton switches on when a kernel is
defined, i.e. when this module is imported: ``TRITON_INTERPRET=1 python ...`` (set before
``import fastpar.kernels``). The interpreter cannot multiply bfloat16 (it multiplies the stored
bit patterns, triton-lang/triton#11584), so bfloat16 on it is refused rather than answered wrong.
"""

import os

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    """act(z) on an fp32 tile; ACTIVATION is one of ACTIVATIONS, "none" for None."""
    if ACTIVATION == "relu":
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == "gelu":  # z * Phi(z), Phi the normal CDF, as F.gelu
        z = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":  # 0.5 z (1 + tanh u) = z sigmoid(2u),
        # u = sqrt(2/pi) (z + 0.044715 z^3)
        z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _linear_kernel(
    x_ptr,  # (M, K) input rows, any strides
    w_ptr,  # (N, K) weight as nn.Linear stores it, read as its transpose (K, N)
    b_ptr,  # (N,) bias; read only when HAS_BIAS
    y_ptr,  # (M, N) output act(z), in the input dtype
    z_ptr,  # (M, N) pre-activation z, same strides as y; written only when SAVE_PRE
    flags_ptr,  # (cdiv(M, BLOCK_M),) int32 row-block counters; touched only when FLAGS
    M, N, K,  # y is (M, N); the reduction runs over K
    M_BUCKET,  # M rounded up to a power of two: the autotuner's key (unused by the kernel)
    stride_xm, stride_xk,  # element strides of x
    stride_wn, stride_wk,  # element strides of w
    stride_ym, stride_yn,  # element strides of y and z
    HAS_BIAS: tl.constexpr,  # add b (in fp32) before the activation
    ACTIVATION: tl.constexpr,  # "none", "relu", "gelu", "gelu_tanh" or "silu"
    SAVE_PRE: tl.constexpr,  # also store z, for the backward
    FLAGS: tl.constexpr,  # after the tile is stored, add 1 to flags[pid_m] (release)
    INPUT_PRECISION: tl.constexpr,  # tl.dot on fp32 inputs: "ieee" or "tf32"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of y, K step
    GROUP_M: tl.constexpr,  # row tiles that sweep the columns together (w tiles reused in L2)
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_m
    pid_n = (pid % num_pid_in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) columns of y
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    # Rows/columns past the edge wrap around (% M, % N): their loads stay in bounds without a
    # mask in the K loop, and the masked store below drops what they produce. int64: M*K and
    # N*K may pass 2**31 elements.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn  # (BLOCK_K, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = offs_k < K - k0  # the last step may be partial: its missing K reads as 0
        a = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    if SAVE_PRE:
        tl.store(z_ptr + y_offs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    y = _activation(acc, ACTIVATION)
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    if FLAGS:
        # Every thread's stores of this tile before the flag: a CTA barrier, then a release add
        # at system scope so a consumer on another device (CUDA IPC) that acquires the flag
        # sees the whole tile.
        tl.debug_barrier()
        tl.atomic_add(flags_ptr + pid_m, 1, sem="release", scope="sys")


# Triton chose interpreter or compiler when it decorated the kernel above.
INTERPRETED = not isinstance(_linear_kernel, JITFunction)


def _configs():
    """Autotune candidates: Hopper-sized tiles, then smaller ones for small M or N. Under the
    interpreter every candidate would be run to time it, so there is one small, non-square one;
    ``FASTPAR_TRITON_AUTOTUNE=0`` (read at import) keeps one compiled tile too, for tests whose
    many shapes and epilogues would otherwise compile every candidate of each."""
    def cfg(m, n, k, warps, stages):
        return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                             num_warps=warps, num_stages=stages)

    if INTERPRETED:
        return [cfg(16, 32, 16, 1, 1)]
    if os.environ.get("FASTPAR_TRITON_AUTOTUNE", "1") == "0":
        return [cfg(128, 128, 64, 8, 3)]
    return [cfg(128, 256, 64, 8, 3), cfg(256, 128, 64, 8, 3), cfg(128, 128, 64, 8, 4),
            cfg(128, 128, 64, 4, 4), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 4),
            cfg(64, 64, 32, 4, 4), cfg(32, 64, 64, 4, 3), cfg(16, 64, 128, 4, 3)]


# Tiles too large for a GPU's shared memory fail to compile and are dropped by the autotuner.
# Keyed on M's power-of-two bucket, not M: a new token count (every inference step) must not
# re-run the tuning; N and K are the weight's, fixed per layer.
_linear_tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"])(_linear_kernel)


def _input_precision(dtype):
    """fp32 follows torch's own matmul knob (TF32 only where torch would use it)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def check_operands(name, x, weight, bias=None, activation=None):
    """ValueError for bad user input, RuntimeError for a device Triton cannot run here."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: x of shape {tuple(x.shape)} does not end in K = "
                         f"{weight.shape[1]} of weight (N, K) = {tuple(weight.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported; use float32, float16 or "
                         f"bfloat16")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name}: dtypes differ: x {x.dtype}, weight {weight.dtype}, bias "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must have shape (N,) = ({weight.shape[0]},), got "
                         f"{tuple(bias.shape)}")
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors are on different devices: {sorted(map(str, devices))}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: unknown activation {activation!r}; expected one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}")
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{name}: got CPU tensors, and Triton runs CPU tensors only through "
                           f"its interpreter, which was off when fastpar.kernels was imported. "
                           f"Set TRITON_INTERPRET=1 in the environment before importing "
                           f"fastpar.kernels (e.g. `TRITON_INTERPRET=1 python ...`), or pass GPU "
                           f"tensors.")
    if x.dtype == torch.bfloat16 and INTERPRETED:
        raise RuntimeError(f"{name}: Triton's interpreter cannot multiply bfloat16 (it multiplies "
                           f"the stored bit patterns, triton-lang/triton#11584); use float16 or "
                           f"float32 on the interpreter, bfloat16 on a GPU.")


def _launch(x2d, weight, bias, activation, save_pre):
    """y = act(x2d @ weight.T + bias) by the autotuned kernel; z too when save_pre."""
    M, K = x2d.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)  # (M, N)
    z = torch.empty_like(y) if save_pre else None  # (M, N) pre-activation, for backward
    if M == 0 or N == 0:
        return y, z

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _linear_tuned[grid](
        x2d, weight, y if bias is None else bias, y, y if z is None else z, y,  # unused ptrs: y
        M, N, K, triton.next_power_of_2(M), x2d.stride(0), x2d.stride(1), weight.stride(0),
        weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=activation or "none", SAVE_PRE=save_pre,
        FLAGS=False, INPUT_PRECISION=_input_precision(x2d.dtype))
    return y, z


def _activation_grad(z, activation):
    """act'(z) in fp32, z the fp32 pre-activation."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":  # Phi(z) + z phi(z)
        return 0.5 * (1.0 + torch.erf(z * 0.7071067811865476)) + \
            z * torch.exp(-0.5 * z * z) * 0.3989422804014327
    if activation == "gelu_tanh":  # d/dz z s(2u) = s + z * 2 s (1 - s) * u'
        s = torch.sigmoid(1.5957691216057308 * (z + 0.044715 * z ** 3))
        return s + z * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * z * z)
    s = torch.sigmoid(z)  # silu: s + z s (1 - s)
    return s + z * s * (1.0 - s)


class _LinearFunction(torch.autograd.Function):
    """Forward by the Triton kernel (which also stores z when there is an activation); the
    backward GEMMs are torch.matmul (cuBLAS on GPU), with dz formed in fp32."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, activation):
        save_pre = activation is not None
        y, z = _launch(x2d, weight, bias, activation, save_pre)
        ctx.activation, ctx.has_bias = activation, bias is not None
        ctx.save_for_backward(x2d, weight, z)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, z = ctx.saved_tensors
        dz = dy.float()  # (M, N)
        if ctx.activation is not None:
            dz = dz * _activation_grad(z.float(), ctx.activation)
        db = dz.sum(0).to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dz = dz.to(dy.dtype)
        dx = dz @ weight if ctx.needs_input_grad[0] else None  # (M, N) @ (N, K) -> (M, K)
        dw = dz.t() @ x2d if ctx.needs_input_grad[1] else None  # (N, M) @ (M, K) -> (N, K)
        return dx, dw, db, None


def linear(x, weight, bias=None, activation=None):
    """act(F.linear(x, weight, bias)) in one Triton kernel; differentiable.

    x: (..., K), weight: (N, K), bias: (N,) or None -> (..., N), all float32, float16 or
    bfloat16 (one dtype), accumulated in fp32, returned in that dtype. activation: None, "relu",
    "gelu" (erf form, as F.gelu), "gelu_tanh" (F.gelu(approximate="tanh")) or "silu". The
    backward uses torch.matmul for dx and dweight.
    """
    check_operands("fastpar.kernels.linear", x, weight, bias, activation)
    x2d = x.reshape(-1, x.shape[-1])  # (M, K), M = prod(leading dims)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        y = _LinearFunction.apply(x2d, weight, bias, activation)
    else:
        y, _ = _launch(x2d, weight, bias, activation, save_pre=False)
    return y.reshape(*x.shape[:-1], weight.shape[0])  # (..., N)

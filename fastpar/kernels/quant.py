"""Block-scaled int8 in Triton: ``fastpar.comm.quant``'s codec for GPU tensors, bit for bit.

    out = torch.empty(rows, packed_bytes(m, B), dtype=torch.uint8, device=x.device)
    pack_rows(x, B, out, residual=res)   # x (rows, m) float32 or bf16 -> rows of wire format
    y = unpack_rows(out, m, B)           # (rows, m) float32 (or into out= of bf16)
    sum_packed_rows(out, m, B, total)    # total (m,) = y[0] + y[1] + ..., in float32, row order

A packed row is comm.quant's wire format: ceil(m / B) float32 scales, m int8 values, zeros to a
multiple of 4 bytes. Per block, in float32 (comm.quant's docstring has the definition)::

    amax = max |x_i|, found on the bits (|x|'s bits order as |x| does; inf and NaN lie above)
    scale = amax / 127, inv = 127 / amax       tl.math.div_rn (fp32 `/` is div.full, 2 ulp)
    q_i = clamp(rint(x_i * inv), -127, 127)    rint(y) = (y + 1.5 * 2^23) - 1.5 * 2^23 (ties to
                                               even for |y| < 2^22; Triton has no rint of its own)
    y_i = float(q_i) * scale;  sum: acc = y_0, then acc = acc + y_r
    residual_i = x_i - y_i, and 0 in a non-finite block (comm.quant.carried)

Every product and sum rounds on its own, as the torch ops do: the kernels are launched with
``enable_fp_fusion=False`` (Triton would fuse ``a * b + c`` into an fma, and ptxas would too).
Nothing tests a float for NaN: Triton compiles with LLVM's no-NaNs option, which may fold
``x != x`` to false, so a block is non-finite when its amax's bits say so, and a NaN product
(a non-finite block, or 0 * inf when inv overflowed) is never selected. A bfloat16 input is
widened and a bfloat16 output rounded (to nearest even, NaN kept) by integer ops, exactly as
torch does, because the interpreter's own conversions are not exact.

One program per block. A program holds TILE = min(next_power_of_2(B), max_tile) elements at
once (max_tile 4096 by default: 16 per thread at 8 warps): a block of up to max_tile elements is
one tile; a longer one (up to 65536) is walked twice, for its amax and then to quantize it, the
second pass reading what the first brought into cache.

CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1`` before importing
fastpar.kernels), which the tests use; ``fastpar.comm.quantized`` uses these for CUDA tensors.
"""

import torch
import triton
import triton.language as tl

from .gemm import INTERPRETED

MIN_BLOCK, MAX_BLOCK = 16, 1 << 16  # comm.quant's
MAX_TILE = 4096
_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _load_f32(ptrs, mask):
    """A float32 tile of a float32 or bfloat16 tensor (bfloat16 widened by its bits: exact)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptrs, mask=mask, other=0.0).to(tl.uint16, bitcast=True)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_from_f32(ptrs, y, mask):
    """Store the float32 tile y as the pointers' dtype: float32, or bfloat16 rounded to nearest
    even on the bits (NaN as 0x7FC0), as torch rounds."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where((y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, bits)
        tl.store(ptrs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, y, mask=mask)


@triton.jit
def _dequantize(q_ptrs, scale, mask):
    """float(q_i) * scale of a tile of int8 values."""
    return tl.load(q_ptrs, mask=mask, other=0).to(tl.float32) * scale


@triton.jit
def _pack_kernel(
    x_ptr,  # (rows, m) float32 or bfloat16 values to quantize, any strides
    scales_ptr,  # the packed rows (rows, row_bytes) seen as float32: row r's scale j at
    #             r * row_bytes / 4 + j
    q_ptr,  # the same bytes seen as int8: row r's value i at r * row_bytes + 4 * nb + i
    res_ptr,  # float32, flat: x[r, i] minus its dequantized value at r * m + i where that is
    #          below res_numel; written only when RESIDUAL
    m, nb, row_bytes, block,  # elements per row, blocks per row, packed bytes per row, B
    stride_xr, stride_xi,  # element strides of x (int32 within a row: m * stride_xi < 2^31)
    res_numel,  # elements of the residual: rows * m, or fewer (its last row cut short)
    RESIDUAL: tl.constexpr,  # write the residual (error feedback)
    TILE: tl.constexpr,  # elements a program holds at once: a power of two
):
    pid = tl.program_id(0)  # one program per block, row-major: rows * nb of them
    r = pid // nb
    j = pid % nb
    offs = tl.arange(0, TILE)  # (TILE,)
    start = j * block
    x_row = x_ptr + r.to(tl.int64) * stride_xr

    # amax on the bits: the sign bit cleared, |x| orders as its bits do, with inf then the NaNs
    # above every finite value; masked lanes read 0
    top = tl.zeros((TILE,), dtype=tl.int32)
    for t0 in range(0, block, TILE):
        i = start + t0 + offs
        mask = (t0 + offs < block) & (i < m)
        x = _load_f32(x_row + i * stride_xi, mask)
        top = tl.maximum(top, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    amax_bits = tl.max(top, axis=0)
    finite = amax_bits < 0x7F800000
    live = finite & (amax_bits > 0)
    safe = tl.where(live, amax_bits.to(tl.float32, bitcast=True), 1.0)
    inv = tl.where(live, tl.math.div_rn(127.0, safe), 0.0)
    scale = tl.where(live, tl.math.div_rn(safe, 127.0), tl.where(finite, 0.0, float("nan")))

    row = r.to(tl.int64) * row_bytes
    tl.store(scales_ptr + row // 4 + j, scale)
    q_row = q_ptr + row + 4 * nb
    for t0 in range(0, block, TILE):
        i = start + t0 + offs
        mask = (t0 + offs < block) & (i < m)
        x = _load_f32(x_row + i * stride_xi, mask)
        y = x * inv
        rounded = y + 12582912.0  # 1.5 * 2^23: the sum's ulp is 1, it rounds y, ties to even
        rounded = rounded - 12582912.0
        rounded = tl.minimum(tl.maximum(rounded, -127.0), 127.0)
        # y is NaN in a non-finite block, and for a zero of a block whose inv is inf: q = 0
        qf = tl.where(finite & (x != 0.0), rounded, 0.0)
        tl.store(q_row + i, qf.to(tl.int8), mask=mask)
        if RESIDUAL:  # x - sent; 0 in a non-finite block (comm.quant.carried: sent is NaN)
            sent = qf * scale
            flat = r.to(tl.int64) * m + i
            tl.store(res_ptr + flat, tl.where(finite, x - sent, 0.0),
                     mask=mask & (flat < res_numel))
    if j == nb - 1:  # the row's last block writes the zeros after its last value (0 to 3)
        pad = 4 * nb + m + tl.arange(0, 4)
        tl.store(q_ptr + row + pad, tl.zeros((4,), dtype=tl.int8), mask=pad < row_bytes)


@triton.jit
def _unpack_kernel(
    scales_ptr,  # the packed rows (rows, row_bytes) seen as float32
    q_ptr,  # the same bytes seen as int8
    out_ptr,  # (rows, m) float32 or bfloat16, unit stride along m
    m, nb, row_bytes, block,  # as _pack_kernel's
    stride_or,  # out's row stride, in elements
    TILE: tl.constexpr,  # elements a program holds at once: a power of two
):
    pid = tl.program_id(0)  # one program per block: rows * nb of them
    r = pid // nb
    j = pid % nb
    offs = tl.arange(0, TILE)
    start = j * block
    row = r.to(tl.int64) * row_bytes
    scale = tl.load(scales_ptr + row // 4 + j)
    for t0 in range(0, block, TILE):
        i = start + t0 + offs
        mask = (t0 + offs < block) & (i < m)
        y = _dequantize(q_ptr + row + 4 * nb + i, scale, mask)
        _store_from_f32(out_ptr + r.to(tl.int64) * stride_or + i, y, mask)


@triton.jit
def _sum_kernel(
    scales_ptr,  # n packed rows (n, row_bytes) seen as float32
    q_ptr,  # the same bytes seen as int8
    out_ptr,  # (m,) float32 or bfloat16: the sum over the rows
    n, m, nb, row_bytes, block,  # rows, then as _pack_kernel's
    TILE: tl.constexpr,  # elements a program holds at once: a power of two
):
    j = tl.program_id(0)  # one program per block of the m elements: nb of them
    offs = tl.arange(0, TILE)
    start = j * block
    for t0 in range(0, block, TILE):
        i = start + t0 + offs
        mask = (t0 + offs < block) & (i < m)
        acc = _dequantize(q_ptr + 4 * nb + i, tl.load(scales_ptr + j), mask)  # row 0's values
        for r in range(1, n):
            row = r * row_bytes.to(tl.int64)
            y = _dequantize(q_ptr + row + 4 * nb + i, tl.load(scales_ptr + row // 4 + j), mask)
            acc = acc + y
        _store_from_f32(out_ptr + i, acc, mask)


# ---- launchers -------------------------------------------------------------------------------

def packed_bytes(m: int, block: int) -> int:
    """Bytes of one packed row of m elements (comm.quant.packed_bytes: kernels import nothing
    of fastpar; the tests check the two agree)."""
    return 4 * triton.cdiv(m, block) + triton.cdiv(m, 4) * 4


def _tile(block, max_tile):
    """(TILE, num_warps) of a launch: up to 16 elements per thread."""
    tile = min(triton.next_power_of_2(block), max_tile)
    return tile, max(1, min(8, tile // 512))


def _check_block(name, block, max_tile):
    if isinstance(block, bool) or not isinstance(block, int) or \
            not MIN_BLOCK <= block <= MAX_BLOCK or block % 16:
        raise ValueError(f"{name}: block must be a multiple of 16 from {MIN_BLOCK} to "
                         f"{MAX_BLOCK}, got {block!r}")
    if max_tile < 16 or max_tile & (max_tile - 1):
        raise ValueError(f"{name}: max_tile must be a power of two >= 16, got {max_tile}")


def _check_devices(name, *tensors):
    """ValueError for tensors on several devices, RuntimeError for CPU tensors without the
    interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors are on different devices: {sorted(map(str, devices))}")
    if tensors[0].device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{name}: got CPU tensors, and Triton runs CPU tensors only through "
                           f"its interpreter, which was off when fastpar.kernels was imported. "
                           f"Set TRITON_INTERPRET=1 before importing fastpar.kernels, or pass "
                           f"GPU tensors (fastpar.comm.quant is the CPU codec).")


def _check_packed(name, buf, rows, m, block):
    per = packed_bytes(m, block)
    if buf.dtype != torch.uint8 or tuple(buf.shape) != (rows, per) or not buf.is_contiguous():
        raise ValueError(f"{name}: the packed rows must be a contiguous uint8 tensor of shape "
                         f"(rows, packed_bytes(m, block)) = ({rows}, {per}), got {buf.dtype} "
                         f"{tuple(buf.shape)}")


def _check_float(name, what, t, shape):
    if t.dtype not in _DTYPES or tuple(t.shape) != shape or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name}: {what} must be a float32 or bfloat16 tensor of shape {shape} "
                         f"with unit stride along its last dim, got {t.dtype} "
                         f"{tuple(t.shape)} (strides {t.stride()})")


def pack_rows(x, block, out, *, residual=None, max_tile=MAX_TILE):
    """Each row of the 2-D ``x`` (float32 or bfloat16, any strides) quantized into its wire
    format: ``out`` (rows, packed_bytes(m, block)) uint8, contiguous, as comm.quant.pack_rows.
    ``residual``: a contiguous float32 tensor of at most rows * m elements that receives
    x - dequantized (0 in a non-finite block), flat in row-major order and cut to its length
    (error feedback; all_reduce pads its last row). Returns ``out``."""
    name = "fastpar.kernels.pack_rows"
    _check_block(name, block, max_tile)
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x must be a 2-D float32 or bfloat16 tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    rows, m = x.shape
    _check_packed(name, out, rows, m, block)
    if residual is not None and (residual.dtype != torch.float32 or
                                 not residual.is_contiguous() or residual.numel() > rows * m):
        raise ValueError(f"{name}: residual must be a contiguous float32 tensor of at most "
                         f"rows * m = {rows * m} elements, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    _check_devices(name, x, out, *([] if residual is None else [residual]))
    nb = triton.cdiv(m, block)
    if rows * nb == 0:
        return out
    tile, warps = _tile(block, max_tile)
    _pack_kernel[(rows * nb,)](
        x, out.view(torch.float32), out.view(torch.int8), out if residual is None else residual,
        m, nb, out.shape[1], block, x.stride(0), x.stride(1),
        0 if residual is None else residual.numel(),
        RESIDUAL=residual is not None, TILE=tile, num_warps=warps, enable_fp_fusion=False)
    return out


def unpack_rows(buf, m, block, out=None, *, max_tile=MAX_TILE):
    """float32 (rows, m) of the packed rows ``buf`` (rows, packed_bytes(m, block)) uint8, as
    comm.quant.unpack_rows; or written into ``out`` (rows, m), float32 or bfloat16 (rounded once),
    unit stride along m. Returns the values."""
    name = "fastpar.kernels.unpack_rows"
    _check_block(name, block, max_tile)
    rows = buf.shape[0] if buf.dim() == 2 else -1
    _check_packed(name, buf, rows, m, block)
    if out is None:
        out = torch.empty((rows, m), dtype=torch.float32, device=buf.device)  # (rows, m)
    _check_float(name, "out", out, (rows, m))
    _check_devices(name, buf, out)
    nb = triton.cdiv(m, block)
    if rows * nb == 0:
        return out
    tile, warps = _tile(block, max_tile)
    _unpack_kernel[(rows * nb,)](
        buf.view(torch.float32), buf.view(torch.int8), out, m, nb, buf.shape[1], block,
        out.stride(0), TILE=tile, num_warps=warps, enable_fp_fusion=False)
    return out


def sum_packed_rows(buf, m, block, out, *, max_tile=MAX_TILE):
    """``out`` (m,), float32 or bfloat16 = the sum over the packed rows of ``buf`` (n,
    packed_bytes(m, block)) uint8 of their dequantized values: acc = y_0, then acc = acc + y_r
    for r = 1 .. n - 1 in float32 (the order every engine sums in), rounded once to out's
    dtype. Returns ``out``."""
    name = "fastpar.kernels.sum_packed_rows"
    _check_block(name, block, max_tile)
    rows = buf.shape[0] if buf.dim() == 2 else -1
    _check_packed(name, buf, rows, m, block)
    if rows < 1:
        raise ValueError(f"{name}: there must be at least one packed row, got {rows}")
    _check_float(name, "out", out, (m,))
    _check_devices(name, buf, out)
    nb = triton.cdiv(m, block)
    if nb == 0:
        return out
    tile, warps = _tile(block, max_tile)
    _sum_kernel[(nb,)](
        buf.view(torch.float32), buf.view(torch.int8), out, rows, m, nb, buf.shape[1], block,
        TILE=tile, num_warps=warps, enable_fp_fusion=False)
    return out

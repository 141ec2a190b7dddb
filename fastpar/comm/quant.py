"""Block-scaled int8: the codec every quantized collective uses, defined once, bit for bit.

    spec = quant.spec("int8")                    # or Quant("int8", block=128)
    q, scales = quant.quantize(x, spec.block)    # x float32 or bfloat16, any shape (flat order)
    y = quant.dequantize(q, scales, spec.block)  # float32, x's number of elements

A tensor of n elements is cut, from its first element, into blocks of B (``block``; the last one
may be shorter). Per block, in float32 arithmetic (a bf16 input is widened first, exactly)::

    amax  = max |x_i|
    amax finite and > 0:  scale = amax / 127      inv = 127 / amax      (IEEE divisions)
                          q_i   = clamp(rint(x_i * inv), -127, 127)     (ties to even)
    amax < 127 / FLT_MAX: inv = inf, and a zero x_i gives q_i = 0       (not 0 * inf)
    amax == 0:            scale = 0, q_i = 0                            (zeros stay zeros)
    amax inf or NaN:      scale = NaN, q_i = 0                          (see below)
    dequantized:          y_i = float(q_i) * scale                      (one rounding)

Round to nearest, not stochastic rounding: the result is a function of the input alone, so every
rank and every engine (torch here, the shm kernels' AVX and scalar loops, the Triton kernels)
computes bitwise the same bytes and a rerun repeats a run exactly; the bias stochastic rounding
removes is removed for gradients by error feedback instead (``residual=`` of the collectives:
the rounding error is carried into the next call), which also works for the quantization of a
sum. Per element |x_i - y_i| <= scale / 2 + 4 u amax (u = 2^-24: the roundings of inv, of
x_i * inv, of scale and of the product), i.e. about amax / 254.

Non-finite values are never lost: a block holding an infinity or a NaN has scale NaN, so every
element of it dequantizes to NaN (an overflowing gradient stays visibly non-finite after a
quantized reduction, as it would be after a full-precision one; which element it was is lost).
A zero block has scale 0 and dequantizes to exact zeros, never 0 * inf. Results are bitwise
the same on every engine, NaN included: a bfloat16 result's NaN is 0x7FC0 (``narrow``; torch's
own float32 -> bfloat16 conversion writes 0xFFFF on its vectorized path), a float32 one's is
0x7FC00000 on the CPU (on a GPU, the GPU's).

Error feedback carries ``carried(x, y) = x - y`` per element (x what was quantized, residual
included; y what the receivers decode), except in a non-finite block: there it is 0. The block
is sent as NaN, and the error it carried is dropped with it: kept, x - NaN would make every
later call quantize x + NaN in that block, so one overflow would poison the rest of training;
dropped, the next call quantizes its own x alone and recovers (what the block had carried
before the overflow is lost, as the overflowing step's gradient is).

Wire format of one quantized piece of n elements (what crosses a link): ``ceil(n / B)``
float32 scales, then n int8 values, then zeros to a multiple of 4 bytes: ``packed_bytes(n, B)``
(a quarter of float32's plus 4 / B). Reductions never add int8 values: each rank's piece is dequantized to
float32 and the pieces are summed in float32 in group-rank order (rank 0's first), then rounded
once to the output dtype; see ``fastpar.comm.quantized`` for where each collective does it.
"""

from __future__ import annotations

import dataclasses
import os

import torch

KINDS = ("int8",)
DTYPES = (torch.float32, torch.bfloat16)  # what may be quantized
DEFAULT_BLOCK = 256  # 1.6% of scales on int8; amax / 254 the rounding bound
MIN_BLOCK, MAX_BLOCK = 16, 1 << 16


def _block_from_env() -> int:
    raw = os.environ.get("FASTPAR_QUANT_BLOCK")
    if raw is None:
        return DEFAULT_BLOCK
    try:
        return check_block(int(raw))
    except ValueError as exc:
        raise ValueError(f"FASTPAR_QUANT_BLOCK={raw!r}: {exc}") from None


def check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or \
            not MIN_BLOCK <= block <= MAX_BLOCK or block % 16:
        raise ValueError(f"a quantization block must be a multiple of 16 elements from "
                         f"{MIN_BLOCK} to {MAX_BLOCK}, got {block!r}")
    return block


@dataclasses.dataclass(frozen=True)
class Quant:
    """How a collective quantizes: ``kind`` ("int8") and ``block`` (elements per scale)."""

    kind: str = "int8"
    block: int = DEFAULT_BLOCK

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"quant must be one of {', '.join(map(repr, KINDS))} (or None, "
                             f"or a comm.Quant), got {self.kind!r}")
        check_block(self.block)


def spec(quant) -> Quant | None:
    """``quant=`` of a collective as a ``Quant`` (None stays None): a kind's name takes the
    block from ``FASTPAR_QUANT_BLOCK`` (default 256)."""
    if quant is None or isinstance(quant, Quant):
        return quant
    if isinstance(quant, str):
        return Quant(quant, _block_from_env())
    raise TypeError(f"quant must be None, a kind name such as 'int8', or a comm.Quant; got "
                    f"{type(quant).__name__}")


def n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def packed_bytes(n: int, block: int) -> int:
    """Bytes of one quantized piece of n elements: its scales, then its int8 values, then
    zeros to a multiple of 4 bytes (so that pieces laid end to end keep their scales
    aligned)."""
    return 4 * n_blocks(n, block) + -(-n // 4) * 4


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (flat, float32) as (blocks, block), the last block padded with zeros (which change
    no block's amax)."""
    n = x.numel()
    pad = n_blocks(n, block) * block - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, block)


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: int8 values (x's number of elements, flat) and float32 scales, one per
    block (the module docstring's definition)."""
    q, scales = quantize_rows(x.reshape(1, -1), block)
    return q.reshape(-1), scales.reshape(-1)


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the 2-D ``x`` quantized on its own (its blocks start at its first element):
    ``(q (rows, m) int8, scales (rows, ceil(m / block)) float32)``."""
    rows, m = x.shape
    nb = n_blocks(m, block)
    xb = x.float()
    if nb * block != m:  # zeros change no block's amax
        xb = torch.nn.functional.pad(xb, (0, nb * block - m))
    xb = xb.reshape(rows, nb, block)
    amax = xb.abs().amax(dim=2)  # NaN if the block holds one
    finite = torch.isfinite(amax)
    live = finite & (amax > 0)
    safe = torch.where(live, amax, torch.ones_like(amax))
    # Both divisions tensor by tensor: torch computes `127.0 / t` as reciprocal(t) * 127 (two
    # roundings), and on CUDA `t / 127.0` as t * (1 / 127); neither is an IEEE division.
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(live, c127 / safe, torch.zeros_like(amax))
    prod = xb * inv[..., None]
    q = torch.clamp(torch.round(prod), -127, 127)
    # prod is NaN in a non-finite block, and for a zero of a block whose inv overflowed to inf
    keep = finite[..., None] & ~prod.isnan()
    q = torch.where(keep, q, torch.zeros_like(q)).to(torch.int8)
    scales = torch.where(live, safe / c127, torch.where(finite, torch.zeros_like(amax),
                                                        torch.full_like(amax, float("nan"))))
    return q.reshape(rows, nb * block)[:, :m], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float32 values of ``q`` (flat) under its per-block ``scales``."""
    return dequantize_rows(q.reshape(1, -1), scales.reshape(1, -1), block).reshape(-1)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``quantize_rows``' inverse: float32 (rows, m)."""
    m = q.shape[1]
    return q.float() * scales.repeat_interleave(block, dim=1)[:, :m]


def pack_rows(x: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Each row of the 2-D ``x`` quantized into its wire format: ``out`` (rows, packed_bytes)
    uint8, contiguous. Returns ``out``."""
    rows, m = x.shape
    q, scales = quantize_rows(x, block)
    nb = scales.shape[1]
    out[:, :4 * nb].view(torch.float32).copy_(scales)
    out[:, 4 * nb:4 * nb + m].view(torch.int8).copy_(q)
    out[:, 4 * nb + m:].zero_()
    return out


BF16_NAN = 0x7FC0  # the one bfloat16 NaN a quantized result holds, on every engine


def narrow(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = the float32 ``y`` rounded once to out's dtype (float32: a copy; bfloat16: to
    nearest even), each NaN of a bfloat16 out as ``BF16_NAN``, the shm kernels' and the Triton
    kernels' NaN (torch's own conversion writes 0x7FC0 or 0xFFFF by code path). Returns out."""
    out.copy_(y)
    if out.dtype == torch.bfloat16:
        out.view(torch.int16).masked_fill_(y.isnan().view(out.shape), BF16_NAN)
    return out


def unpack_rows(buf: torch.Tensor, m: int, block: int) -> torch.Tensor:
    """float32 (rows, m) of packed pieces of m elements, one per row of ``buf``."""
    nb = n_blocks(m, block)
    return dequantize_rows(buf[:, 4 * nb:4 * nb + m].view(torch.int8),
                           buf[:, :4 * nb].view(torch.float32), block)


def carried(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What error feedback carries of ``x`` sent as ``y`` (its dequantized value, float32, x's
    shape): x - y in float32, and 0 in a block that is not finite (y NaN throughout it)."""
    d = x.float() - y
    return torch.where(y.isnan(), torch.zeros_like(d), d)


def roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """``dequantize(quantize(x))``: what a peer receives of x, float32, x's shape."""
    q, scales = quantize(x, block)
    return dequantize(q, scales, block).view(x.shape)


def bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element of x, the largest |x - roundtrip(x)| the definition allows: scale / 2 + 4 u
    amax of its block (float64; inf for a non-finite block, whose elements come back NaN)."""
    xb = _blocks(x.reshape(-1).double(), block)
    amax = xb.abs().amax(dim=1)
    per = amax / 127 / 2 + 4 * 2.0**-24 * amax
    per = torch.where(torch.isfinite(amax), per, torch.full_like(per, float("inf")))
    return per.repeat_interleave(block)[:x.numel()].view(x.shape)

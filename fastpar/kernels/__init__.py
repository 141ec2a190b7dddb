"""Triton kernels: a GEMM with a fused bias + activation epilogue, the same GEMM publishing
row-block completion flags (the producer side of overlapped GEMM + communication), and the
block-scaled int8 codec of the quantized collectives for GPU tensors.

    from fastpar.kernels import linear
    y = linear(x, weight, bias, activation="gelu")   # act(F.linear(x, weight, bias)), one kernel
    pack_rows(x, block, out)                         # comm.quant.pack_rows, bit for bit

Triton is optional (``pip install 'fastpar[triton]'``): without it this package still imports
and calling a kernel raises ImportError. CPU tensors run through Triton's interpreter, which
Triton switches on when this package is imported, so set ``TRITON_INTERPRET=1`` before that.
"""

import importlib.util

__all__ = ["linear", "linear_with_flags", "pack_rows", "unpack_rows", "sum_packed_rows"]

if importlib.util.find_spec("triton") is not None:
    from .gemm import linear
    from .flags import linear_with_flags
    from .quant import pack_rows, sum_packed_rows, unpack_rows
else:
    def _needs_triton(name):
        def missing(*args, **kwargs):
            raise ImportError(f"fastpar.kernels.{name} needs Triton, which is not installed: "
                              f"pip install triton (or pip install 'fastpar[triton]')")
        missing.__name__ = missing.__qualname__ = name
        return missing

    linear = _needs_triton("linear")
    linear_with_flags = _needs_triton("linear_with_flags")
    pack_rows = _needs_triton("pack_rows")
    unpack_rows = _needs_triton("unpack_rows")
    sum_packed_rows = _needs_triton("sum_packed_rows")

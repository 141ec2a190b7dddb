"""Triton kernels: a GEMM with a fused bias + activation epilogue, and the same GEMM publishing
row-block completion flags (the producer side of overlapped GEMM + communication).

    from fastpar.kernels import linear
    y = linear(x, weight, bias, activation="gelu")   # act(F.linear(x, weight, bias)), one kernel

Triton is optional (``pip install 'fastpar[triton]'``): without it this package still imports
and calling a kernel raises ImportError. CPU tensors run through Triton's interpreter, which
Triton switches on when this package is imported, so set ``TRITON_INTERPRET=1`` before that.
"""

import importlib.util

__all__ = ["linear", "linear_with_flags"]

if importlib.util.find_spec("triton") is not None:
    from .gemm import linear
    from .flags import linear_with_flags
else:
    def _needs_triton(name):
        def missing(*args, **kwargs):
            raise ImportError(f"fastpar.kernels.{name} needs Triton, which is not installed: "
                              f"pip install triton (or pip install 'fastpar[triton]')")
        missing.__name__ = missing.__qualname__ = name
        return missing

    linear = _needs_triton("linear")
    linear_with_flags = _needs_triton("linear_with_flags")

"""Build of the native extension ``fastpar._C`` from ``csrc/``.

The CPU part is always built. The CUDA part (``csrc/cuda/*.cu``) is added when torch is a CUDA
build and ``nvcc`` is found; ``FASTPAR_CUDA=0`` skips it, ``FASTPAR_CUDA=1`` makes its absence an
error. A failed build fails the install loudly; ``python -m fastpar info`` reports what was built.
"""

import glob
import os
import re
import shutil
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit("fastpar's build needs torch installed first: `pip install torch`, then "
             "`pip install --no-build-isolation -e .`")

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = re.search(r'__version__ = "([^"]+)"',
                    open(os.path.join(HERE, "fastpar", "version.py")).read()).group(1)


def want_cuda() -> bool:
    flag = os.environ.get("FASTPAR_CUDA", "auto").lower()
    have = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or cpp_extension.CUDA_HOME is not None)
    if flag in ("1", "true", "yes") and not have:
        sys.exit(f"FASTPAR_CUDA=1 but torch {torch.__version__} is not a CUDA build or nvcc "
                 "was not found")
    return have and flag not in ("0", "false", "no")


def sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


def extension():
    cpp = sources("csrc/*.cpp") + sources("csrc/shm/*.cpp")
    cpp = [p for p in cpp if not p.endswith("_selftest.cpp")]
    macros = [("FASTPAR_VERSION_STRING", f'"{VERSION}"')]
    # torch >= 2.10 headers use C++20 (bit-field initialisers); gcc >= 10 and nvcc 12+ take it.
    # -ffp-contract=off: a multiply and an add stay two roundings (GCC would fuse them, even
    # intrinsics, in the AVX-512 functions, which bring FMA), so the shm kernels' int8 loops give
    # bitwise fastpar.comm.quant's results on every path.
    # -fopenmp: at::parallel_for in our loops (the quantized GEMM) runs on torch's OpenMP
    # threads; the link names libgomp.so.1, which torch's wheel has already loaded (one runtime)
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-ffp-contract=off", "-fopenmp"]
    link = ["-fopenmp"]
    if want_cuda():
        macros.append(("FASTPAR_WITH_CUDA", "1"))
        nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr",
                "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                # PTX too, so newer GPUs (sm100) JIT the kernels instead of failing to launch
                "-gencode=arch=compute_90,code=compute_90"]
        return cpp_extension.CUDAExtension(
            "fastpar._C", cpp + sources("csrc/cuda/*.cu"), define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link)
    return cpp_extension.CppExtension("fastpar._C", cpp, define_macros=macros,
                                      extra_compile_args={"cxx": cxx}, extra_link_args=link,
                                      libraries=["rt"])


setup(
    version=VERSION,
    ext_modules=[] if os.environ.get("FASTPAR_SKIP_EXT") == "1" else [extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

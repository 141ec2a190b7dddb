"""The pure shared-memory kernel on its own (no torch): csrc/shm/shm_selftest.cpp, built with the
same compiler as the extension, run as forked ranks at worlds 1-4 (conversions on all 65,536
half values, every op x dtype at sizes 1, 7, 4099, 1M+3, mismatches, timeouts, two segments; the
int8 codec's scalar, AVX2 and AVX-512 loops against each other and its definition, the int8
collectives on every path against the codec applied by hand, their mismatches)."""

import os
import shlex
import shutil
import sys

import pytest

from tests import background

pytestmark = pytest.mark.quick  # every test here: the quick tier

SHM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "shm")


def BACKGROUND_JOBS(workdir: str) -> dict:
    """Build and run the self-test, started when collection ends (tests.background)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return {"selftest": "no C++ compiler on the PATH"}
    exe = os.path.join(workdir, "shm_selftest")
    sources = [os.path.join(SHM, f) for f in
               ("shm_collectives.cpp", "shm_reduce.cpp", "shm_quant.cpp", "shm_quantized.cpp",
                "shm_selftest.cpp")]
    # -ffp-contract=off as setup.py builds it: the int8 loops' paths agree bitwise only unfused
    build = [cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-pthread", *sources, "-o", exe]
    return {"selftest": ["sh", "-c", f"{shlex.join(build)} && {shlex.quote(exe)} --no-bench"]}


def test_shm_kernel_selftest():
    run = background.result(sys.modules[__name__], "selftest", timeout=600)
    if isinstance(run, str):
        pytest.skip(run)
    assert run.returncode == 0 and "ALL PASS" in run.stdout, run.describe()

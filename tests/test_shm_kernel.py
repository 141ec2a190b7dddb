"""The pure shared-memory kernel on its own (no torch): csrc/shm/shm_selftest.cpp, built with the
same compiler as the extension, run as forked ranks at worlds 1-4 (conversions on all 65,536
half values, every op x dtype at sizes 1, 7, 4099, 1M+3, mismatches, timeouts, two segments; the
int8 codec's scalar, AVX2 and AVX-512 loops against each other and its definition, the int8
collectives on every path against the codec applied by hand, their mismatches)."""

import os
import shutil
import subprocess

import pytest

SHM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "shm")


def test_shm_kernel_selftest(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on the PATH")
    exe = tmp_path / "shm_selftest"
    sources = [os.path.join(SHM, f) for f in
               ("shm_collectives.cpp", "shm_reduce.cpp", "shm_quant.cpp", "shm_quantized.cpp",
                "shm_selftest.cpp")]
    # -ffp-contract=off as setup.py builds it: the int8 loops' paths agree bitwise only unfused
    build = subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-pthread", *sources,
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe), "--no-bench"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ALL PASS" in run.stdout, run.stdout[-3000:] + run.stderr

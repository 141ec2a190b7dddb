"""GPU-marked tests run only where CUDA is available (tests/gpu_check.sh on a GPU machine);
elsewhere they are reported as skipped, never as passed.

The nvcc compile checks (tests/test_cuda_compile.py) start in the background, at low priority,
as soon as the session's tests are collected, and their file runs last: the compiles use the
time other tests spend waiting on timeouts and peers instead of adding to the suite's."""

import shutil
import tempfile

import pytest
import torch

COMPILE_TESTS = "tests/test_cuda_compile.py::"


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only what will run
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu_check.sh on a GPU "
                                       "machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    compile_items = [i for i in items if i.nodeid.startswith(COMPILE_TESTS)]
    if compile_items and len(compile_items) < len(items):
        items[:] = [i for i in items if not i.nodeid.startswith(COMPILE_TESTS)] + compile_items
        import pathlib

        from tests import test_cuda_compile

        config.fastpar_nvcc_dir = tempfile.mkdtemp(prefix="fastpar-nvcc-")
        config.fastpar_nvcc_jobs = test_cuda_compile.start_jobs(
            pathlib.Path(config.fastpar_nvcc_dir))


def pytest_unconfigure(config):
    jobs = getattr(config, "fastpar_nvcc_jobs", None)
    if jobs is not None:
        from tests import test_cuda_compile

        test_cuda_compile.stop_jobs(jobs)
        shutil.rmtree(config.fastpar_nvcc_dir, ignore_errors=True)

"""GPU-marked tests run only where CUDA is available (tests/gpu_check.sh on a GPU machine);
elsewhere they are reported as skipped, never as passed.

A suite started in the background by a shell (``cmd &``, ``nohup``) inherits SIGINT ignored, and
so would every process it starts: the tests that interrupt a rank with SIGINT then wait for
nothing. A handler here (not ``SIG_IGN``) puts each started program back on the default."""

import signal

import pytest
import torch

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the background jobs (tests.background) of every selected module."""
    from tests import background

    for module in {id(item.module): item.module for item in session.items
                   if getattr(item, "module", None) is not None}.values():
        background.start_module(module)


def pytest_sessionfinish(session, exitstatus):
    """End the rank pools (tests.rank_pool) and background jobs the session started."""
    import sys

    from tests import background

    if "tests.rank_pool" in sys.modules:
        sys.modules["tests.rank_pool"].close_all()
    background.close_all()

"""GPU-marked tests run only where CUDA is available (tests/gpu_check.sh on a GPU machine);
elsewhere they are reported as skipped, never as passed.

A suite started in the background by a shell (``cmd &``, ``nohup``) inherits SIGINT ignored, and
so would every process it starts: the tests that interrupt a rank with SIGINT then wait for
nothing. A handler here (not ``SIG_IGN``) puts each started program back on the default.

The run's shared directory (``FASTPAR_TEST_SHARED``: tests.background's jobs) is made here by the
controller, before pytest-xdist's workers start, and removed when it ends; the longest modules are
put first (``LONGEST_FIRST``)."""

import os
import shutil
import signal
import tempfile

import pytest
import torch

from tests.background import SHARED_ENV

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Modules that take longest (each launches several multi-rank jobs or trainings), run first so
# that pytest-xdist's workers (FASTPAR_TEST_WORKERS=N scripts/test.sh, --no-loadscope-reorder)
# end together rather than one of them starting the longest module last. The rest keep their
# order.
LONGEST_FIRST = ["test_train", "test_cluster_jobs", "test_bench", "test_reliability",
                 "test_comm_collectives", "test_checkpoint_sharded", "test_init_errors",
                 "test_pipeline", "test_symmetric", "test_shm_p2p", "test_topology"]
CLUSTER_MODULES = {"test_cluster", "test_cluster_jobs"}  # fastpar.testing.cluster's users
_MADE_SHARED: list[str] = []


def pytest_configure(config):
    """The run's shared directory (tests.background), made by the controller before pytest-xdist
    starts its workers, which inherit it."""
    if not hasattr(config, "workerinput"):  # a fresh one, even in a pytest a test started
        path = tempfile.mkdtemp(prefix="fastpar-tests-")
        os.environ[SHARED_ENV] = path
        _MADE_SHARED.append(path)


def pytest_unconfigure(config):
    while _MADE_SHARED:
        path = _MADE_SHARED.pop()
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(SHARED_ENV, None)


def _module_name(item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


def _module_order(item) -> int:
    name = _module_name(item)
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_order)  # stable: a module's tests keep their order
    if config.pluginmanager.hasplugin("xdist"):
        # --dist loadgroup (scripts/test.sh): a module runs in one worker, whole (its module
        # fixtures, its rank pools); the modules that make namespaced clusters run in one
        # worker, one after another, since test_cluster checks the machine's own state
        for item in items:
            name = _module_name(item)
            group = "cluster" if name in CLUSTER_MODULES else name
            item.add_marker(pytest.mark.xdist_group(group))
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
    background.close_all(interrupted=exitstatus == pytest.ExitCode.INTERRUPTED
                         or bool(session.shouldstop) or bool(session.shouldfail))

"""PyTorch's own distributed test base (``DistributedTest._DistTestBase``, shipped in the torch
wheel) on a backend named by ``BACKEND`` (``fastpar`` or ``gloo``), as PyTorch's
test_distributed_spawn.py runs it:

    BACKEND=fastpar WORLD_SIZE=2 python -m pytest tests/torch_dist_suite.py -k test_all_reduce

fastpar is declared where torch's tables name the backends that have a feature
(``DistTestCases``): everything gloo is declared for, as a CPU backend of the same reach.
``tests/test_backend_torch_suite.py`` runs a subset under both backends in CI; docs/backend.md
has the whole run's counts and every test that differs, with why.
"""

import os
import sys

BACKEND = os.environ.setdefault("BACKEND", "fastpar")
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402

import fastpar  # noqa: E402,F401  (registers the backend, here and in every spawned rank)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if BACKEND == "fastpar":
    for feature, backends in DistTestCases.backend_feature.items():
        if "gloo" in backends and (feature not in ("gpu", "cuda") or torch.cuda.is_available()):
            backends.add("fastpar")
    DistTestCases.backend_feature["plugin"].add("fastpar")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())

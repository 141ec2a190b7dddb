"""PyTorch's own distributed test base (``DistributedTest._DistTestBase``, shipped in the torch
wheel) on a backend named by ``BACKEND`` (``fastpar`` or ``gloo``), as PyTorch's
test_distributed_spawn.py runs it:

    BACKEND=fastpar WORLD_SIZE=2 python -m pytest tests/torch_dist_suite.py -k test_all_reduce

fastpar is declared where torch's tables name the backends that have a feature
(``DistTestCases``): everything gloo is declared for, as a CPU backend of the same reach.
Many of the base's tests name their backends literally (``BACKEND == "gloo"``, sets of names
that no table extends) and skip for any other: ``BACKEND=fastpar-as-gloo`` runs the base with
gloo's expectations, every group it makes (``init_process_group``, ``new_group``) on fastpar
instead of gloo. ``tests/test_backend_torch_suite.py`` runs a subset in CI; docs/backend.md has
the whole runs' counts and every test that differs, with why.
"""

import os
import sys

BACKEND = os.environ.setdefault("BACKEND", "fastpar")
AS_GLOO = BACKEND == "fastpar-as-gloo"
if AS_GLOO:  # the base reads BACKEND at import: gloo's expectations
    os.environ["BACKEND"] = BACKEND = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fastpar  # noqa: E402,F401  (registers the backend, here and in every spawned rank)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if AS_GLOO:
    os.environ["FASTPAR_SUITE_AS_GLOO"] = "1"  # spawned ranks re-import this module

if os.environ.get("FASTPAR_SUITE_AS_GLOO") == "1":
    def _on_fastpar(make):
        def made(*args, **kwargs):
            if kwargs.get("backend") == "gloo":
                kwargs["backend"] = "fastpar"
            return make(*args, **kwargs)
        return made

    dist.init_process_group = _on_fastpar(dist.init_process_group)
    dist.new_group = _on_fastpar(dist.new_group)

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

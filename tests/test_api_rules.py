"""Rules of the public API that need no second rank: names mean one thing, a missing init is an
error, decisions can be seen, the torch floor is enforced."""

import logging
import sys

import pytest
import torch

import fastpar
from fastpar.comm import policy, routing
from fastpar.comm.state import CommState
from fastpar.version import MIN_TORCH, check_torch
from tests.multirank import launch


@pytest.mark.quick
def test_topology_names_one_thing():
    import importlib

    assert callable(fastpar.topology) and fastpar.topology.__module__ == "fastpar.runtime.bootstrap"
    grid = importlib.import_module("fastpar.grid")
    assert grid.Topology is fastpar.Topology and grid.Grid is fastpar.Grid
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fastpar.topology")


@pytest.mark.quick
@pytest.mark.parametrize("version, ok", [("2.4.1", False), ("2.4.0+cu121", False), ("1.13.1", False),
                                         ("2.5.0", True), ("2.6.0a0+git1234", True),
                                         ("2.13.0+cpu", True), ("3.0.0", True)])
def test_torch_floor(version, ok):
    if ok:
        check_torch(version)
    else:
        need = ".".join(map(str, MIN_TORCH))
        with pytest.raises(ImportError, match=f"fastpar needs torch >= {need} .*found torch "
                                              f"{version.replace('+', '.')}"):
            check_torch(version)


def test_torch_floor_is_enforced_at_import():
    code = "import torch; torch.__version__ = '2.4.1'; import fastpar"
    proc = launch([sys.executable, "-c", code])
    assert proc.returncode != 0
    assert "ImportError: fastpar needs torch >= 2.5" in proc.stderr, proc.stderr
    assert "found torch 2.4.1" in proc.stderr


@pytest.mark.quick
def test_missing_init_is_an_error_where_a_group_is_asked_for():
    import torch.distributed as dist

    from fastpar import comm
    from fastpar.nn import ColumnParallelLinear, vocab_parallel_cross_entropy
    from fastpar.runtime import group_rank, group_size

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="call fastpar.init"):
        group_size(object())
    with pytest.raises(RuntimeError, match="call fastpar.init"):
        group_rank(object())
    with pytest.raises(RuntimeError, match="fastpar.init"):
        ColumnParallelLinear(4, 4)
    with pytest.raises(RuntimeError, match="fastpar.init"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="fastpar.init"):
        comm.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="fastpar.init"):
        fastpar.nn.random.seed(0)
    with pytest.raises(ValueError, match="group is None"):
        group_size(None)


@pytest.mark.quick
def test_autograd_collectives_take_no_default_group():
    from fastpar import comm

    fastpar.init(timeout=30)
    try:
        for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp,
                   comm.all_gather_sequence, comm.reduce_scatter_sequence, comm.scatter_sequence,
                   comm.gather_sequence):
            with pytest.raises(ValueError, match=f"{fn.__name__}: group is None"):
                fn(torch.ones(2, 2), None)
    finally:
        fastpar.shutdown()


@pytest.mark.quick
def test_engine_decision_is_logged_with_its_reason(caplog):
    from fastpar import comm

    fastpar.init(timeout=30)
    try:
        with caplog.at_level(logging.DEBUG, logger="fastpar.comm"):
            comm.all_reduce(torch.ones(3))
        assert any("all_reduce (sum, torch.float32, cpu) on global ranks [0] -> local: group of "
                   "one rank" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        fastpar.shutdown()


class _FakeCudaTensor:
    """What the policy reads of a tensor: a CUDA tensor without a GPU."""

    is_cuda, dtype, device = True, torch.float32, torch.device("cuda", 0)

    def numel(self):
        return 1024

    def element_size(self):
        return 4


@pytest.mark.quick
@pytest.mark.parametrize("forced, builds", [(None, True), ("cuda_ipc", True), ("nccl", False),
                                            ("gloo", False)])
def test_cuda_ipc_is_built_only_when_it_may_be_chosen(forced, builds, monkeypatch):
    state = CommState.__new__(CommState)
    state.forced, state.forced_by = forced, "FASTPAR_COMM_BACKEND"
    built = []
    facts = policy.GroupFacts(size=2, same_host=True, pg_backend="nccl")
    monkeypatch.setattr(state, "resolve", lambda group: ("g", [0, 1], facts), raising=False)
    monkeypatch.setattr(state, "communicator", lambda engine, *a: built.append(engine.name),
                        raising=False)
    monkeypatch.setattr(routing, "current", lambda: state)
    try:  # the route's choice: a CUDA all_reduce probes the group's CUDA IPC communicator
        engine = routing.choose("all_reduce", _FakeCudaTensor(), None)[2].engine
    except ValueError as exc:  # a forced engine that cannot serve (no IPC, a gloo group)
        engine = str(exc)
    assert bool(built) == builds, (forced, built)
    want = {None: "nccl", "nccl": "nccl", "gloo": "FASTPAR_COMM_BACKEND=gloo cannot serve",
            "cuda_ipc": "FASTPAR_COMM_BACKEND=cuda_ipc cannot serve"}[forced]
    assert engine.startswith(want), engine


def test_subpackages_are_attributes_of_the_package():
    """``import fastpar; fastpar.pipeline.Pipeline`` works as the contract writes it, while
    ``import fastpar`` alone still imports neither the pipeline, the models nor Triton."""
    code = ("import sys, fastpar\n"
            "heavy = [m for m in ('fastpar.pipeline', 'fastpar.models', 'fastpar.training',\n"
            "                     'fastpar.kernels', 'triton') if m in sys.modules]\n"
            "assert heavy == [], heavy\n"
            "assert fastpar.pipeline.Pipeline.__name__ == 'Pipeline'\n"
            "assert fastpar.models.GPT and fastpar.training.data.Sampler\n"
            "assert fastpar.comm.all_reduce and fastpar.runtime.job\n"
            "assert {'pipeline', 'kernels', 'models'} <= set(dir(fastpar))\n"
            "try:\n    fastpar.nonexistent\nexcept AttributeError as e:\n    print(e)\n")
    proc = launch([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "module 'fastpar' has no attribute 'nonexistent'" in proc.stdout

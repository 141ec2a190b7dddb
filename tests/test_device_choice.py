"""Device choice from (local rank, ranks on this host, visible GPUs). The GPU count is faked
(this machine has none); the rule under test is fastpar's, not CUDA's."""

import pytest
import torch

from fastpar.runtime.bootstrap import _choose_device

pytestmark = pytest.mark.quick  # every test here: the quick tier


@pytest.fixture
def gpus(monkeypatch):
    chosen = []

    def visible(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen
    return visible


def test_cpu_without_cuda(gpus):
    gpus(0)
    assert _choose_device(3, 4) == torch.device("cpu")


def test_one_gpu_per_local_rank(gpus):
    chosen = gpus(8)
    assert _choose_device(5, 8) == torch.device("cuda", 5)
    assert chosen == [5]


def test_more_ranks_than_gpus_names_both_numbers(gpus, monkeypatch):
    gpus(2)
    monkeypatch.delenv("FASTPAR_SHARED_GPU", raising=False)
    with pytest.raises(ValueError, match="4 ranks on this host but only 2 visible GPUs"):
        _choose_device(3, 4)


def test_shared_gpu_opt_in(gpus, monkeypatch):
    chosen = gpus(1)
    monkeypatch.setenv("FASTPAR_SHARED_GPU", "1")
    assert _choose_device(3, 4) == torch.device("cuda", 0)
    assert chosen == [0]

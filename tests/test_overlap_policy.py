"""The overlap=None policy (``fastpar.nn.overlap.decide``) as a table, the cut of token ranges
into pieces, and the layers' ``overlap_pieces=`` (and its deprecated name ``chunks=``); the
overlapped layers themselves are checked against serial modules in tests/test_tp_layers.py
(check_overlap)."""

import pytest

import torch

from fastpar.nn.overlap import CUDA_FOUR_PIECES_BYTES, Decision, decide, pieces
from fastpar.nn.overlap_signal import signal_path, signal_refusal

pytestmark = pytest.mark.quick  # every test here: the quick tier

MiB = 1 << 20


@pytest.mark.parametrize("overlap, overlap_pieces, tp, device, engine, nbytes, on, k, words", [
    # forced either way, and tp 1 whatever is asked
    (True, None, 2, "cpu", "shm", 64, True, 2, "overlap=True"),
    (True, 3, 4, "cuda", "nccl", 64, True, 3, "overlap=True"),
    (False, 4, 2, "cuda", "nccl", 64 * MiB, False, 1, "overlap=False"),
    (True, 4, 1, "cuda", "local", 64 * MiB, False, 1, "tp 1"),
    (None, None, 1, "cpu", "local", 64 * MiB, False, 1, "no communication"),
    # CPU: shm and mpi complete before returning; gloo measured no better (the cores are shared)
    (None, None, 2, "cpu", "shm", 256 * MiB, False, 1, "shm engine completes"),
    (None, None, 4, "cpu", "mpi", 256 * MiB, False, 1, "mpi engine completes"),
    (None, None, 2, "cpu", "gloo", 256 * MiB, False, 1, "share the cores: measured"),
    (None, 3, 2, "cpu", "gloo", 8 * MiB, False, 1, "overlap=True forces it"),
    # CUDA: any engine runs on the comm stream; 2 pieces, 4 from 16 MiB
    (None, None, 8, "cuda", "nccl", MiB - 1, False, 1, "latency-bound"),
    (None, None, 8, "cuda", "nccl", MiB, True, 2, "on nccl (cuda)"),
    (None, None, 2, "cuda", "cuda_ipc", 4 * MiB, True, 2, "on cuda_ipc"),
    (None, None, 4, "cuda", "nccl", CUDA_FOUR_PIECES_BYTES, True, 4, "on nccl"),
    (None, 8, 4, "cuda", "nccl_mpi", CUDA_FOUR_PIECES_BYTES, True, 8, "on nccl_mpi"),
    # autocast: the Functions do not run under it yet, forced or not
    ("autocast", None, 2, "cuda", "nccl", 64 * MiB, False, 1, "autocast is on"),
    ("autocast-forced", 2, 2, "cuda", "nccl", 64 * MiB, False, 1, "overlap=True not honoured"),
])
def test_overlap_policy_table(overlap, overlap_pieces, tp, device, engine, nbytes, on, k,
                              words):
    autocast = isinstance(overlap, str)
    overlap = {"autocast": None, "autocast-forced": True}.get(overlap, overlap) \
        if autocast else overlap
    d = decide(overlap, overlap_pieces, tp=tp, device=device, engine=engine, nbytes=nbytes,
               autocast=autocast)
    assert (d.enabled, d.pieces) == (on, k), d
    assert words in d.reason, d
    assert str(d).startswith("on, " if on else "off (")


@pytest.mark.parametrize("length, count, want", [
    (8, 1, [(0, 8)]),
    (8, 3, [(0, 2), (2, 5), (5, 8)]),
    (7, 4, [(0, 1), (1, 3), (3, 5), (5, 7)]),
    (2, 4, [(0, 1), (1, 2)]),  # never an empty piece
    (1, 3, [(0, 1)]),
])
def test_pieces_cover_the_range_evenly(length, count, want):
    got = pieces(length, count)
    assert got == want
    assert max(b - a for a, b in got) - min(b - a for a, b in got) <= 1


OK = dict(device="cuda", sp=False, triton=None, ipc_max_bytes=64 * MiB, dtype=torch.bfloat16,
          rows=4096, cols=4096, sms=132)


@pytest.mark.parametrize("change, words", [
    ({}, None),  # an H100/H200 and a 4096-token bf16 layer: served
    (dict(rows=8192, cols=4096, dtype=torch.float16), None),  # 64 row blocks, 64 MiB: still
    (dict(device="cpu"), "needs CUDA tensors, got cpu"),
    (dict(sp=True), "not sequence parallelism's reduce-scatter"),
    (dict(triton="Triton runs in its interpreter"), "needs compiled Triton: Triton runs in"),
    (dict(ipc_max_bytes=0), "needs the group's cuda_ipc communicator"),
    (dict(dtype=torch.float64), "not torch.float64"),
    (dict(ipc_max_bytes=256 << 10), "exceed the cuda_ipc limit of 262144"),
    (dict(cols=4095), "a row of 8190 bytes is not a multiple of 16"),
    (dict(rows=8193, cols=1024), "65 row blocks of 128; the consumer takes at most 64"),
    (dict(rows=4096, sms=60), "over half of the GPU's 60 multiprocessors"),
    (dict(weight_dtype=torch.float32), "input torch.bfloat16 and weight torch.float32 differ"),
])
def test_signal_driven_path_refusals(change, words):
    why = signal_refusal(**{**OK, **change})
    assert why is None if words is None else words in why, why


def test_signal_driven_path_falls_back_on_cpu_with_its_reason():
    x, w = torch.ones(4, 8), torch.ones(6, 8)
    comm, why = signal_path(x, w, group=None, sp=False)  # refused before any group is asked
    assert comm is None and why == "signal-driven path needs CUDA tensors, got cpu"


def test_chunks_is_a_deprecated_name_of_overlap_pieces():
    """``chunks=`` (in fastpar: the pipeline's model chunks) still reaches every overlapped
    layer for one release, warning at the caller's line with the new keyword; both at once is a
    ValueError naming both values; ``Decision.chunks`` warns likewise."""
    import warnings

    import fastpar
    from fastpar import nn as pnn

    fastpar.init(timeout=30)
    try:
        for make in (lambda **kw: pnn.ColumnParallelLinear(8, 8, overlap=True, **kw),
                     lambda **kw: pnn.RowParallelLinear(8, 8, overlap=True, **kw),
                     lambda **kw: pnn.ParallelMLP(8, 16, overlap=True, **kw),
                     lambda **kw: pnn.ParallelSelfAttention(8, 2, overlap=True, **kw)):
            with pytest.warns(DeprecationWarning, match=r"use overlap_pieces=3") as caught:
                layer = make(chunks=3)
            assert [w.filename for w in caught] == [__file__], [w.filename for w in caught]
            linears = [m for m in layer.modules() if hasattr(m, "overlap_pieces")]
            assert linears and all(m.overlap_pieces == 3 for m in linears)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the new name warns about nothing
                assert make(overlap_pieces=3) is not None
            with pytest.raises(ValueError, match=r"chunks=3 and overlap_pieces=4"):
                make(chunks=3, overlap_pieces=4)
    finally:
        fastpar.shutdown()
    d = Decision(True, 4, "overlap=True")
    assert str(d) == "on, 4 pieces (overlap=True)"
    with pytest.warns(DeprecationWarning, match="Decision.pieces"):
        assert d.chunks == 4

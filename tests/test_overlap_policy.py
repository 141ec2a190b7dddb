"""The overlap=None policy (``fastpar.nn.overlap.decide``) as a table, and the chunking of token
ranges; the overlapped layers themselves are checked against serial modules in
tests/test_tp_layers.py (check_overlap)."""

import pytest

from fastpar.nn.overlap import CUDA_FOUR_CHUNKS_BYTES, decide, pieces

MiB = 1 << 20


@pytest.mark.parametrize("overlap, chunks, tp, device, engine, nbytes, on, k, words", [
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
    # CUDA: any engine runs on the comm stream; 2 chunks, 4 from 16 MiB
    (None, None, 8, "cuda", "nccl", MiB - 1, False, 1, "latency-bound"),
    (None, None, 8, "cuda", "nccl", MiB, True, 2, "on nccl (cuda)"),
    (None, None, 2, "cuda", "cuda_ipc", 4 * MiB, True, 2, "on cuda_ipc"),
    (None, None, 4, "cuda", "nccl", CUDA_FOUR_CHUNKS_BYTES, True, 4, "on nccl"),
    (None, 8, 4, "cuda", "nccl_mpi", CUDA_FOUR_CHUNKS_BYTES, True, 8, "on nccl_mpi"),
])
def test_overlap_policy_table(overlap, chunks, tp, device, engine, nbytes, on, k, words):
    d = decide(overlap, chunks, tp=tp, device=device, engine=engine, nbytes=nbytes)
    assert (d.enabled, d.chunks) == (on, k), d
    assert words in d.reason, d
    assert str(d).startswith("on, " if on else "off (")


@pytest.mark.parametrize("length, chunks, want", [
    (8, 1, [(0, 8)]),
    (8, 3, [(0, 2), (2, 5), (5, 8)]),
    (7, 4, [(0, 1), (1, 3), (3, 5), (5, 7)]),
    (2, 4, [(0, 1), (1, 2)]),  # never an empty piece
    (1, 3, [(0, 1)]),
])
def test_pieces_cover_the_range_evenly(length, chunks, want):
    got = pieces(length, chunks)
    assert got == want
    assert max(b - a for a, b in got) - min(b - a for a, b in got) <= 1

"""CUDA IPC all-reduce on real processes sharing the GPU(s): every dtype, 16 B to 8 MB."""

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.gpu


def body_ipc_sweep():
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=120)
    n, rank = topo.world_size, topo.rank
    comm.use_backend("cuda_ipc")
    checked = 0
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = 16
        while nbytes <= 8 << 20:
            count = nbytes // esize
            ins = [torch.randn(count, generator=torch.Generator().manual_seed(r * 7919 + count),
                               dtype=torch.float64) for r in range(n)]
            x = ins[rank].to(dtype).to(topo.device)
            want = torch.stack([i.to(dtype).double() for i in ins]).sum(0)
            comm.all_reduce(x)
            err = (x.double().cpu() - want).abs().max().item()
            assert err <= tol * max(1.0, want.abs().max().item()), (dtype, nbytes, err)
            checked += 1
            nbytes *= 4
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_ipc_every_dtype_and_size(world):
    # torchrun: it comes with torch, while a GPU machine's image may have no mpirun.
    counts = run_ranks(world, body_ipc_sweep, launcher="torchrun",
                       env={"FASTPAR_SHARED_GPU": "1"}, timeout=240).values()
    assert counts[0] == 3 * 10

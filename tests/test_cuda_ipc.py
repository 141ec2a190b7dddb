"""CUDA IPC all-reduce on real processes sharing the GPU(s): every dtype, 16 B to 8 MB; and
the same on CUDA symmetric tensors (``comm.symmetric_empty(device=...)``), reduced in place,
bitwise equal to the copying path, interleaved with it."""

import pytest

from tests.multirank import count_calls, run_ranks

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
    return checked, symmetric_sweep(topo)


def symmetric_sweep(topo):
    """Symmetric tensors against the copying path on the same inputs: bitwise equal; the
    symmetric kernel is the one that ran (counted)."""
    import torch

    from fastpar import comm
    from fastpar.comm.cuda_ipc import CudaIpcCommunicator

    taken = count_calls(CudaIpcCommunicator, "all_reduce_symmetric")
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        esize = torch.empty((), dtype=dtype).element_size()
        for nbytes in (16, 4096, 65536 + 48, 1 << 20, 8 << 20):
            count = nbytes // esize
            g = torch.Generator().manual_seed(topo.rank * 31 + count)
            data = torch.randn(count, generator=g).to(dtype).to(topo.device)
            x = comm.symmetric_empty(count, dtype=dtype, device=topo.device)
            x.copy_(data)
            ref = data.clone()
            comm.all_reduce(ref)  # the copying path, between two symmetric calls
            comm.all_reduce(x)
            assert torch.equal(x.view(torch.uint8), ref.view(torch.uint8)), (dtype, nbytes)
            comm.all_reduce(x)  # again, in place: the sum of sums
            comm.all_reduce(ref)
            assert torch.equal(x.view(torch.uint8), ref.view(torch.uint8)), (dtype, nbytes)
            checked += 1
    assert taken["all_reduce_symmetric"] == 2 * checked, (taken, checked)
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_ipc_every_dtype_and_size(world):
    # torchrun: it comes with torch, while a GPU machine's image may have no mpirun.
    counts = run_ranks(world, body_ipc_sweep, launcher="torchrun",
                       env={"FASTPAR_SHARED_GPU": "1"}, timeout=240).values()
    assert list(counts[0]) == [3 * 10, 3 * 5]

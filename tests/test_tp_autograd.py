"""The autograd collectives of fastpar.comm at tp = 1, 2, 4: forward and backward against the math
written out with plain tensors. One launch per world size runs every check."""

import pytest

from tests.multirank import run_ranks

TOL = {"float32": 1e-6, "bfloat16": 1e-2}


def body_autograd(tp, seed):
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=tp, timeout=60)
    g, n, r = topo.tp_group, topo.tp_size, topo.tp_rank
    checked = []

    def close(name, got, want, dtype):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
        assert err <= TOL[dtype], \
            f"{name} ({dtype}, tp={n}): relative error {err:.3g} > {TOL[dtype]}"
        checked.append(name)

    for dtype_name in TOL:
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(seed)
        # Every rank draws every rank's tensors, so expected values are computed locally.
        xs = [torch.randn(2, 8, 12, generator=gen).to(dtype) for _ in range(n)]
        dys = [torch.randn(2, 8, 12, generator=gen).to(dtype) for _ in range(n)]
        total_dy = sum(d.float() for d in dys).to(dtype)
        total_x = sum(x.float() for x in xs).to(dtype)

        def run(fn, x, dy):
            x = x.clone().requires_grad_(True)
            y = fn(x)
            y.backward(dy)
            return y, x.grad

        def shard(t, dim):
            return t.chunk(n, dim)[r]

        # copy_to_tp: y = x, dx = sum of every rank's dy
        y, dx = run(lambda x: comm.copy_to_tp(x, g), xs[0], dys[r])
        close("copy_to_tp.fwd", y, xs[0], dtype_name)
        close("copy_to_tp.bwd", dx, total_dy, dtype_name)
        # reduce_from_tp: y = sum of x, dx = dy; the input is not modified
        x_in = xs[r].clone()
        y, dx = run(lambda x: comm.reduce_from_tp(x, g), x_in, dys[0])
        close("reduce_from_tp.fwd", y, total_x, dtype_name)
        close("reduce_from_tp.bwd", dx, dys[0], dtype_name)
        assert torch.equal(x_in, xs[r]), "reduce_from_tp changed its input"
        # scatter_to_tp / gather_from_tp along the last dim
        y, dx = run(lambda x: comm.scatter_to_tp(x, g), xs[0], shard(dys[0], -1))
        close("scatter_to_tp.fwd", y, shard(xs[0], -1), dtype_name)
        close("scatter_to_tp.bwd", dx, dys[0], dtype_name)
        y, dx = run(lambda x: comm.gather_from_tp(x, g), shard(xs[0], -1), dys[0])
        close("gather_from_tp.fwd", y, xs[0], dtype_name)
        close("gather_from_tp.bwd", dx, shard(dys[0], -1), dtype_name)
        # sequence parallelism along dim 1
        y, dx = run(lambda x: comm.all_gather_sequence(x, g, 1), shard(xs[0], 1), dys[r])
        close("all_gather_sequence.fwd", y, xs[0], dtype_name)
        close("all_gather_sequence.bwd", dx, shard(total_dy, 1), dtype_name)
        y, dx = run(lambda x: comm.reduce_scatter_sequence(x, g, 1), xs[r], shard(dys[0], 1))
        close("reduce_scatter_sequence.fwd", y, shard(total_x, 1), dtype_name)
        close("reduce_scatter_sequence.bwd", dx, dys[0], dtype_name)
        y, dx = run(lambda x: comm.scatter_sequence(x, g, 1), xs[0], shard(dys[0], 1))
        close("scatter_sequence.fwd", y, shard(xs[0], 1), dtype_name)
        close("scatter_sequence.bwd", dx, dys[0], dtype_name)
        y, dx = run(lambda x: comm.gather_sequence(x, g, 1), shard(xs[0], 1), dys[0])
        close("gather_sequence.fwd", y, xs[0], dtype_name)
        close("gather_sequence.bwd", dx, shard(dys[0], 1), dtype_name)
        # A gradient shared by two branches (a residual) is not reduced in place.
        y, dx = run(lambda x: x + comm.copy_to_tp(x, g), xs[0], dys[0])
        close("copy_to_tp.residual", dx, (dys[0].float() * (1 + n)).to(dtype), dtype_name)

    # The split paths return fresh tensors, not views of their input: an in-place op after them
    # works (a chunk along dim 0, or along the last dim of a 1-D tensor, is already contiguous).
    splits = (("scatter_sequence.dim0", lambda t: comm.scatter_sequence(t, g, 0), (4 * n, 3), 0),
              ("scatter_to_tp.1d", lambda t: comm.scatter_to_tp(t, g), (4 * n,), -1))
    for name, fn, shape, dim in splits:
        x = torch.randn(*shape, requires_grad=True)
        y = fn(x * 1)
        y.mul_(2)
        y.sum().backward()
        close(f"{name}.inplace.fwd", y, 2 * shard(x.detach(), dim), "float32")
        close(f"{name}.inplace.bwd", x.grad, torch.full_like(x, 2.0), "float32")

    if n == 1:  # group of one: the very same tensor, no copy, no graph node
        x = torch.randn(3, requires_grad=True)
        for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp):
            assert fn(x, g) is x, fn.__name__
        for fn in (comm.all_gather_sequence, comm.reduce_scatter_sequence,
                   comm.scatter_sequence, comm.gather_sequence):
            assert fn(x, g, 0) is x, fn.__name__
        checked.append("identity_at_1")
    return checked


@pytest.mark.parametrize("world", [1, 2, 4])
def test_autograd_collectives(world):
    launch = run_ranks(world, body_autograd, tp=world, seed=1000 + world)
    assert all(len(v) == len(launch.values()[0]) >= 30 for v in launch.values())

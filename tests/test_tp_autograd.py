"""The autograd collectives of fastpar.comm: forward and backward against the math written out with
plain tensors, float32 and bfloat16, and the refusal of ``group=None``. One launch per layout runs
every check.

Every rank draws every tp rank's tensors, so the expected values are computed locally. A sum is
checked with ``fastpar.testing.assert_close``: the serial result is the plain-tensor sum of the
ranks' tensors in the working dtype, in rank order; the reference is the same sum in float64; the
collective's error is bounded by a multiple of the serial one's. A pure move (copy, chunk,
concatenation) does not round, so it is compared exactly. Layouts: tp = world (1, 2, 4) and tp 2
on 4 ranks (dp 2), where each dp replica draws its own tensors: a collective over the world
instead of the tp group mixes the replicas' data and fails.
"""

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.quick  # every test here: the quick tier

DTYPES = ("float32", "bfloat16")
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]  # (world, tp)
WRAPPERS = ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
            "all_gather_sequence", "reduce_scatter_sequence", "scatter_sequence", "gather_sequence")


def body_autograd(tp, seed):
    import torch

    import fastpar
    from fastpar import comm
    from fastpar.testing import assert_close

    topo = fastpar.init(tp=tp, timeout=60)
    g, n, r = topo.tp_group, topo.tp_size, topo.tp_rank
    where = f"tp={n}, tp rank {r}, dp rank {topo.dp_rank}"
    checked, worst = [], [0.0, ""]

    def exact(name, got, want):
        assert got.dtype == want.dtype and torch.equal(got, want), \
            f"{name} ({where}): a move changed values (or dtype {got.dtype} != {want.dtype})"
        checked.append(name)

    def rank_sum(parts):
        """``(serial, reference)``: the sum of ``parts`` in their dtype in rank order, and in
        float64."""
        serial = parts[0]
        for p in parts[1:]:
            serial = serial + p
        return serial, sum(p.double() for p in parts)

    def summed(name, got, serial, ref):
        assert got.dtype == serial.dtype, (name, got.dtype, serial.dtype)
        ratio = assert_close(f"{name} ({where})", got, ref, serial)
        worst[:] = max(worst, [ratio, name])
        checked.append(name)

    def run(fn, x, dy):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(dy)
        return y, x.grad

    def shard(t, dim):
        return t.chunk(n, dim)[r]

    # Same draws on the ranks of one tp group, different draws on each dp replica.
    gen = torch.Generator().manual_seed(seed + 7919 * topo.dp_rank)
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        xs = [torch.randn(2, 8, 12, generator=gen).to(dtype) for _ in range(n)]
        dys = [torch.randn(2, 8, 12, generator=gen).to(dtype) for _ in range(n)]
        tag = dtype_name

        # copy_to_tp: y = x, dx = sum of every rank's dy
        y, dx = run(lambda x: comm.copy_to_tp(x, g), xs[0], dys[r])
        exact(f"{tag}.copy_to_tp.fwd", y, xs[0])
        summed(f"{tag}.copy_to_tp.bwd", dx, *rank_sum(dys))
        # reduce_from_tp: y = sum of x, dx = dy; the input is not modified
        x_in = xs[r].clone()
        y, dx = run(lambda x: comm.reduce_from_tp(x, g), x_in, dys[0])
        summed(f"{tag}.reduce_from_tp.fwd", y, *rank_sum(xs))
        exact(f"{tag}.reduce_from_tp.bwd", dx, dys[0])
        assert torch.equal(x_in, xs[r]), "reduce_from_tp changed its input"
        # scatter_to_tp / gather_from_tp along the last dim
        y, dx = run(lambda x: comm.scatter_to_tp(x, g), xs[0], shard(dys[0], -1))
        exact(f"{tag}.scatter_to_tp.fwd", y, shard(xs[0], -1))
        exact(f"{tag}.scatter_to_tp.bwd", dx, dys[0])
        y, dx = run(lambda x: comm.gather_from_tp(x, g), shard(xs[0], -1), dys[0])
        exact(f"{tag}.gather_from_tp.fwd", y, xs[0])
        exact(f"{tag}.gather_from_tp.bwd", dx, shard(dys[0], -1))
        # sequence parallelism along dim 1
        y, dx = run(lambda x: comm.all_gather_sequence(x, g, 1), shard(xs[0], 1), dys[r])
        exact(f"{tag}.all_gather_sequence.fwd", y, xs[0])
        summed(f"{tag}.all_gather_sequence.bwd", dx, *rank_sum([shard(d, 1) for d in dys]))
        y, dx = run(lambda x: comm.reduce_scatter_sequence(x, g, 1), xs[r], shard(dys[0], 1))
        summed(f"{tag}.reduce_scatter_sequence.fwd", y, *rank_sum([shard(x, 1) for x in xs]))
        exact(f"{tag}.reduce_scatter_sequence.bwd", dx, dys[0])
        y, dx = run(lambda x: comm.scatter_sequence(x, g, 1), xs[0], shard(dys[0], 1))
        exact(f"{tag}.scatter_sequence.fwd", y, shard(xs[0], 1))
        exact(f"{tag}.scatter_sequence.bwd", dx, dys[0])
        y, dx = run(lambda x: comm.gather_sequence(x, g, 1), shard(xs[0], 1), dys[0])
        exact(f"{tag}.gather_sequence.fwd", y, xs[0])
        exact(f"{tag}.gather_sequence.bwd", dx, shard(dys[0], 1))
        # A gradient shared by two branches (a residual) is not reduced in place:
        # dx = dy + (sum of every rank's dy), every rank feeding the same dy.
        y, dx = run(lambda x: x + comm.copy_to_tp(x, g), xs[0], dys[0])
        serial, ref = rank_sum([dys[0]] * n)
        summed(f"{tag}.copy_to_tp.residual", dx, dys[0] + serial, dys[0].double() + ref)

    # The split paths return fresh tensors, not views of their input: an in-place op after them
    # works (a chunk along dim 0, or along the last dim of a 1-D tensor, is already contiguous).
    splits = (("scatter_sequence.dim0", lambda t: comm.scatter_sequence(t, g, 0), (4 * n, 3), 0),
              ("scatter_to_tp.1d", lambda t: comm.scatter_to_tp(t, g), (4 * n,), -1))
    for name, fn, shape, dim in splits:
        x = torch.randn(*shape, generator=gen).requires_grad_(True)
        y = fn(x * 1)
        y.mul_(2)
        y.sum().backward()
        exact(f"{name}.inplace.fwd", y.detach(), 2 * shard(x.detach(), dim))
        exact(f"{name}.inplace.bwd", x.grad, torch.full_like(x, 2.0))

    # group=None is refused by every wrapper, whatever the group size would have been.
    x = torch.randn(4 * n, 2 * n, requires_grad=True)
    for name in WRAPPERS:
        try:
            getattr(comm, name)(x, None)
        except ValueError as exc:
            assert "group is None" in str(exc) and name in str(exc), f"{name}: {exc}"
            checked.append(f"{name}.group_none")
        else:
            raise AssertionError(f"{name}(x, None) did not raise ({where})")

    if n == 1:  # group of one: the very same tensor, no copy, no graph node
        x = torch.randn(3, requires_grad=True)
        for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp):
            assert fn(x, g) is x, fn.__name__
        for fn in (comm.all_gather_sequence, comm.reduce_scatter_sequence,
                   comm.scatter_sequence, comm.gather_sequence):
            assert fn(x, g, 0) is x, fn.__name__
        checked.append("identity_at_1")
    return {"checked": checked, "worst": worst}


@pytest.mark.parametrize("world, tp", LAYOUTS)
def test_autograd_collectives(world, tp):
    names = [v["checked"] for v in run_ranks(world, body_autograd, tp=tp,
                                                  seed=1000 + 10 * world + tp).values()]
    assert all(c == names[0] for c in names) and len(names[0]) >= 40, names

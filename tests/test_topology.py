"""Topology: the grid formulas, then real groups under mpirun and torchrun."""

import itertools

import pytest

from fastpar.grid import Grid
from tests.multirank import run_ranks

LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4), (1, 1)]}


def expected_coords(rank, tp, pp, world):
    dp = world // (tp * pp)
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


@pytest.mark.parametrize("world, tp, pp", [(w, t, p) for w, ls in LAYOUTS.items() for t, p in ls]
                         + [(8, 2, 2), (12, 2, 3), (16, 4, 2)])
def test_grid_formulas(world, tp, pp):
    grid = Grid(world, tp, pp)
    assert grid.dp * tp * pp == world
    for rank in range(world):
        t, d, p = expected_coords(rank, tp, pp, world)
        assert grid.coords(rank) == (t, d, p)
        assert grid.rank_of(t, d, p) == rank
    for axis, key in (("tp", lambda r: (r[1], r[2])), ("dp", lambda r: (r[0], r[2])),
                      ("pp", lambda r: (r[0], r[1])), ("mp", lambda r: r[1])):
        groups = grid.groups(axis)
        # The groups partition the world, and members share every other coordinate.
        assert sorted(itertools.chain(*groups)) == list(range(world))
        for g in groups:
            assert len({key(expected_coords(r, tp, pp, world)) for r in g}) == 1
    assert all(len(g) == tp for g in grid.groups("tp"))
    assert all(len(g) == pp for g in grid.groups("pp"))
    assert all(len(g) == tp * pp for g in grid.groups("mp"))
    for g in grid.groups("embedding"):
        stages = [expected_coords(r, tp, pp, world)[2] for r in g]
        assert stages == sorted({0, pp - 1})


@pytest.mark.parametrize("world, tp, pp", [(3, 2, 1), (4, 3, 1), (6, 4, 1), (8, 1, 3)])
def test_grid_rejects_indivisible(world, tp, pp):
    with pytest.raises(ValueError, match=f"world_size {world} is not divisible by tp {tp} x pp {pp}"):
        Grid(world, tp, pp)


@pytest.mark.parametrize("tp, pp", [(0, 1), (1, 0), (-2, 1), (1.5, 1), (True, 1)])
def test_grid_rejects_bad_degrees(tp, pp):
    with pytest.raises(ValueError, match="must be a positive integer"):
        Grid(4, tp, pp)


def body_check_layouts(layouts):
    """On every rank: each layout's coordinates, group members, groups that really communicate."""
    import torch
    import torch.distributed as dist

    import fastpar

    checked = []
    for tp, pp in layouts:
        topo = fastpar.init(tp=tp, pp=pp, timeout=60)
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = Grid(world, tp, pp)
        t, d, p = expected_coords(rank, tp, pp, world)
        assert (topo.rank, topo.world_size) == (rank, world)
        assert (topo.tp_rank, topo.dp_rank, topo.pp_rank) == (t, d, p), topo
        assert (topo.tp_size, topo.pp_size, topo.dp_size) == (tp, pp, world // (tp * pp))
        assert topo.is_first_stage == (p == 0) and topo.is_last_stage == (p == pp - 1)
        assert topo.pp_prev_rank == (None if p == 0 else grid.rank_of(t, d, p - 1))
        assert topo.pp_next_rank == (None if p == pp - 1 else grid.rank_of(t, d, p + 1))
        for axis in ("tp", "pp", "dp", "mp", "embedding"):
            group = getattr(topo, f"{axis}_group")
            members = grid.group_of(axis, rank)
            if members is None:
                assert group is None, axis
                continue
            assert dist.get_process_group_ranks(group) == members, axis
            # Each group is a working communicator: the sum of its members' ranks.
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=group)
            assert x.item() == sum(members), (axis, x.item(), members)
        assert fastpar.init(tp=tp, pp=pp, timeout=60) is topo  # idempotent
        other = (tp, pp + 1)
        try:
            fastpar.init(tp=other[0], pp=other[1], timeout=60)
            raise AssertionError("init with different arguments did not raise")
        except RuntimeError as exc:
            assert "already called" in str(exc) and "shutdown" in str(exc)
        assert fastpar.topology() is topo
        fastpar.shutdown()
        assert not dist.is_initialized()
        checked.append([tp, pp])
    return {"checked": checked, "launcher": topo.launcher, "local": [topo.local_rank,
                                                                     topo.local_world_size]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_under_mpirun(world):
    launch = run_ranks(world, body_check_layouts, layouts=LAYOUTS[world])
    for r, value in enumerate(launch.values()):
        assert value["checked"] == [list(x) for x in LAYOUTS[world]]
        assert value["launcher"] == "pmi"
        assert value["local"] == [r, world]  # from MPI_Comm_split_type(COMM_TYPE_SHARED)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_under_torchrun(world):
    launch = run_ranks(world, body_check_layouts, launcher="torchrun", layouts=LAYOUTS[world])
    for r, value in enumerate(launch.values()):
        assert value["launcher"] == "torchrun"
        assert value["local"] == [r, world]


def test_single_process_without_launcher():
    """A plain `python script.py`: no MPI, no torchrun, still a working 1-rank topology."""
    launch = run_ranks(1, body_check_layouts, launcher="plain", layouts=[[1, 1]])
    assert launch.values()[0]["launcher"] == "single"

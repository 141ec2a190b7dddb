"""Topology: the grid formulas, then real groups under mpirun and torchrun."""

import itertools

import pytest

from fastpar.grid import Grid
from tests.multirank import run_ranks

LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4), (1, 1)]}
# (tp, pp, ep) and (tp, pp, ep, cp), run inside the torchrun launch of the same world only: the
# suite is at its limit. cp: tp 1 x cp 2 x dp 2, and tp 2 x cp 2 (dp 1).
EP_LAYOUTS = {4: [(1, 1, 2), (2, 1, 2), (1, 1, 1, 2), (2, 1, 1, 2)]}


def expected_coords(rank, tp, pp, world, cp=1):
    """``(tp_rank, dp_rank, pp_rank)`` by Megatron's order (tp fastest, then cp, dp, pp)."""
    dp = world // (tp * cp * pp)
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def expected_cp_rank(rank, tp, cp):
    return (rank // tp) % cp


def expected_expert_groups(rank, tp, pp, ep, world, cp=1):
    """``(ep members, edp members)`` of ``rank``, written from the coordinates alone (not from
    Grid): ep = same tp, cp, pp and dp block of ep consecutive dp ranks; edp = same tp, cp, pp
    and position in that block."""
    def at(r):
        return (*expected_coords(r, tp, pp, world, cp), expected_cp_rank(r, tp, cp))

    t, d, p, c = at(rank)
    same = [r for r in range(world) if (at(r)[0], at(r)[2], at(r)[3]) == (t, p, c)]
    ep_members = [r for r in same if at(r)[1] // ep == d // ep]
    edp_members = [r for r in same if at(r)[1] % ep == d % ep]
    return ep_members, edp_members


def expected_context_groups(rank, tp, pp, cp, world):
    """``(cp members, dpcp members)`` of ``rank`` from the coordinates alone (not from Grid):
    cp = same tp, dp and pp coordinates; dpcp = same tp and pp coordinates."""
    t, d, p = expected_coords(rank, tp, pp, world, cp)
    cp_members = [r for r in range(world)
                  if expected_coords(r, tp, pp, world, cp) == (t, d, p)]
    dpcp_members = [r for r in range(world)
                    if expected_coords(r, tp, pp, world, cp)[::2] == (t, p)]
    return cp_members, dpcp_members


@pytest.mark.quick
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


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp, ep", [(1, 1, 1, 1), (4, 1, 1, 2), (4, 1, 1, 4),
                                               (4, 2, 1, 2), (4, 1, 2, 2), (8, 1, 2, 2),
                                               (8, 2, 1, 4), (16, 2, 2, 2), (12, 1, 2, 3),
                                               (24, 2, 2, 3), (8, 2, 2, 1)])
def test_grid_expert_axes(world, tp, pp, ep):
    grid = Grid(world, tp, pp, ep)
    dp = world // (tp * pp)
    assert (grid.dp, grid.ep, grid.edp) == (dp, ep, dp // ep) and grid.ep * grid.edp == dp
    for axis, size in (("ep", ep), ("edp", dp // ep)):
        groups = grid.groups(axis)
        # every rank in exactly one group, each group sorted and of the axis' size
        assert sorted(itertools.chain(*groups)) == list(range(world)), axis
        assert all(g == sorted(g) and len(g) == size for g in groups), (axis, groups)
    for rank in range(world):
        t, d, p = expected_coords(rank, tp, pp, world)
        assert grid.coords(rank) == (t, d, p)  # ep leaves the (tp, dp, pp) coordinates alone
        assert (grid.ep_rank(rank), grid.edp_rank(rank)) == (d % ep, d // ep)
        assert d == grid.edp_rank(rank) * ep + grid.ep_rank(rank)
        ep_members, edp_members = grid.group_of("ep", rank), grid.group_of("edp", rank)
        assert (ep_members, edp_members) == expected_expert_groups(rank, tp, pp, ep, world)
        # both cut this rank's dp group, meet only in this rank, and a rank's index in each is
        # its ep / edp rank (torch orders a group's ranks sorted, as these lists are)
        dp_members = grid.group_of("dp", rank)
        assert set(ep_members) <= set(dp_members) and set(edp_members) <= set(dp_members)
        assert set(ep_members) & set(edp_members) == {rank}
        assert len(ep_members) * len(edp_members) == len(dp_members)
        assert ep_members.index(rank) == grid.ep_rank(rank)
        assert edp_members.index(rank) == grid.edp_rank(rank)
    if ep == 1:  # no expert parallelism: ep groups of one rank, edp is dp (same groups, order)
        assert all(len(g) == 1 for g in grid.groups("ep"))
        assert grid.groups("edp") == grid.groups("dp")
    if ep == dp:  # every dp group is one ep group
        assert sorted(grid.groups("ep")) == sorted(grid.groups("dp"))
        assert all(len(g) == 1 for g in grid.groups("edp"))


@pytest.mark.quick
def test_grid_default_ep_is_one_and_older_axes_keep_their_order():
    assert Grid(8, 2, 2) == Grid(8, 2, 2, 1) and Grid(8, 2, 2).ep == 1
    assert Grid(8, 2, 2).coords(5) == (1, 0, 1)
    from fastpar.grid import AXES

    # init builds groups in this order, so each axis added last leaves the others' creation alone
    assert AXES[:5] == ("tp", "pp", "dp", "mp", "embedding")
    assert AXES[5:7] == ("ep", "edp") and AXES[7:] == ("cp", "dpcp")


# (world, tp, pp, ep, cp): cp 1, 2, 3, 4 with and without tp, pp and ep
CP_GRIDS = [(1, 1, 1, 1, 1), (2, 1, 1, 1, 2), (4, 1, 1, 1, 2), (4, 1, 1, 1, 4), (4, 2, 1, 1, 2),
            (4, 1, 2, 1, 2), (8, 2, 2, 1, 2), (8, 1, 1, 2, 2), (16, 2, 1, 2, 2), (16, 1, 2, 2, 2),
            (24, 2, 2, 2, 3), (16, 1, 1, 2, 4), (32, 2, 2, 2, 2), (12, 1, 3, 1, 2),
            (8, 2, 2, 2, 1), (12, 2, 3, 1, 1)]


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp, ep, cp", CP_GRIDS)
def test_grid_context_axis(world, tp, pp, ep, cp):
    grid = Grid(world, tp, pp, ep, cp)
    dp = world // (tp * cp * pp)
    assert (grid.cp, grid.dp, grid.edp) == (cp, dp, dp // ep) and tp * cp * dp * pp == world

    def coords4(r):  # (t, c, d, p), written from Megatron's formula, not from Grid
        t, d, p = expected_coords(r, tp, pp, world, cp)
        return t, expected_cp_rank(r, tp, cp), d, p

    # Each axis' groups from the coordinates alone: the ranks agreeing on the key (for
    # embedding, the first and last stage of each column).
    keys = {"tp": lambda t, c, d, p: (c, d, p), "cp": lambda t, c, d, p: (t, d, p),
            "dp": lambda t, c, d, p: (t, c, p), "dpcp": lambda t, c, d, p: (t, p),
            "pp": lambda t, c, d, p: (t, c, d), "mp": lambda t, c, d, p: (c, d),
            "embedding": lambda t, c, d, p: (t, c, d),
            "ep": lambda t, c, d, p: (t, c, p, d // ep),
            "edp": lambda t, c, d, p: (t, c, p, d % ep)}
    sizes = {"tp": tp, "cp": cp, "dp": dp, "dpcp": dp * cp, "pp": pp, "mp": tp * pp,
             "embedding": len({0, pp - 1}), "ep": ep, "edp": dp // ep}
    for axis, key in keys.items():
        expected = {}
        for r in range(world):
            if axis != "embedding" or coords4(r)[3] in (0, pp - 1):
                expected.setdefault(key(*coords4(r)), []).append(r)
        groups = grid.groups(axis)
        assert sorted(groups) == sorted(expected.values()), (axis, groups)
        assert all(g == sorted(g) and len(g) == sizes[axis] for g in groups), (axis, groups)
        if axis != "embedding":  # every rank in exactly one group
            assert sorted(itertools.chain(*groups)) == list(range(world)), axis
    for rank in range(world):
        t, c, d, p = coords4(rank)
        assert grid.coords(rank) == (t, d, p) and grid.cp_rank(rank) == c
        assert grid.rank_of(t, d, p, cp_rank=c) == rank == t + tp * (c + cp * (d + dp * p))
        assert (grid.ep_rank(rank), grid.edp_rank(rank)) == (d % ep, d // ep)
        cp_members, dpcp_members = grid.group_of("cp", rank), grid.group_of("dpcp", rank)
        assert (cp_members, dpcp_members) == expected_context_groups(rank, tp, pp, cp, world)
        # dpcp = dp x cp: the dp groups of this rank's cp group, which meet cp only here
        dp_members = grid.group_of("dp", rank)
        assert set(dpcp_members) == {x for m in cp_members for x in grid.group_of("dp", m)}
        assert set(cp_members) & set(dp_members) == {rank}
        # a rank's index in each group is its coordinate there (torch orders ranks sorted)
        assert cp_members.index(rank) == c and dp_members.index(rank) == d
        assert dpcp_members.index(rank) == d * cp + c
        assert grid.group_of("tp", rank).index(rank) == t
        assert grid.group_of("pp", rank).index(rank) == p
        # ep and edp stay inside this rank's dp group, at its cp coordinate
        ep_members, edp_members = grid.group_of("ep", rank), grid.group_of("edp", rank)
        assert (ep_members, edp_members) == expected_expert_groups(rank, tp, pp, ep, world, cp)
        assert set(ep_members) | set(edp_members) <= set(dp_members)
        assert {grid.cp_rank(m) for m in ep_members + edp_members} == {c}
    if cp == 1:  # no context parallelism: cp groups of one rank, dpcp is dp (same groups, order)
        assert grid.groups("cp") == [[r] for r in range(world)]
        assert grid.groups("dpcp") == grid.groups("dp")
        assert grid == Grid(world, tp, pp, ep)
    if dp == 1:  # every dpcp group is one cp group
        assert grid.groups("dpcp") == sorted(grid.groups("cp"))


@pytest.mark.quick
def test_grid_cp_one_keeps_every_older_group_and_its_order():
    """The groups of Grid(16, tp 2, pp 2, ep 2) as the grid made them before the cp axis, in
    their order (init creates them in it, collectively), pinned as literals."""
    before = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "mp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
        "embedding": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        "ep": [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]],
        "edp": [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]}
    for grid in (Grid(16, 2, 2, 2), Grid(16, 2, 2, 2, 1), Grid(16, 2, 2, ep=2, cp=1)):
        assert {axis: grid.groups(axis) for axis in before} == before
        assert [grid.coords(r) for r in range(16)] == [(r % 2, r // 2 % 4, r // 8)
                                                       for r in range(16)]
        assert grid.rank_of(1, 3, 1) == 15


@pytest.mark.quick
def test_grid_cp_orders_tp_then_cp_then_dp_then_pp():
    grid = Grid(16, 2, 2, cp=2)  # dp 2
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                 [14, 15]]
    assert grid.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                 [13, 15]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14],
                                 [11, 15]]
    assert grid.groups("dpcp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert grid.groups("pp") == [[r, r + 8] for r in range(8)]
    assert grid.groups("mp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    # rank 6: tp 0, cp 1, dp 1, pp 0
    assert (grid.coords(6), grid.cp_rank(6)) == ((0, 1, 0), 1)
    assert grid.rank_of(0, 1, 0, cp_rank=1) == 6 and grid.rank_of(0, 1, 0) == 4


@pytest.mark.quick
def test_topology_context_properties_and_repr():
    import torch

    from fastpar.grid import Topology

    grid = Grid(16, 2, 2, cp=2)  # dp 2
    topo = Topology(grid=grid, rank=6, local_rank=6, local_world_size=16,
                    device=torch.device("cpu"), backend="gloo", launcher="single")
    assert (topo.cp_size, topo.cp_rank, topo.dp_size, topo.dp_rank) == (2, 1, 2, 1)
    assert (topo.tp_rank, topo.pp_rank, topo.ep_rank, topo.edp_rank) == (0, 0, 0, 1)
    assert topo.ranks("cp") == [4, 6] and topo.ranks("dpcp") == [0, 2, 4, 6]
    assert topo.ranks("dp") == [2, 6] and topo.ranks("edp") == [2, 6]
    assert topo.pp_next_rank == 14 and topo.pp_prev_rank is None
    assert "tp=0/2, cp=1/2, pp=0/2, dp=1/2, ep=0/1" in repr(topo), repr(topo)
    assert (topo.cp_group, topo.dpcp_group) == (None, None)  # made by fastpar.init, not here
    assert Topology(grid=Grid(1, 1, 1), rank=0, local_rank=0, local_world_size=1,
                    device=torch.device("cpu"), backend="gloo", launcher="single").cp_size == 1


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp, cp, n", [(4, 1, 1, 3, 4), (8, 2, 1, 3, 4),
                                                  (4, 2, 2, 2, 1), (12, 1, 2, 4, 6),
                                                  (2, 1, 1, 4, 2)])
def test_grid_rejects_cp_not_dividing(world, tp, pp, cp, n):
    with pytest.raises(ValueError, match=rf"cp {cp} does not divide world_size {world} / \(tp "
                                         rf"{tp} x pp {pp}\) = {n}: the world is tp x cp x dp x "
                                         "pp"):
        Grid(world, tp, pp, cp=cp)


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp, ep, cp, dp", [(8, 1, 1, 8, 2, 4), (8, 1, 1, 3, 2, 4),
                                                       (16, 2, 2, 4, 2, 2)])
def test_grid_rejects_ep_not_dividing_dp_under_cp(world, tp, pp, ep, cp, dp):
    """ep cuts dp, which cp has cut out of world / (tp x pp): the message names cp too."""
    with pytest.raises(ValueError, match=rf"ep {ep} does not divide dp {dp} \(world_size {world} "
                                         rf"/ \(tp {tp} x cp {cp} x pp {pp}\)\)"):
        Grid(world, tp, pp, ep, cp)


@pytest.mark.quick
@pytest.mark.parametrize("cp", [0, -2, 1.5, True, "2"])
def test_grid_rejects_bad_cp(cp):
    with pytest.raises(ValueError, match=f"cp must be a positive integer, got {cp!r}"):
        Grid(4, 1, 1, cp=cp)


@pytest.mark.quick
def test_topology_expert_properties_and_repr():
    import torch

    from fastpar.grid import Topology

    grid = Grid(8, 2, 1, 2)  # dp 4 = ep 2 x edp 2
    topo = Topology(grid=grid, rank=5, local_rank=5, local_world_size=8,
                    device=torch.device("cpu"), backend="gloo", launcher="single")
    # rank 5: tp 1, dp 2 -> ep_rank 0, edp_rank 1
    assert (topo.ep_size, topo.edp_size, topo.ep_rank, topo.edp_rank) == (2, 2, 0, 1)
    assert topo.ranks("ep") == [5, 7] and topo.ranks("edp") == [1, 5]
    assert "ep=0/2, edp=1/2" in repr(topo), repr(topo)
    assert (topo.ep_group, topo.edp_group) == (None, None)  # made by fastpar.init, not here


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp, ep, dp", [(4, 1, 1, 3, 4), (8, 2, 1, 3, 4),
                                                   (4, 2, 1, 4, 2), (12, 1, 2, 4, 6)])
def test_grid_rejects_ep_not_dividing_dp(world, tp, pp, ep, dp):
    with pytest.raises(ValueError, match=rf"ep {ep} does not divide dp {dp} \(world_size {world} "
                                         rf"/ \(tp {tp} x pp {pp}\)\)"):
        Grid(world, tp, pp, ep)


@pytest.mark.quick
@pytest.mark.parametrize("ep", [0, -2, 1.5, True, "2"])
def test_grid_rejects_bad_ep(ep):
    with pytest.raises(ValueError, match=f"ep must be a positive integer, got {ep!r}"):
        Grid(4, 1, 1, ep)


@pytest.mark.quick
@pytest.mark.parametrize("world, tp, pp", [(3, 2, 1), (4, 3, 1), (6, 4, 1), (8, 1, 3)])
def test_grid_rejects_indivisible(world, tp, pp):
    with pytest.raises(ValueError, match=f"world_size {world} is not divisible by tp {tp} x pp {pp}"):
        Grid(world, tp, pp)


@pytest.mark.quick
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
    for tp, pp, *rest in layouts:  # (tp, pp), (tp, pp, ep) or (tp, pp, ep, cp)
        ep, cp = (*rest, 1, 1)[:2]
        topo = fastpar.init(tp=tp, pp=pp, ep=ep, cp=cp, timeout=60)
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = Grid(world, tp, pp, cp=cp)
        t, d, p = expected_coords(rank, tp, pp, world, cp)
        assert (topo.rank, topo.world_size) == (rank, world)
        assert (topo.tp_rank, topo.dp_rank, topo.pp_rank) == (t, d, p), topo
        assert (topo.tp_size, topo.pp_size, topo.dp_size) == (tp, pp, world // (tp * cp * pp))
        assert (topo.ep_size, topo.ep_rank, topo.edp_rank) == (ep, d % ep, d // ep), topo
        c = expected_cp_rank(rank, tp, cp)
        assert (topo.cp_size, topo.cp_rank) == (cp, c), topo
        # The expert and context groups against members written from the coordinates (not from
        # Grid), each summing 2 ** rank: the sum names the exact set of ranks, so no wrong group
        # passes.
        for name, members in zip(("ep", "edp", "cp", "dpcp"),
                                 expected_expert_groups(rank, tp, pp, ep, world, cp)
                                 + expected_context_groups(rank, tp, pp, cp, world)):
            group = getattr(topo, f"{name}_group")
            assert dist.get_process_group_ranks(group) == members, (name, members)
            x = torch.tensor([2.0 ** rank], dtype=torch.float64)
            dist.all_reduce(x, group=group)
            assert x.item() == sum(2.0 ** r for r in members), (name, x.item(), members)
        assert topo.is_first_stage == (p == 0) and topo.is_last_stage == (p == pp - 1)
        assert topo.pp_prev_rank == (None if p == 0 else grid.rank_of(t, d, p - 1, cp_rank=c))
        assert topo.pp_next_rank == (None if p == pp - 1 else grid.rank_of(t, d, p + 1,
                                                                            cp_rank=c))
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
        assert fastpar.init(tp=tp, pp=pp, ep=ep, cp=cp, timeout=60) is topo  # idempotent
        for other in ({"tp": tp, "pp": pp + 1, "ep": ep, "cp": cp},
                      {"tp": tp, "pp": pp, "ep": ep + 1, "cp": cp},
                      {"tp": tp, "pp": pp, "ep": ep, "cp": cp + 1}):
            try:
                fastpar.init(**other, timeout=60)
                raise AssertionError(f"init with {other} did not raise")
            except RuntimeError as exc:
                assert "already called" in str(exc) and "shutdown" in str(exc)
                assert f"'ep': {ep}, 'cp': {cp}," in str(exc), str(exc)
                assert f"'ep': {other['ep']}, 'cp': {other['cp']}," in str(exc), str(exc)
        assert fastpar.topology() is topo
        fastpar.shutdown()
        assert not dist.is_initialized()
        if ep > 1:  # a bad ep fails on every rank before the rendezvous, naming the numbers
            try:
                fastpar.init(tp=tp, pp=pp, ep=ep + 1, timeout=60)
                raise AssertionError(f"init with ep {ep + 1} did not raise")
            except ValueError as exc:
                assert f"ep {ep + 1} does not divide dp {world // (tp * pp)} (world_size " \
                       f"{world} / (tp {tp} x pp {pp}))" in str(exc), str(exc)
            assert not dist.is_initialized() and not fastpar.is_initialized()
        if cp > 1:  # likewise a cp that does not divide world / (tp x pp)
            try:
                fastpar.init(tp=tp, pp=pp, cp=cp + 1, timeout=60)
                raise AssertionError(f"init with cp {cp + 1} did not raise")
            except ValueError as exc:
                assert f"cp {cp + 1} does not divide world_size {world} / (tp {tp} x pp {pp}) " \
                       f"= {world // (tp * pp)}:" in str(exc), str(exc)
            assert not dist.is_initialized() and not fastpar.is_initialized()
        checked.append([tp, pp, *rest])
    return {"checked": checked, "launcher": topo.launcher, "local": [topo.local_rank,
                                                                     topo.local_world_size]}


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_under_mpirun(world):
    launch = run_ranks(world, body_check_layouts, layouts=LAYOUTS[world])
    for r, value in enumerate(launch.values()):
        assert value["checked"] == [list(x) for x in LAYOUTS[world]]
        assert value["launcher"] == "pmi"
        assert value["local"] == [r, world]  # from MPI_Comm_split_type(COMM_TYPE_SHARED)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layouts_under_torchrun(world):
    layouts = LAYOUTS[world] + EP_LAYOUTS.get(world, [])
    launch = run_ranks(world, body_check_layouts, launcher="torchrun", layouts=layouts)
    for r, value in enumerate(launch.values()):
        assert value["checked"] == [list(x) for x in layouts]
        assert value["launcher"] == "torchrun"
        assert value["local"] == [r, world]


def test_single_process_without_launcher():
    """A plain `python script.py`: no MPI, no torchrun, still a working 1-rank topology."""
    launch = run_ranks(1, body_check_layouts, launcher="plain", layouts=[[1, 1]])
    assert launch.values()[0]["launcher"] == "single"

"""The base under stress and failure: every wait bounded by init's timeout, clear errors, nothing
left behind."""

import pytest

from tests.multirank import run_ranks


def body_group_timeout(engine, init_timeout):
    """Rank 0 all-reduces on the dp group while rank 1 sleeps past the timeout."""
    import time

    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=init_timeout)
    comm.use_backend(engine)
    if topo.rank == 1:
        time.sleep(3 * init_timeout)
        return "slept"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), group=topo.dp_group)
    except RuntimeError as exc:
        return [time.monotonic() - start, str(exc)]
    raise AssertionError("all_reduce with a sleeping peer returned")


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_init_timeout_bounds_collectives_on_every_group(engine):
    """init(timeout=) bounds the grid's own groups too (torch's default is 30 minutes)."""
    timeout = 3.0
    (elapsed, message), slept = run_ranks(2, body_group_timeout, engine=engine,
                                          init_timeout=timeout, timeout=60).values()
    assert slept == "slept"
    assert timeout * 0.9 <= elapsed <= timeout + 6, (elapsed, message)


def body_threads(calls):
    """One thread per group, every engine: groups with the same members (tp and a twin of it)
    and with different ones (world, dp) run at once and every result is right."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=2, timeout=60)
    twins = [dist.new_group(ranks) for ranks in topo.grid.groups("tp")]  # collective, in order
    twin = twins[topo.dp_rank]
    groups = {"world": (None, list(range(topo.world_size))), "tp": (topo.tp_group,
              topo.ranks("tp")), "tp_twin": (twin, topo.ranks("tp")),
              "dp": (topo.dp_group, topo.ranks("dp"))}
    report = {}
    for engine in ("shm", "gloo", "mpi"):
        comm.use_backend(engine)
        errors = []

        def drive(name, group, members, salt):
            try:
                for i in range(calls):
                    x = torch.full((257,), float(topo.rank * salt + i))
                    comm.all_reduce(x, group=group)
                    want = float(sum(r * salt + i for r in members))
                    assert torch.all(x == want), (engine, name, i, x[0].item(), want)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=drive, args=(name, g, members, salt))
                   for salt, (name, (g, members)) in enumerate(groups.items(), start=1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        report[engine] = len(threads) * calls

    # Two threads of one rank on one shm group: the second is refused at once, clearly.
    comm.use_backend("shm")
    x = torch.ones(4)
    if topo.tp_rank == 0:
        inside = threading.Thread(target=comm.all_reduce, args=(x, topo.tp_group))
        inside.start()
        time.sleep(0.5)  # the peer joins only after 1.5 s: the thread waits in the kernel
        try:
            comm.all_reduce(torch.ones(4), group=topo.tp_group)
            raise AssertionError("a concurrent call on the same group was not refused")
        except RuntimeError as exc:
            report["refused"] = str(exc)
        inside.join()
    else:
        time.sleep(1.5)
        comm.all_reduce(x, group=topo.tp_group)
    assert x.tolist() == [2.0] * 4
    return report


def test_threads_drive_different_groups_at_once():
    values = run_ranks(4, body_threads, calls=150, timeout=180).values()
    for rank, value in enumerate(values):
        assert value["shm"] == value["gloo"] == value["mpi"] == 4 * 150
        if rank % 2 == 0:
            assert "while another thread of this rank is inside a collective on the same group" \
                in value["refused"], value


def body_bad_arguments():
    """Wrong arguments are errors naming the argument and what was expected."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=30)
    only_rank0 = dist.new_group([0])  # collective; NON_GROUP_MEMBER on rank 1
    messages = []
    calls = [lambda: comm.all_reduce([1.0, 2.0]),
             lambda: comm.all_gather(np.ones(3)),
             lambda: comm.broadcast(torch.ones(3).to_sparse()),
             lambda: comm.all_reduce(torch.ones(2), group="tp")]
    if topo.rank == 1:
        calls.append(lambda: comm.all_reduce(torch.ones(2), group=only_rank0))
    for call in calls:
        try:
            call()
            messages.append(None)
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def test_bad_arguments_are_named():
    m0, m1 = run_ranks(2, body_bad_arguments, timeout=60).values()
    assert m0[:3] == m1[:3]
    assert m0[0] == "TypeError: all_reduce: expected a torch.Tensor, got list"
    assert m0[1] == "TypeError: all_gather: expected a torch.Tensor, got ndarray"
    assert m0[2].startswith("TypeError: broadcast: expected a dense (strided) tensor, got layout "
                            "torch.sparse_coo")
    assert m0[3].startswith("ValueError: group 'tp' is not a process group of this job"), m0[3]
    assert m1[4].startswith("ValueError: global rank 1 is not a member of this group"), m1[4]


def test_uncaught_exception_on_one_rank_ends_the_mpi_job_at_once():
    """Rank 1 raises between two all-reduces; rank 0 would wait in the second one until the
    timeout (300 s). The job ends within seconds, with rank 1's traceback."""
    import os
    import subprocess
    import sys
    import time

    from tests.multirank import BIN, ROOT, mpich_segments_removed

    code = ("import torch, fastpar\n"
            "from fastpar import comm\n"
            "topo = fastpar.init(timeout=300)\n"
            "comm.all_reduce(torch.ones(2))\n"
            "if topo.rank == 1:\n"
            "    raise ValueError('boom on rank 1')\n"
            "comm.all_reduce(torch.ones(2))\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    with mpich_segments_removed():
        proc = subprocess.run([os.path.join(BIN, "mpirun"), "-np", "2", sys.executable, "-c",
                               code], env=env, capture_output=True, text=True, timeout=120,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "fastpar: uncaught exception on rank 1; aborting the MPI job" in proc.stderr, \
        proc.stderr
    assert "ValueError: boom on rank 1" in proc.stderr
    assert elapsed < 30, elapsed

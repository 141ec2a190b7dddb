"""The base under stress and failure: every wait bounded by init's timeout, clear errors, nothing
left behind."""

import uuid

import pytest

from tests.multirank import run_ranks


def body_group_timeout(engine, init_timeout, gave_up):
    """Rank 0 all-reduces on the dp group while rank 1 sleeps past the timeout."""
    import time

    import torch

    import fastpar
    from fastpar import comm

    from tests.multirank import late_until

    topo = fastpar.init(timeout=init_timeout)
    comm.use_backend(engine)
    comm.all_reduce(torch.ones(2), group=topo.dp_group)  # set-up done: the wait is the engine's
    if topo.rank == 1:
        late_until(topo.store, gave_up, 5 * init_timeout)
        return "slept"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), group=topo.dp_group)
    except RuntimeError as exc:
        return [time.monotonic() - start, str(exc)]
    finally:
        topo.store.set(gave_up, "1")
    raise AssertionError("all_reduce with a sleeping peer returned")


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_init_timeout_bounds_collectives_on_every_group(engine):
    """init(timeout=) bounds the grid's own groups too (torch's default is 30 minutes)."""
    timeout = 3.0
    (elapsed, message), slept = run_ranks(2, body_group_timeout, engine=engine,
                                          init_timeout=timeout, gave_up=uuid.uuid4().hex,
                                          timeout=60).values()
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

    # Two threads of one rank on one shm group: the second is refused at once, clearly. The
    # peer joins the first call only after the refusal (a store key), so the first thread is
    # surely inside the kernel when the second call comes.
    from fastpar.comm.engines.shm import Shm
    from fastpar.comm.state import current

    comm.use_backend("shm")
    x = torch.ones(4)
    comm.all_reduce(x, group=topo.tp_group)
    x.fill_(1.0)
    key = f"refused/{topo.dp_rank}"
    if topo.tp_rank == 0:
        inside = threading.Thread(target=comm.all_reduce, args=(x, topo.tp_group))
        inside.start()
        busy = current().communicator(Shm, topo.tp_group, topo.ranks("tp"), None)._busy
        deadline = time.monotonic() + 30
        while not busy.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            comm.all_reduce(torch.ones(4), group=topo.tp_group)
            raise AssertionError("a concurrent call on the same group was not refused")
        except RuntimeError as exc:
            report["refused"] = str(exc)
        topo.store.set(key, "1")
        inside.join()
    else:
        topo.store.wait([key])
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
    import sys
    import time

    from tests.multirank import launch

    code = ("import torch, fastpar\n"
            "from fastpar import comm\n"
            "topo = fastpar.init(timeout=300)\n"
            "comm.all_reduce(torch.ones(2))\n"
            "if topo.rank == 1:\n"
            "    raise ValueError('boom on rank 1')\n"
            "comm.all_reduce(torch.ones(2))\n")
    start = time.monotonic()
    proc = launch([sys.executable, "-c", code], nranks=2, launcher="mpirun")
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "fastpar: uncaught exception on rank 1; aborting the MPI job" in proc.stderr, \
        proc.stderr
    assert "ValueError: boom on rank 1" in proc.stderr
    assert elapsed < 30, elapsed


def body_peer_dies():
    """Rank 1 leaves in the middle of the job without a word; rank 0, waiting for it in an shm
    all_reduce, reports it dead within a second, naming it."""
    import os
    import time

    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=120)
    comm.use_backend("shm")
    comm.all_reduce(torch.ones(2))
    if topo.rank == 1:
        time.sleep(0.5)
        os._exit(0)  # (a SIGKILL ends the whole job: torchrun and mpirun see to that)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2))
    except RuntimeError as exc:
        return [time.monotonic() - start, str(exc)]
    raise AssertionError("all_reduce with a dead peer returned")


def test_dead_peer_is_named_at_once():
    launch = run_ranks(2, body_peer_dies, launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    elapsed, message = launch.results[0]["value"]
    assert "found rank 1 dead" in message and "has exited" in message, message
    assert elapsed < 5, (elapsed, message)


def body_ctrl_c(rounds):
    """Every rank waits inside the shm kernel (rank 0 on one group, rank 1 on another with the
    same members: neither call can complete) and gets SIGINT: a KeyboardInterrupt within a
    fraction of a second, not at the timeout; the group is then poisoned and says so; teardown
    after that is clean (the job exits 0). Several rounds, on fresh groups each time."""
    import os
    import signal
    import threading
    import time

    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=120)
    comm.use_backend("shm")
    results = []
    for _ in range(rounds):
        a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
        for g in (a, b):
            comm.all_reduce(torch.ones(2), group=g)  # sets up both segments
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(2), group=a if topo.rank == 0 else b)
            raise AssertionError("no KeyboardInterrupt")
        except KeyboardInterrupt as exc:
            results.append([time.monotonic() - start, str(exc)])
        try:
            comm.all_reduce(torch.ones(2), group=a if topo.rank == 0 else b)
            raise AssertionError("a poisoned group served a call")
        except RuntimeError as exc:
            assert "poisoned" in str(exc), exc
            # by code: poisoned by an interrupt, and not an interrupt of this call's own wait
            assert (exc.kind.name, exc.cause.name) == ("POISONED", "INTERRUPTED"), exc.kind
            assert not isinstance(exc, TimeoutError), type(exc)
    return results


def test_ctrl_c_inside_a_collective():
    for rank_results in run_ranks(2, body_ctrl_c, rounds=5, timeout=90).values():
        for waited, message in rank_results:
            assert 0.4 < waited < 3, rank_results
            assert "was interrupted (SIGINT)" in message, message


@pytest.mark.parametrize("how", ["SIGTERM to the job", "SIGKILL to rank 1", "SIGKILL to rank 0"])
def test_no_segment_left_when_setup_is_cut_short(how, tmp_path):
    """Rank 1 sleeps before the group's first collective, so rank 0 waits with the segment's
    name still in /dev/shm; then the job gets SIGTERM (as from a scheduler), or one rank
    SIGKILL: the name goes too (the creator's reaper child unlinks it when the creator dies,
    however it dies)."""
    import os
    import signal
    import time

    from tests.multirank import cut_short_during_setup

    code = ("import os, sys, time, torch, fastpar\n"
            "from fastpar import comm\n"
            "topo = fastpar.init(timeout=120)\n"
            "comm.use_backend('shm')\n"
            f"open(os.path.join({str(tmp_path)!r}, f'pid{{topo.rank}}'), 'w').write("
            "str(os.getpid()))\n"
            "if topo.rank == 1:\n"
            "    time.sleep(60)\n"
            "comm.all_reduce(torch.ones(2))\n")

    def act(proc):
        time.sleep(0.5)
        if how == "SIGTERM to the job":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(int((tmp_path / f"pid{how[-1]}").read_text()), signal.SIGKILL)

    pending, left, output = cut_short_during_setup(code, tmp_path, act)
    assert pending, f"the segment never appeared:\n{output}"
    assert left == set(), output


# How an MPI job ends, as the code after its first all_reduce: every rank has written the
# /dev/shm files it maps or holds open (MPICH's segment, fastpar's) to OUT/shm<rank> by then.
ENDINGS = {
    "finalized": "fastpar.shutdown()\n",
    "uncaught exception": ("if topo.rank == 1:\n"
                           "    raise ValueError('boom on rank 1')\n"
                           "comm.all_reduce(torch.ones(2))\n"),  # rank 0 waits: the abort ends it
    "SIGKILL to rank 1": ("if topo.rank == 1:\n"
                          "    os.kill(os.getpid(), signal.SIGKILL)\n"
                          "comm.all_reduce(torch.ones(2))\n"),  # the launcher kills rank 0
}
SHM_FILES = ("def shm_files():  # what this rank maps or holds open in /dev/shm\n"
             "    found = {line.split(maxsplit=5)[5].strip().removesuffix(' (deleted)')\n"
             "             for line in open('/proc/self/maps') if ' /dev/shm/' in line}\n"
             "    for fd in os.listdir('/proc/self/fd'):\n"
             "        try:\n"
             "            found.add(os.readlink(f'/proc/self/fd/{fd}'))\n"
             "        except OSError:\n"
             "            pass\n"
             "    return sorted(p.removesuffix(' (deleted)') for p in found\n"
             "                  if p.startswith('/dev/shm/'))\n")


@pytest.mark.parametrize("ending,nranks", [("finalized", 2), ("uncaught exception", 2),
                                           ("uncaught exception", 4), ("SIGKILL to rank 1", 2),
                                           ("init fails", 2)])
def test_nothing_of_an_mpi_job_stays_in_dev_shm(ending, nranks, tmp_path):
    """However an mpirun job ends (MPI_Finalize; an uncaught exception, which aborts the job;
    a rank killed, and the launcher killing the rest; rank 0's rendezvous verdict ending every
    rank at init), no file in /dev/shm that any of its ranks mapped or held open stays behind:
    MPICH's segment keeps its name only until every local rank has it mapped."""
    import os
    import socket
    import subprocess
    import sys

    from tests.multirank import launch_argv, launch_env, mpich_segments_removed

    out = str(tmp_path)
    record = (f"open(os.path.join({out!r}, f'shm{{rank}}'), 'w').write('\\n'.join(shm_files()))\n")
    if ending == "init fails":  # every rank raises, after MPI_Init: nothing of fastpar's yet
        code = ("import os, fastpar\n" + SHM_FILES +
                "from mpi4py import MPI\n"
                "rank = MPI.COMM_WORLD.Get_rank()\n"
                "try:\n"
                "    fastpar.init(timeout=30)\n"
                "finally:\n"
                "    " + record)
    else:
        code = ("import os, signal, torch, fastpar\n"
                "from fastpar import comm\n" + SHM_FILES +
                "topo = fastpar.init(timeout=30)\n"
                "rank = topo.rank\n"
                "comm.all_reduce(torch.ones(2))\n" + record +
                "comm.all_reduce(torch.ones(2))\n" + ENDINGS[ending])  # every rank recorded
    with socket.socket() as busy, mpich_segments_removed():  # a leak found is removed after
        busy.bind(("127.0.0.1", 0))
        busy.listen()  # "init fails": rank 0's store cannot take this port
        env = {"FASTPAR_MASTER_ADDR": "127.0.0.1",
               "FASTPAR_MASTER_PORT": str(busy.getsockname()[1])} if ending == "init fails" \
            else {}
        proc = subprocess.run(launch_argv("mpirun", nranks, [sys.executable, "-c", code]),
                              env=launch_env(nranks, env), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=120)
        output = proc.stdout + proc.stderr
        assert (proc.returncode == 0) == (ending == "finalized"), output[-3000:]
        held = {}
        for r in range(nranks):
            with open(tmp_path / f"shm{r}") as f:
                held[r] = f.read().split()
        assert all(any("/mpich_shm_" in p for p in paths) for paths in held.values()), held
        left = sorted({p for paths in held.values() for p in paths if os.path.exists(p)})
        assert left == [], (left, output[-3000:])


def test_nothing_stays_in_dev_shm_when_a_rank_never_joins(tmp_path):
    """Rank 1 of 2 dies before MPI_Init: rank 0 waits in MPI_Init, holding the GIL, with
    MPICH's segment made and named, until init's native watchdog ends it (exit 124); the
    watchdog removes the name first. Rank 0's /dev/shm files are read from outside while it
    waits (it cannot run Python then)."""
    import glob
    import os
    import subprocess
    import sys
    import time

    from tests.multirank import launch_argv, launch_env, mpich_segments_removed

    code = ("import os\n"
            "rank = os.environ['PMI_RANK']\n"
            f"open(os.path.join({str(tmp_path)!r}, 'pid' + rank), 'w').write(str(os.getpid()))\n"
            "if rank == '1':\n"
            "    os._exit(3)\n"
            "import fastpar\n"
            "fastpar.init(timeout=3)\n")
    seen = set()
    with mpich_segments_removed():  # a leak found is removed after
        proc = subprocess.Popen(launch_argv("mpirun", 2, [sys.executable, "-c", code]),
                                env=launch_env(2), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            pid = tmp_path / "pid0"
            if pid.exists() and pid.read_text():
                seen |= _shm_files_of(int(pid.read_text()))
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
        assert "MPI_Init did not complete within 3 s" in output, output[-3000:]
        assert any("/mpich_shm_" in p for p in seen), (seen, glob.glob("/dev/shm/*"), output)
        left = sorted(p for p in seen if os.path.exists(p))
        assert left == [], (left, output[-3000:])


def _shm_files_of(pid: int) -> set:
    """The /dev/shm files process ``pid`` maps or holds open (none once it has gone)."""
    import contextlib
    import os

    found = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        found |= {line.split(maxsplit=5)[5].strip() for line in f if " /dev/shm/" in line}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {p.removesuffix(" (deleted)") for p in found if p.startswith("/dev/shm/")}


def body_soak(calls, seed):
    """Thousands of mixed calls (every op, sync and async, shm and gloo, odd sizes) on
    overlapping groups, every result checked against what the inputs make it."""
    import random

    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=2, timeout=60)
    twins = [dist.new_group(ranks) for ranks in topo.grid.groups("tp")]
    groups = {"world": (None, list(range(topo.world_size))),
              "tp": (topo.tp_group, topo.ranks("tp")),
              "tp_twin": (twins[topo.dp_rank], topo.ranks("tp")),
              "dp": (topo.dp_group, topo.ranks("dp"))}
    plan = random.Random(seed)  # the same choices on every rank
    pending, counts = [], {}

    def value(rank, i, n):
        return torch.arange(n, dtype=torch.float32) + 1000 * rank + i

    for i in range(calls):
        name = plan.choice(sorted(groups))
        group, members = groups[name]
        op = plan.choice(["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
        engine = plan.choice(["shm", "shm", "gloo"])
        n = plan.choice([1, 3, 64, 1000, 4099]) * len(members)
        asynchronous = plan.random() < 0.5
        comm.use_backend(engine)
        me = topo.rank
        if op == "all_reduce":
            out = comm.all_reduce(value(me, i, n), group=group, async_op=asynchronous)
            want = sum(value(r, i, n) for r in members)
        elif op == "all_gather":
            out = comm.all_gather(value(me, i, n), group=group, async_op=asynchronous)
            want = torch.cat([value(r, i, n) for r in members])
        elif op == "reduce_scatter":
            out = comm.reduce_scatter(value(me, i, n), group=group, async_op=asynchronous)
            want = sum(value(r, i, n) for r in members).chunk(len(members))[members.index(me)]
        else:
            src = members[i % len(members)]
            out = comm.broadcast(value(me, i, n), src=src, group=group, async_op=asynchronous)
            want = value(src, i, n)
        pending.append((out, want, f"{i}: {op} on {name} via {engine}"))
        if plan.random() < 0.2 or len(pending) > 16:
            for got, want, what in pending:
                got = got.wait() if isinstance(got, comm.Handle) else got
                assert torch.equal(got, want), what
            pending.clear()
        counts[engine] = counts.get(engine, 0) + 1
    for got, want, what in pending:
        got = got.wait() if isinstance(got, comm.Handle) else got
        assert torch.equal(got, want), what
    return counts


def test_soak_mixed_calls_on_overlapping_groups():
    counts = run_ranks(4, body_soak, calls=5000, seed=11, timeout=120).values()
    assert counts[0]["shm"] + counts[0]["gloo"] == 5000 and counts[0]["gloo"] > 1000


def body_affinity():
    import os

    import fastpar

    topo = fastpar.init(timeout=60)
    return [sorted(os.sched_getaffinity(0)), topo.cpus, topo.oversubscribed]


@pytest.mark.parametrize("bind", ["1", "0"])
def test_local_ranks_get_disjoint_cpus_unless_told(bind):
    """Two ranks the launcher left free get one share of the CPUs each (busy-waiting ranks on
    one core take turns: 4 KB all_reduce ~20 us instead of ~4.5 us); FASTPAR_BIND=0 keeps the
    launcher's placement; fastpar info shows it (Topology.cpus). Topology.oversubscribed says
    whether the host's ranks outnumber its CPUs (the shm waits then sleep early)."""
    import os

    from fastpar.runtime.binding import share

    every = sorted(os.sched_getaffinity(0))
    (cpus0, why0, over0), (cpus1, why1, over1) = run_ranks(
        2, body_affinity, env={"FASTPAR_BIND": bind}, timeout=60).values()
    # Oversubscribed: this host's ranks outnumber the CPUs they may run on together.
    assert over0 == over1 == (2 > len(every))
    four = run_ranks(4, body_affinity, env={"FASTPAR_BIND": bind}, timeout=60).values()
    assert [over for _, _, over in four] == [4 > len(every)] * 4, four
    if bind == "0":
        assert cpus0 == cpus1 == every and why0.endswith("(FASTPAR_BIND=0)")
    elif len(every) < 2:
        assert "shared" in why0
    else:
        assert cpus0 == share(every, 0, 2) and cpus1 == share(every, 1, 2), (cpus0, cpus1)
        assert not set(cpus0) & set(cpus1)
        assert why0.endswith("(fastpar: local rank 0 of 2)") and "local rank 1" in why1


@pytest.mark.quick
def test_cpu_shares():
    from fastpar.runtime.binding import share

    assert [share(list(range(8)), r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [share([0, 2, 4, 6], r, 2) for r in range(2)] == [[0, 2], [4, 6]]


def body_idle_wait(seconds):
    """Ranks that wait long for a late peer (a collective, then a pipeline receive) sleep on
    their bells: the CPU time each waiting thread spends, against the wall time it waits."""
    import time

    import torch

    import fastpar
    from fastpar import comm
    from fastpar.pipeline import channels as p2p

    topo = fastpar.init(pp=2, timeout=60)
    x = torch.ones(1024)
    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    comm.all_reduce(x)  # the segment is made and every rank is here: the waits below are pure
    waited = {"oversubscribed": topo.oversubscribed}
    if topo.rank == 1:  # late for the all_reduce: every other rank waits for it
        time.sleep(seconds)
    cpu, start = time.thread_time(), time.monotonic()
    comm.all_reduce(x)
    if topo.rank != 1:
        waited["all_reduce"] = (time.thread_time() - cpu, time.monotonic() - start)
    if topo.is_first_stage:  # late to send: every last-stage rank waits for its activation
        time.sleep(seconds)
        ch.send_forward(x, mb=0, stage=1).wait()
    else:
        cpu, start = time.thread_time(), time.monotonic()
        ch.recv_forward(mb=0, stage=1)
        waited["recv_forward"] = (time.thread_time() - cpu, time.monotonic() - start)
    ch.finish_step()
    return {"engine": ch.engine_name, **waited}


@pytest.mark.parametrize("world", [2, 4])
def test_waiting_for_a_late_peer_costs_no_cpu(world):
    """Spinning, yielding or napping waiters take the CPU the late peer needs when ranks share
    cores (the main job at 4 ranks on 2 cores was 1.5x slower on shm than on gloo for it). At
    4 ranks on this machine's 2 cores the host is oversubscribed and waits yield early."""
    import os

    values = run_ranks(world, body_idle_wait, seconds=1.5,
                       env={"FASTPAR_COMM_BACKEND": "shm"}).values()
    assert {v["engine"] for v in values} == {"shm"}
    assert {v["oversubscribed"] for v in values} == {world > len(os.sched_getaffinity(0))}
    waits = [(what, v[what]) for v in values for what in ("all_reduce", "recv_forward")
             if what in v]
    assert len(waits) == (world - 1) + world // 2, waits
    for what, (cpu, wall) in waits:
        assert wall > 1.0, (what, wall)
        # Asleep but for the first ~10-30 ms of spins and yields and a wake every 10 ms.
        assert cpu < 0.1 * wall, (what, cpu, wall)


@pytest.mark.quick
def test_an_affinity_set_before_init_is_never_narrowed(monkeypatch):
    """taskset on every rank alike (an affinity short of the machine's CPUs) is the user's
    choice: kept; the machine's whole set is narrowed to shares as before."""
    import torch

    from fastpar.runtime import binding

    assert binding.parse_cpus("0-2,5\n") == [0, 1, 2, 5]
    assert binding.machine_cpus()  # this host says which CPUs it has
    monkeypatch.setenv("FASTPAR_BIND", "1")
    monkeypatch.setattr(binding, "affinity", lambda: [0, 1])
    monkeypatch.setattr(binding, "machine_cpus", lambda: [0, 1, 2, 3])
    why, undo = binding.bind_cpus(0, 2, torch.device("cpu"), [[0, 1], [0, 1]])
    assert undo is None and why == "0-1 (set before init, kept: the machine has 0-3)", why
    monkeypatch.setattr(binding, "_set_all_threads", lambda cpus: None)  # no real change
    monkeypatch.setattr(binding, "machine_cpus", lambda: [0, 1])
    why, undo = binding.bind_cpus(1, 2, torch.device("cpu"), [[0, 1], [0, 1]])
    assert undo is not None and why == "1 (fastpar: local rank 1 of 2)", why
    undo()

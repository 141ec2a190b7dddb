"""Bad input ends in a clear error on every rank, within seconds, never a hang."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.multirank import launch_env, run_ranks


def body_init(tp=1, pp=1, init_timeout=30.0, die_rank=None):
    import fastpar
    from fastpar.runtime.launcher import detect

    if die_rank is not None and detect(os.environ).rank == die_rank:
        os._exit(3)  # a rank that dies before joining
    fastpar.init(tp=tp, pp=pp, timeout=init_timeout)
    return "joined"


def body_bad_degrees():
    """Every invalid tp/pp is rejected before any communication, with the numbers named."""
    import fastpar

    messages = []
    for tp, pp in ((0, 1), (1, 0), (-1, 2), (3, 1), (1, 5), (2, 2)):
        try:
            fastpar.init(tp=tp, pp=pp, timeout=10)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            raise AssertionError(f"tp={tp} pp={pp} accepted on 2 ranks")
    fastpar.init()  # and the process is still usable afterwards
    return messages


def body_timeouts():
    """Bad timeouts are a ValueError before any communication; math.inf means no limit (the
    first init, so MPI_Init runs under it), and a huge finite one works too."""
    import math

    import torch

    import fastpar
    from fastpar import comm

    messages = []
    for bad in (0, -1.0, math.nan, "soon", None, True):
        try:
            fastpar.init(timeout=bad)
            raise AssertionError(f"timeout={bad!r} accepted")
        except ValueError as exc:
            messages.append(str(exc))
    for timeout in (math.inf, 1e30):
        topo = fastpar.init(timeout=timeout)
        assert topo.timeout == timeout
        for group in (None, topo.dp_group):
            x = torch.ones(3)
            comm.all_reduce(x, group=group)
            assert x.tolist() == [2.0] * 3
        fastpar.shutdown()
    return messages


def test_indivisible_world_fails_on_every_rank_quickly():
    launch = run_ranks(3, body_init, tp=2, check=False, timeout=60)
    assert launch.returncode not in (0, None), launch.describe()
    assert sorted(launch.results) == [0, 1, 2], launch.describe()
    for r in range(3):
        assert launch.results[r]["error"] == \
            "ValueError: world_size 3 is not divisible by tp 2 x pp 1", launch.describe()
    assert launch.elapsed < 30, launch.describe()


@pytest.mark.quick
def test_bad_degrees_named():
    (messages, _) = run_ranks(2, body_bad_degrees).values()
    assert messages == [
        "tp must be a positive integer, got 0",
        "pp must be a positive integer, got 0",
        "tp must be a positive integer, got -1",
        "world_size 2 is not divisible by tp 3 x pp 1",
        "world_size 2 is not divisible by tp 1 x pp 5",
        "world_size 2 is not divisible by tp 2 x pp 2",
    ]


def test_timeouts_no_limit_and_bad_values():
    (messages, _) = run_ranks(2, body_timeouts, timeout=90).values()
    assert messages[:3] == [
        f"timeout must be a positive number of seconds (math.inf for no limit), got {v}"
        for v in ("0", "-1.0", "nan")]
    assert messages[3:5] == ["timeout must be a number of seconds, got 'soon'",
                             "timeout must be a number of seconds, got None"]
    assert messages[5].endswith("got True")


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_dead_rank_during_init_ends_the_job(launcher):
    launch = run_ranks(3, body_init, launcher=launcher, die_rank=1, init_timeout=5.0,
                        check=False, timeout=60)
    assert launch.returncode not in (0, None), launch.describe()
    assert 1 in launch.missing
    assert launch.elapsed < 40, launch.describe()
    if launcher == "mpirun":
        # Survivors are stuck in MPI_Init (which holds the GIL); the native watchdog ends them.
        assert "MPI_Init did not complete within 5 s" in launch.output, launch.describe()
    else:
        assert "exitcode  : 3" in launch.output or "exitcode: 3" in launch.output, launch.output


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_rank(rank, world, port, timeout):
    env = launch_env(1, {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port)})
    code = (f"import time, fastpar\nstart = time.monotonic()\ntry:\n"
            f"    fastpar.init(timeout={timeout})\nfinally:\n"
            f"    print('init ended after', time.monotonic() - start, 's')")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_rank_that_cannot_reach_rank0():
    port = _free_port()  # nobody listens there: rank 0 never started
    start = time.monotonic()
    proc = _spawn_rank(1, 2, port, timeout=3)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert f"rank 1 could not reach rank 0 at 127.0.0.1:{port} within 3 s" in out, out
    assert time.monotonic() - start < 30
    took = float(out.split("init ended after ")[1].split()[0])
    assert 2.9 <= took <= 3 + 2, out  # on time: torch's own client once took 7.8 s for 3


def test_peer_that_never_arrives_is_named():
    """Ranks 0 and 2 of 3 start, rank 1 never does: both fail naming rank 1, in about timeout."""
    port = _free_port()
    start = time.monotonic()
    procs = [_spawn_rank(r, 3, port, timeout=4) for r in (0, 2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode != 0
        assert "rank(s) [1] never arrived" in out, out
    assert time.monotonic() - start < 30


def body_store_port_taken(port):
    import fastpar

    try:
        fastpar.init(timeout=5)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("init succeeded although the store port was taken")


def test_mpi_rendezvous_failure_reaches_every_rank():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launch = run_ranks(2, body_store_port_taken, port=port,
                           env={"FASTPAR_MASTER_ADDR": "127.0.0.1",
                                "FASTPAR_MASTER_PORT": str(port)})
    for message in launch.values():
        assert f"could not start the rendezvous store at 127.0.0.1:{port}" in message, message


# A failure every rank sees, through each front door: (argv, the job's exit status). The
# script has no handler: fastpar's MPI abort hook ends the job.
DOORS = {"script": ([sys.executable, "-c", "import fastpar; fastpar.init(tp={tp}, timeout=30)"],
                    1),
         "train": ([sys.executable, "-m", "fastpar.train", "--steps", "1", "--timeout", "30"], 1),
         "info": ([sys.executable, "-m", "fastpar", "info", "--timeout", "30"], 2)}


@pytest.mark.parametrize("door,nranks,failure,debug", [
    ("script", 2, "layout", False), ("script", 4, "store port", False),
    ("train", 2, "store port", False), ("info", 4, "store port", False),
    ("info", 2, "store port", True)])
def test_a_failure_every_rank_sees_is_said_once(door, nranks, failure, debug):
    """A bad layout (the same check on every rank) or rank 0's rendezvous verdict (its store's
    port taken; a job across hosts that found only loopback is the same broadcast) ends every
    rank with the front door's status, said in one message by rank 0; the other ranks' own
    words only with FASTPAR_DEBUG=1."""
    from tests.multirank import launch

    argv, status = DOORS[door]
    argv = [a.format(tp=3 if failure == "layout" else 1) for a in argv]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"FASTPAR_MASTER_ADDR": "127.0.0.1", "FASTPAR_MASTER_PORT": str(port)} \
            if failure == "store port" else {}
        env["FASTPAR_DEBUG"] = "1" if debug else "0"
        start = time.monotonic()
        proc = launch(argv, nranks=nranks, launcher="mpirun", env=env, timeout=120)
        elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    said = {"layout": f"world_size {nranks} is not divisible by tp 3 x pp 1",
            "store port": f"rank 0 could not start the rendezvous store at 127.0.0.1:{port}"}
    assert proc.returncode == status, text[-3000:]
    if debug:  # every rank: rank 0's words, and the others' (naming rank 0's)
        assert text.count(said[failure]) == nranks, text[-3000:]
        assert text.count("(rank 0 failed)") == nranks - 1, text[-3000:]
    else:
        assert text.count(said[failure]) == 1, text[-3000:]
        assert "rank 0 failed" not in text and "on rank 1" not in text, text[-3000:]
    assert elapsed < 60, (elapsed, text[-3000:])  # the quiet ranks do not hold the job up

"""State you can see: what one job made goes with ``fastpar.shutdown``, and a re-init with
another layout starts clean; the forced engine has one reader. (The layers' imports:
tests/test_layers.py.)
"""

import pytest

from tests.multirank import run_ranks


def body_reinit():
    """init, use, shutdown, init with another layout, use: nothing of the first job leaks."""
    import torch

    import fastpar
    from fastpar import comm
    from fastpar.nn import random as nn_random
    from fastpar.pipeline.channels import Channels
    from fastpar.runtime import job

    out = {}
    topo = fastpar.init(tp=1, pp=2)
    first = job()
    comm.use_backend("gloo")  # in code: the p2p engine follows it, and reasons name it
    ch = Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    out["p2p_engine"] = [ch.engine_name, ch.reason]
    x = torch.full((3,), float(topo.rank))
    if topo.is_first_stage:
        ch.send_forward(x, mb=0, stage=1).wait()
    else:
        out["received"] = ch.recv_forward(mb=0, stage=1).tolist()
    ch.finish_step()
    out["sum"] = comm.all_reduce(torch.ones(2), group=topo.pp_group).tolist()
    from fastpar.comm import routing
    from fastpar.comm.state import current

    out["reason"] = routing.engine_table({"pp": topo.pp_group}, "cpu", 64)[0]["reason"]
    nn_random.seed(7)
    out["parts"] = sorted(first.parts)
    first.on_close(fastpar.shutdown)  # a closer that shuts down: not re-entered
    fastpar.shutdown()
    out["parts_after"] = sorted(first.parts)
    try:  # the job's channels went with it (a part of the job, closed by shutdown)
        ch.send_forward(x, mb=1, stage=1)
    except RuntimeError as exc:
        out["verb_after_shutdown"] = str(exc)

    topo = fastpar.init(tp=2, pp=1)  # another layout
    second = job()
    out["fresh"] = second is not first and second.parts == {}
    out["forced_again"] = current().forced  # the environment's (none), not use_backend's
    out["streams_fresh"] = "tp" not in nn_random.tracker().states
    try:
        ch.recv_forward(mb=0, stage=1)
    except RuntimeError as exc:
        out["verb_in_new_job"] = str(exc)
    out["sum2"] = comm.all_reduce(torch.ones(2), group=topo.tp_group).tolist()
    return out


@pytest.mark.quick
def test_reinit_with_another_layout_starts_clean():
    for rank, v in enumerate(run_ranks(2, body_reinit).values()):
        assert v["p2p_engine"] == ["torch", "forced by comm.use_backend('gloo')"], v
        assert v["reason"] == "forced by comm.use_backend('gloo')", v
        if rank == 1:
            assert v["received"] == [0.0, 0.0, 0.0]
        assert v["sum"] == [2.0, 2.0]
        assert {"comm", "nn.random"} <= set(v["parts"]), v["parts"]
        assert v["parts_after"] == []
        assert "Channels were closed" in v["verb_after_shutdown"]
        assert v["fresh"] and v["forced_again"] is None and v["streams_fresh"]
        assert "Channels were closed" in v["verb_in_new_job"]
        assert v["sum2"] == [2.0, 2.0]


def body_forced_by_environment():
    import fastpar
    from fastpar.comm import routing
    from fastpar.pipeline.channels import Channels

    topo = fastpar.init(pp=2)
    ch = Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    return [ch.engine_name, ch.reason,
            routing.engine_table({"pp": topo.pp_group}, "cpu", 64)[0]["reason"]]


def test_environment_forces_collectives_and_p2p_alike():
    for v in run_ranks(2, body_forced_by_environment,
                       env={"FASTPAR_COMM_BACKEND": "gloo"}).values():
        assert v == ["torch", "forced by FASTPAR_COMM_BACKEND=gloo",
                     "forced by FASTPAR_COMM_BACKEND=gloo"], v


@pytest.mark.quick
def test_job_parts_close_last_made_first_and_every_one():
    from fastpar.grid import Grid, Topology
    from fastpar.runtime.job import Job

    closed = []

    class Part:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError(f"{self.name} failed")

    grid = Grid(1, 1, 1)
    topo = Topology(grid=grid, rank=0, local_rank=0, local_world_size=1, device=None,
                    backend="gloo", launcher="single")
    job = Job(topology=topo, args=(), owns_pg=False)
    a = job.part("a", lambda: Part("a", fail=True))
    assert job.part("a", lambda: Part("other")) is a  # made once
    job.part("plain", dict)  # no close(): nothing to call
    seen = {}

    def hook():  # a closer still finds the parts; none can be made any more
        closed.append("hook")
        seen["a"] = job.part("a", lambda: Part("other")) is a
        try:
            job.part("new", dict)
        except RuntimeError as exc:
            seen["new"] = str(exc)

    job.on_close(hook)
    job.part("b", lambda: Part("b"))
    with pytest.raises(OSError, match="a failed"):
        job.close()
    assert closed == ["b", "hook", "a"] and job.parts == {} and job.closing
    assert seen == {"a": True, "new": "fastpar: the job is shutting down; its part 'new' "
                                      "cannot be made now"}

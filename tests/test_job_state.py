"""State you can see: what one job made goes with ``fastpar.shutdown``, and a re-init with
another layout starts clean; the forced engine has one reader; the layers import downward only.
"""

import ast
import os

import pytest

from tests.multirank import ROOT, run_ranks

LIBRARY = os.path.join(ROOT, "fastpar")


def body_reinit():
    """init, use, shutdown, init with another layout, use: nothing of the first job leaks."""
    import torch

    import fastpar
    from fastpar import comm
    from fastpar.comm import p2p
    from fastpar.nn import random as nn_random
    from fastpar.runtime import job

    out = {}
    topo = fastpar.init(tp=1, pp=2)
    first = job()
    comm.use_backend("gloo")  # in code: the p2p engine follows it, and reasons name it
    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    out["p2p_engine"] = [ch.engine_name, ch.reason]
    x = torch.full((3,), float(topo.rank))
    if topo.is_first_stage:
        p2p.send_forward(x, mb=0, stage=1).wait()  # the module-level verbs: the job's Channels
    else:
        out["received"] = p2p.recv_forward(mb=0, stage=1).tolist()
    ch.finish_step()
    out["sum"] = comm.all_reduce(torch.ones(2), group=topo.pp_group).tolist()
    from fastpar.comm.state import current

    out["reason"] = current().engine_table({"pp": topo.pp_group}, "cpu", 64)[0]["reason"]
    nn_random.seed(7)
    out["parts"] = sorted(first.parts)
    first.on_close(fastpar.shutdown)  # a closer that shuts down: not re-entered
    fastpar.shutdown()
    out["parts_after"] = sorted(first.parts)
    try:
        p2p.send_forward(x, mb=1, stage=1)
    except RuntimeError as exc:
        out["verb_after_shutdown"] = str(exc)

    topo = fastpar.init(tp=2, pp=1)  # another layout
    second = job()
    out["fresh"] = second is not first and second.parts == {}
    out["forced_again"] = current().forced  # the environment's (none), not use_backend's
    out["streams_fresh"] = "tp" not in nn_random.tracker().states
    try:
        p2p.recv_forward(mb=0, stage=1)
    except RuntimeError as exc:
        out["verb_in_new_job"] = str(exc)
    out["sum2"] = comm.all_reduce(torch.ones(2), group=topo.tp_group).tolist()
    return out


def test_reinit_with_another_layout_starts_clean():
    for rank, v in enumerate(run_ranks(2, body_reinit).values()):
        assert v["p2p_engine"] == ["torch", "forced by comm.use_backend('gloo')"], v
        assert v["reason"] == "forced by comm.use_backend('gloo')", v
        if rank == 1:
            assert v["received"] == [0.0, 0.0, 0.0]
        assert v["sum"] == [2.0, 2.0]
        assert {"comm", "nn.random"} <= set(v["parts"]), v["parts"]
        assert v["parts_after"] == []
        assert "fastpar.init() has not been called" in v["verb_after_shutdown"]
        assert v["fresh"] and v["forced_again"] is None and v["streams_fresh"]
        assert "no open Channels in this job" in v["verb_in_new_job"]
        assert v["sum2"] == [2.0, 2.0]


def body_forced_by_environment():
    import fastpar
    from fastpar.comm import p2p
    from fastpar.comm.state import current

    topo = fastpar.init(pp=2)
    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    return [ch.engine_name, ch.reason,
            current().engine_table({"pp": topo.pp_group}, "cpu", 64)[0]["reason"]]


def test_environment_forces_collectives_and_p2p_alike():
    for v in run_ranks(2, body_forced_by_environment,
                       env={"FASTPAR_COMM_BACKEND": "gloo"}).values():
        assert v == ["torch", "forced by FASTPAR_COMM_BACKEND=gloo",
                     "forced by FASTPAR_COMM_BACKEND=gloo"], v


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


# -------------------------------------------------------------------------------- the layers

def _imports() -> dict[str, set[str]]:
    """fastpar's module graph: module -> the fastpar modules it imports (anywhere in it,
    function-level imports included)."""
    mods = {}
    for folder, _, files in os.walk(LIBRARY):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    mods["fastpar._C"] = None  # the native extension: a leaf

    def known(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        deps = set()
        if path is not None:
            package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Import):
                    deps |= {known(a.name) for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    deps |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods
                             else known(base) for a in node.names}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


# Which layers a layer must never import (docs/design.md, "Layers").
FRONT_DOORS = ("fastpar.train", "fastpar.info", "fastpar.__main__")
NEVER = {
    "fastpar.grid": ("fastpar.runtime", "fastpar.comm"),
    "fastpar.runtime": ("fastpar.comm", "fastpar.nn", "fastpar.kernels", "fastpar.pipeline",
                        "fastpar.data_parallel", "fastpar.optim", "fastpar.models",
                        "fastpar.training", "fastpar.train", "fastpar.parallelize",
                        "fastpar.state_dict", "fastpar.info"),
    "fastpar.comm": ("fastpar.nn", "fastpar.pipeline", "fastpar.data_parallel", "fastpar.optim",
                     "fastpar.models", "fastpar.training", "fastpar.train"),
    "fastpar.kernels": ("fastpar.comm", "fastpar.nn"),
    "fastpar.pipeline": ("fastpar.nn", "fastpar.models", "fastpar.train"),
    "fastpar.models": ("fastpar.train", "fastpar.training"),
    **{layer: FRONT_DOORS for layer in ("fastpar.nn", "fastpar.data_parallel", "fastpar.optim",
                                        "fastpar.training", "fastpar.parallelize",
                                        "fastpar.state_dict", "fastpar.kernels")},
    # beside the library: the tolerance helpers and the cluster harness import nothing of it
    "fastpar.testing": ("fastpar.grid", "fastpar.runtime", "fastpar.comm", "fastpar.kernels",
                        "fastpar.nn", "fastpar.pipeline", "fastpar.data_parallel",
                        "fastpar.optim", "fastpar.models", "fastpar.training",
                        "fastpar.parallelize", "fastpar.state_dict", "fastpar._native",
                        "fastpar.version", "fastpar._C", *FRONT_DOORS),
}


def _breaches(graph) -> list[tuple[str, str]]:
    """``(module, what it imports)`` for every import the NEVER table forbids."""
    def under(m, pkg):
        return m == pkg or m.startswith(pkg + ".")

    return [(m, d) for layer, banned in NEVER.items() for m in graph if under(m, layer)
            for d in graph[m] if any(under(d, b) for b in banned)]


def test_no_import_circles_and_layers_import_downward():
    graph = _imports()
    assert len(graph) > 50 and "fastpar.comm.collectives" in graph["fastpar.nn.overlap"]
    assert _cycles(graph) == []
    assert _breaches(graph) == []
    # The library never imports bench/ or tests/.
    for folder, _, files in os.walk(LIBRARY):
        for f in (f for f in files if f.endswith(".py")):
            for node in ast.walk(ast.parse(open(os.path.join(folder, f)).read())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not [n for n in names if n.split(".")[0] in ("bench", "tests")], (f, names)


def test_the_checker_sees_a_circle_and_a_layer_breach():
    graph = {"fastpar.a": {"fastpar.b"}, "fastpar.b": {"fastpar.c"}, "fastpar.c": {"fastpar.a"},
             "fastpar.d": set()}
    assert _cycles(graph) == [["fastpar.a", "fastpar.b", "fastpar.c"]]
    real = _imports()
    real["fastpar.runtime.bootstrap"].add("fastpar.comm.state")
    real["fastpar.comm.state"].add("fastpar.runtime.bootstrap")
    assert any("fastpar.comm.state" in c for c in _cycles(real))
    assert ("fastpar.runtime.bootstrap", "fastpar.comm.state") in _breaches(real)
    real["fastpar.pipeline.pipe"].add("fastpar.train")  # a layer reaching up to the front door
    assert ("fastpar.pipeline.pipe", "fastpar.train") in _breaches(real)
    real["fastpar.testing.cluster"].add("fastpar.runtime.launcher")
    assert ("fastpar.testing.cluster", "fastpar.runtime.launcher") in _breaches(real)

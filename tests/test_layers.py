"""The layers of docs/design.md, checked on the source: fastpar's import graph (every import,
those inside functions included) has no circle, between modules or between packages; no layer
imports one above it (the ``NEVER`` table); the library never imports bench/ or tests/; no
module grows past the line limit. Read from the files with ``ast``; nothing is imported."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.quick

LIBRARY = os.path.join(ROOT, "fastpar")
MAX_LINES = 400
# a module allowed over MAX_LINES, at most its size when named here (none now)
OVER_LIMIT: dict[str, int] = {}
COMM_TOP_MODULES = 12  # comm/'s own modules (engines/ and transport/ hold the rest)
ENGINE_NAMES = {"local", "shm", "mpi", "gloo", "nccl", "cuda_ipc", "nccl_mpi", "hier"}


def _modules() -> dict[str, str | None]:
    mods = {}
    for folder, _, files in os.walk(LIBRARY):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    mods["fastpar._C"] = None  # the native extension: a leaf
    return mods


def _imports(mods=None) -> dict[str, set[str]]:
    """fastpar's module graph: module -> the fastpar modules it imports (anywhere in it,
    function-level imports included). ``from a import b`` is the module ``a.b`` when there is
    one, else ``a`` (a name defined in ``a``'s file: a package's ``__init__`` is a module)."""
    mods = _modules() if mods is None else mods

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
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    """``fastpar.comm.engines.shm`` -> ``fastpar.comm``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _packages(graph) -> dict[str, set[str]]:
    """The graph between packages: ``fastpar.plan`` -> ``fastpar.training`` when any module of
    the one imports any of the other."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(_package(mod), set()).update(
            _package(d) for d in deps if _package(d) != _package(mod))
    return out


# Which layers a layer must never import (docs/design.md, "Layers").
FRONT_DOORS = ("fastpar.train", "fastpar.info", "fastpar.__main__", "fastpar.generate",
               "fastpar.evaluate", "fastpar.quantize", "fastpar.prune")
JOBS = ("fastpar.training", *FRONT_DOORS)
NEVER = {
    "fastpar.grid": ("fastpar.runtime", "fastpar.comm"),
    "fastpar.runtime": ("fastpar.comm", "fastpar.nn", "fastpar.kernels", "fastpar.pipeline",
                        "fastpar.data_parallel", "fastpar.optim", "fastpar.models",
                        "fastpar.parallelize", "fastpar.state_dict", "fastpar.plan",
                        "fastpar.checkpoint", "fastpar.backend", *JOBS),
    "fastpar.comm": ("fastpar.nn", "fastpar.pipeline", "fastpar.data_parallel", "fastpar.optim",
                     "fastpar.models", "fastpar.plan", "fastpar.checkpoint", "fastpar.backend",
                     *JOBS),
    # the torch.distributed backend stands on the engines, beside the layers that use them
    "fastpar.backend": ("fastpar.nn", "fastpar.pipeline", "fastpar.data_parallel",
                        "fastpar.optim", "fastpar.models", "fastpar.plan", "fastpar.checkpoint",
                        *JOBS),
    "fastpar.kernels": ("fastpar.comm", "fastpar.nn", *FRONT_DOORS),
    "fastpar.pipeline": ("fastpar.nn", "fastpar.models", *JOBS),
    "fastpar.models": ("fastpar.plan", *JOBS),
    # the planner stands below the trainer (the trainer fit is passed in by the front door)
    "fastpar.plan": JOBS,
    "fastpar.checkpoint": ("fastpar.plan", *JOBS),
    **{layer: FRONT_DOORS for layer in ("fastpar.nn", "fastpar.data_parallel", "fastpar.optim",
                                        "fastpar.training", "fastpar.parallelize",
                                        "fastpar.state_dict", "fastpar.generation",
                                        "fastpar.pruning")},
    # leaves beside the layers: a tp plan's tables, a Hugging Face directory's tensors
    **{leaf: ("fastpar.grid", "fastpar.runtime", "fastpar.comm", "fastpar.nn", "fastpar.pipeline",
              "fastpar.models", "fastpar.parallelize", *JOBS)
       for leaf in ("fastpar.tp_plan", "fastpar.hf_files")},
    # beside the library: the tolerance helpers and the cluster harness import nothing of it
    "fastpar.testing": ("fastpar.grid", "fastpar.runtime", "fastpar.comm", "fastpar.kernels",
                        "fastpar.nn", "fastpar.pipeline", "fastpar.data_parallel",
                        "fastpar.optim", "fastpar.models", "fastpar.training",
                        "fastpar.parallelize", "fastpar.state_dict", "fastpar._native",
                        "fastpar.version", "fastpar._C", "fastpar.plan", "fastpar.checkpoint",
                        "fastpar.backend", "fastpar.tp_plan", "fastpar.hf_files",
                        *FRONT_DOORS),
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


def test_no_import_circle_between_packages():
    """``plan`` importing ``training.x`` while ``training.y`` imports ``plan.z`` is no circle
    between modules, but it is between the layers."""
    assert _cycles(_packages(_imports())) == []


def test_the_checker_sees_a_circle_and_a_layer_breach(tmp_path):
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
    # every row holds: kernels may not reach comm (a later row once overwrote this one)
    real["fastpar.kernels.gemm"].add("fastpar.comm.collectives")
    assert ("fastpar.kernels.gemm", "fastpar.comm.collectives") in _breaches(real)
    real["fastpar.testing.cluster"].add("fastpar.runtime.launcher")
    assert ("fastpar.testing.cluster", "fastpar.runtime.launcher") in _breaches(real)
    real["fastpar.plan.predict"].add("fastpar.training.memory")  # the planner reaching up
    assert ("fastpar.plan.predict", "fastpar.training.memory") in _breaches(real)
    # the package graph: no module circle, but plan <-> training
    assert _cycles(_packages({"fastpar.plan.a": {"fastpar.training.b"},
                              "fastpar.training.c": {"fastpar.plan.d"}})) \
        == [["fastpar.plan", "fastpar.training"]]
    # the reader: an import inside a function and a relative one are both seen
    (tmp_path / "a.py").write_text("def f():\n    from fastpar import b\n")
    (tmp_path / "b.py").write_text("from .a import f\n")
    mods = {"fastpar.a": str(tmp_path / "a.py"), "fastpar.b": str(tmp_path / "b.py")}
    assert _imports(mods) == {"fastpar.a": {"fastpar.b"}, "fastpar.b": {"fastpar.a"}}


def test_no_module_grows_past_the_line_limit():
    over = {}
    for folder, _, files in os.walk(LIBRARY):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path) as fh:
                lines = sum(1 for _ in fh)
            if lines > OVER_LIMIT.get(rel, MAX_LINES):
                over[rel] = lines
    assert over == {}, f"over {MAX_LINES} lines (or over their size in OVER_LIMIT)"


def test_comm_asks_its_engines_and_keeps_few_modules_at_its_top():
    """The raw and the quantized collectives ask an engine's adapter what it can do
    (``route.adapter.local``, ``.byte_mover()``, ...) instead of comparing its name; comm/'s
    top level holds at most COMM_TOP_MODULES modules (one engine, one module under engines/)."""
    named = []
    for module in ("collectives.py", "quantized.py"):
        path = os.path.join(LIBRARY, "comm", module)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) \
                        else [side]
                    named += [f"{module}:{node.lineno} {v.value!r}" for v in values
                              if isinstance(v, ast.Constant) and v.value in ENGINE_NAMES]
    assert named == []
    top = sorted(f for f in os.listdir(os.path.join(LIBRARY, "comm")) if f.endswith(".py"))
    assert len(top) <= COMM_TOP_MODULES, top

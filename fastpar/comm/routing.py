"""Where one collective goes: the engine the policy picks, its adapter (``comm/engines/``) and
its communicator for the group, cached per job.

    route = routing.route("all_reduce", t, group, "sum")   # Route: group, ranks, engine, ...
    route.adapter.all_reduce(route, t, route.op, async_op)

``ADAPTERS`` is the one table of engine names to adapters; what an engine can do is a
capability of its adapter (``local``, ``byte_mover``, ``native_quant``, ``gather_from``, ...),
so no caller compares engine names.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fastpar.comm import policy
from fastpar.comm.engines.base import Local
from fastpar.comm.engines.cuda_ipc import CudaIpc
from fastpar.comm.engines.hierarchical import Hier
from fastpar.comm.engines.mpi import Mpi
from fastpar.comm.engines.nccl_mpi import NcclMpi
from fastpar.comm.engines.nccl_mpi import unavailable as nccl_mpi_unavailable
from fastpar.comm.engines.shm import Shm
from fastpar.comm.engines.torch_dist import TORCH_OPS, Torch
from fastpar.comm.state import current

log = logging.getLogger("fastpar.comm")

ADAPTERS = {"local": Local, "shm": Shm, "cuda_ipc": CudaIpc, "nccl_mpi": NcclMpi, "mpi": Mpi,
            "gloo": Torch, "nccl": Torch, "hier": Hier}


def adapter(engine: str):
    """The adapter of ``engine`` (any other torch.distributed backend's name is torch's)."""
    return ADAPTERS.get(engine, Torch)


class Route:
    """Where one kind of call goes: the group, its ranks, the engine, its adapter and its
    communicator."""

    __slots__ = ("group", "ranks", "engine", "adapter", "comm", "op")

    def __init__(self, group, ranks, engine, comm, op):
        self.group, self.ranks, self.engine, self.comm = group, ranks, engine, comm
        self.adapter = adapter(engine)
        self.op = op  # the reduce op's name ("sum", ...), whatever form the caller gave


def op_name(op) -> str:
    """``"sum"`` & co. from a string or a ``torch.distributed.ReduceOp`` ("avg", which the
    collectives make from "sum", included)."""
    if is_avg(op):
        return "avg"
    if isinstance(op, str):
        if op in TORCH_OPS:
            return op
    else:
        for name, red in TORCH_OPS.items():
            if op == red:
                return name
    raise ValueError(f"op must be one of {', '.join(map(repr, TORCH_OPS))}, 'avg' or the "
                     f"torch.distributed.ReduceOp of the same name, got {op!r}")


def is_avg(op) -> bool:
    """Whether ``op`` is the mean ("avg" or ``ReduceOp.AVG``)."""
    if isinstance(op, str):
        return op == "avg"
    try:
        return op == dist.ReduceOp.AVG
    except TypeError:
        return False


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}; "
                        "call .to_dense() first")


def engine_facts(st, facts):
    """``facts`` with what only the engines can tell, short of building anything: under a
    forced ``nccl_mpi``, whether it can run here (CuPy's NCCL, an MPI launch)."""
    if st.forced != "nccl_mpi":
        return facts
    why = nccl_mpi_unavailable(mpi_launched=st.topo.mpi_comm is not None) or ""
    return policy.GroupFacts(**{**facts.__dict__, "nccl_mpi": why})


def choose(name: str, t: torch.Tensor, group, op: str = "sum"):
    """``(group, ranks, Choice)`` for one call. A CUDA all_reduce within a node first builds
    the group's CUDA IPC communicator (collective over the group), whose size limit the
    decision needs (only when no other engine is forced)."""
    st = current()
    group, ranks, facts = st.resolve(group)
    facts = engine_facts(st, facts)
    if (t.is_cuda and name == "all_reduce" and facts.size > 1 and facts.same_host
            and st.forced in (None, "cuda_ipc")):
        comm = st.communicator(CudaIpc, group, ranks, t.device)
        if comm is not None:
            facts = policy.GroupFacts(**{**facts.__dict__, "ipc_ready": True,
                                         "ipc_max_bytes": comm.max_bytes})
    return group, ranks, st.decide(name, t.device.type, facts, t.numel() * t.element_size(),
                                   t.dtype, op)


def engine_table(groups: dict, device_type: str, nbytes: int,
                 dtype: torch.dtype = torch.float32) -> list[dict]:
    """What the policy would choose for each op on each of ``groups`` (``{name: group}``),
    without creating any communicator: rows ``{"group", "ranks", "op", "engine", "reason"}``.
    CUDA IPC is reported as undecided: it needs its collective probe."""
    st = current()
    rows = []
    for name, group in groups.items():
        if group is None:
            continue
        _, ranks, facts = st.resolve(group)
        facts = engine_facts(st, facts)
        for op in policy.OPS:
            try:
                choice = st.decide(op, device_type, facts, nbytes, dtype)
                engine, reason = choice.engine, choice.reason
            except ValueError as exc:
                engine, reason = "error", str(exc)
            if device_type == "cuda" and op == "all_reduce" and engine != "local" \
                    and st.forced in (None, "cuda_ipc"):
                reason += " (cuda_ipc is probed at the group's first all_reduce)"
            rows.append({"group": name, "ranks": ranks, "op": op, "engine": engine,
                         "reason": reason})
    return rows


def route(name: str, t: torch.Tensor, group, op="sum") -> Route:
    """The route of one call; routes are cached per job, so a hot loop pays one dict lookup
    (the tensor and the op are checked only when a call misses the cache).

    The policy depends on bytes for CUDA (IPC buffer size, 16-byte multiple), so CUDA routes
    are keyed by size, and for CPU tensors only on ``policy.size_class`` (groups that span
    hosts: below ``HIER_MIN_BYTES``, below ``CROSS_ASYNC_MIN_BYTES``, above). Each new route
    logs its engine and the reason at debug level (``logging.getLogger("fastpar.comm")``).
    """
    st = current()
    try:
        cuda = t.is_cuda
        key = (id(group), name, op, t.dtype, t.layout, cuda, st.forced,
               t.numel() if cuda else policy.size_class(t.numel() * t.element_size()))
        found = st.routes.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable op
        key, found = None, None
    if found is not None:
        return found
    check_tensor(name, t)
    op = op_name(op)
    group, ranks, choice = choose(name, t, group, op)
    comm = st.communicator(adapter(choice.engine), group, ranks, t.device)
    log.debug("%s (%s, %s, %s) on global ranks %s -> %s: %s", name, op, t.dtype, t.device.type,
              ranks, choice.engine, choice.reason)
    found = Route(group, ranks, choice.engine, comm, op)
    if key is not None:
        if len(st.routes) >= 4096:  # CUDA keys carry sizes: varying shapes must not grow it
            st.routes.clear()
        st.routes[key] = found
    return found

"""``python -m fastpar info``: environment, native build and rank map.

    python -m fastpar info
    mpirun -np 4 python -m fastpar info --tp 2 --pp 2 [--json]
    torchrun --nproc-per-node 4 -m fastpar info --tp 2 --ep 2
    torchrun --nproc-per-node 4 -m fastpar info --cp 2

Like ``python -m torch.utils.collect_env``: the first command to run on a new machine. Under a
multi-rank launcher rank 0 prints for every rank; ``--json`` prints one JSON document from rank 0.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys

import torch
import torch.distributed as dist

import fastpar
from fastpar import _native
from fastpar.grid import validate_degrees
from fastpar.runtime import failures, hostid


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mpi_library(topo) -> str | None:
    """The MPI library behind mpi4py, asked only of a job MPI launched: importing ``mpi4py.MPI``
    runs ``MPI_Init``, which torchrun and single-process jobs must never need."""
    if topo.mpi_comm is None:
        return f"not loaded ({topo.launcher} launch)"
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


def versions(topo) -> dict:
    cuda = torch.version.cuda
    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    native = _native.status()
    return {
        "fastpar": fastpar.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl": nccl,
        "triton": _dist_version("triton"),
        "mpi4py": _dist_version("mpi4py"),
        "mpi_library": _mpi_library(topo),
        "native": "built (" + ("cpu+cuda" if native["cuda"] else "cpu") + ")"
                  if native["built"] else f"NOT BUILT: {native['error']}",
        "launcher": topo.launcher,
    }


def rank_entry(topo) -> dict:
    host = hostid.labels(topo.hosts)[topo.hosts[topo.rank]] if topo.hosts else \
        socket.gethostname()
    return {"rank": topo.rank, "host": host, "local_rank": topo.local_rank,
            "device": str(topo.device), "cpus": topo.cpus, "tp_rank": topo.tp_rank,
            "cp_rank": topo.cp_rank, "pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank,
            "ep_rank": topo.ep_rank, "edp_rank": topo.edp_rank}


ENGINE_TABLE_BYTES = 1 << 20  # the message size the engine table is shown for


def engine_table(topo) -> list[dict]:
    """The engine the policy picks for each collective on each of this rank's groups (float32,
    1 MiB, this rank's device), with the reason; creates no communicator. The ep and edp groups
    are listed when ep > 1, the cp and dpcp groups when cp > 1 (with 1 they are this rank alone
    and the dp ranks)."""
    from fastpar.comm import routing

    groups = {"world": dist.group.WORLD, "tp": topo.tp_group, "dp": topo.dp_group,
              "pp": topo.pp_group}
    if topo.ep_size > 1:
        groups.update(ep=topo.ep_group, edp=topo.edp_group)
    if topo.cp_size > 1:
        groups.update(cp=topo.cp_group, dpcp=topo.dpcp_group)
    return routing.engine_table(groups, topo.device.type, ENGINE_TABLE_BYTES)


def report(topo) -> dict | None:
    """The whole report on rank 0 (``None`` elsewhere); collective over the world."""
    entry = rank_entry(topo)
    entries = [None] * topo.world_size if topo.rank == 0 else None
    if topo.world_size > 1:
        dist.gather_object(entry, entries, dst=0)
    else:
        entries = [entry]
    if topo.rank != 0:
        return None
    return {"world_size": topo.world_size, "tp": topo.tp_size, "pp": topo.pp_size,
            "dp": topo.dp_size, "cp": topo.cp_size, "ep": topo.ep_size, "edp": topo.edp_size,
            "backend": topo.backend, "versions": versions(topo),
            "hosts": hosts(topo), "warnings": layout_warnings(topo),
            "ranks": entries, "engines": engine_table(topo), "gpu_engines": gpu_engines(),
            "dist_backend": dist_backend()}


def dist_backend() -> dict:
    """The torch.distributed backend "fastpar": whether it is registered, and what serves each
    operation (``fastpar.backend.OPERATIONS``)."""
    from fastpar import backend

    return {"registered": backend.registered(), "native": _native.available(),
            "operations": [{"op": op, "here": here, "else": other}
                           for op, here, other in backend.OPERATIONS]}


def hosts(topo) -> list[dict]:
    """Every host of the job with its ranks: ``{"host", "id", "ranks"}`` in rank order."""
    ids = topo.hosts or (hostid.host_id(),) * topo.world_size
    label = hostid.labels(ids)
    return [{"host": label[h], "id": h, "ranks": [r for r, x in enumerate(ids) if x == h]}
            for h in dict.fromkeys(ids)]


def layout_warnings(topo) -> list[str]:
    """What the layout does that it should not across hosts: a tp group that spans hosts (its
    collectives, on every layer, would cross the slowest link)."""
    if not topo.hosts or len(set(topo.hosts)) == 1:
        return []
    label = hostid.labels(topo.hosts)
    out = []
    for ranks in topo.grid.groups("tp"):
        where = list(dict.fromkeys(label[topo.hosts[r]] for r in ranks))
        if len(where) > 1:
            out.append(f"tp group {ranks} spans hosts {', '.join(where)}: its all-reduces cross "
                       "the link between them on every layer; launch ranks by host (consecutive "
                       "ranks on one host) with tp at most the ranks per host")
    return out


def gpu_engines() -> dict:
    """Whether our GPU engines would run on this machine, and why: cuda_ipc for groups of 2, 4
    and 8 ranks (``policy.ipc_limit``'s table), nccl_mpi's availability."""
    from fastpar.comm.engines import cuda_ipc, nccl_mpi

    return {"cuda_ipc": cuda_ipc.describe(), "nccl_mpi": nccl_mpi.unavailable() or "available"}


def format_report(rep: dict) -> str:
    lines = ["fastpar environment"]
    width = max(len(k) for k in rep["versions"])
    for key, value in rep["versions"].items():
        lines.append(f"  {key:<{width}}  {value if value is not None else '-'}")
    lines.append("")
    lines.append("GPU engines on this machine:")
    for line in rep["gpu_engines"]["cuda_ipc"]:
        lines.append(f"  cuda_ipc  {line}")
    lines.append(f"  nccl_mpi  {rep['gpu_engines']['nccl_mpi']}")
    lines.append("")
    db = rep["dist_backend"]
    state = ("registered" if db["registered"] else "NOT registered") + (
        "" if db["native"] else " (the extension fastpar._C did not load: it cannot run)")
    lines.append(f'torch.distributed backend "fastpar": {state}; init_process_group("fastpar") '
                 "(a group within one host, CPU tensors):")
    width = max(len(o["op"]) for o in db["operations"])
    for o in db["operations"]:
        lines.append(f"  {o['op']:<{width}}  {o['here']}; else {o['else']}")
    lines.append("")
    lines.append("hosts: " + "; ".join(f"{h['host']} (ranks {', '.join(map(str, h['ranks']))})"
                                       for h in rep["hosts"]))
    for warning in rep["warnings"]:
        lines.append(f"WARNING: {warning}")
    lines.append(f"rank map: world {rep['world_size']} = tp {rep['tp']} x cp {rep['cp']} x pp "
                 f"{rep['pp']} x dp {rep['dp']}, dp = ep {rep['ep']} x edp {rep['edp']}, "
                 f"backend {rep['backend']}")
    cols = ["rank", "host", "local_rank", "device", "tp_rank", "cp_rank", "pp_rank", "dp_rank",
            "ep_rank", "edp_rank", "cpus"]
    rows = [[str(r[c]) for c in cols] for r in rep["ranks"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)))
    lines.append("")
    lines.append(f"engines on rank 0's groups (float32, {ENGINE_TABLE_BYTES >> 20} MiB; "
                 "FASTPAR_COMM_BACKEND or comm.use_backend() force one):")
    cols = ["group", "ranks", "op", "engine", "reason"]
    rows = []
    for group in dict.fromkeys(r["group"] for r in rep["engines"]):
        mine = [r for r in rep["engines"] if r["group"] == group]
        if len({(r["engine"], r["reason"]) for r in mine}) == 1:  # one line when all ops agree
            mine = [{**mine[0], "op": "every op"}]
        rows += [[str(r[c]) for c in cols] for r in mine]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for row in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fastpar.runtime.cli import Parser

    parser = Parser(prog="python -m fastpar info", description=__doc__)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree, dividing dp (default 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree, dividing world / (tp x pp) (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (rank 0)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for all ranks (default 60)")
    args = parser.parse_args(argv)
    parser.check(min(args.tp, args.pp, args.ep, args.cp) >= 1,
                 f"--tp, --pp, --ep and --cp must be at least 1, got {args.tp}, {args.pp}, "
                 f"{args.ep} and {args.cp}")
    parser.check(args.timeout > 0, f"--timeout must be > 0 seconds, got {args.timeout}")
    world = parser.launched_world()
    if world is not None:
        try:  # the grid's own message, naming every factor
            validate_degrees(world, args.tp, args.pp, args.ep, args.cp)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        topo = fastpar.init(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                            timeout=args.timeout)
    except (ValueError, RuntimeError) as exc:
        if failures.speaks(exc):  # a failure every rank sees: rank 0 says it
            rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get(
                "OMPI_COMM_WORLD_RANK") or "0"
            print(f"fastpar info: error on rank {rank}: {exc}", file=sys.stderr)
        return 2
    try:
        rep = report(topo)
        if rep is not None:
            print(json.dumps(rep, indent=2) if args.json else format_report(rep), flush=True)
    finally:
        fastpar.shutdown()
    return 0

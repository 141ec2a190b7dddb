"""Which engine serves a collective: a plain function of (op, device, group facts, bytes, dtype).

No devices, processes or globals are touched here, so every decision is unit-tested as a table.

Engines:
  ``local``     group of one rank: no communication, no copy
  ``shm``       our C++ shared-memory collectives (CPU tensors, every member on one host)
  ``cuda_ipc``  our CUDA IPC all-reduce (CUDA tensors, one node, small/medium messages)
  ``nccl``/``gloo``  torch.distributed's engine for the device
  ``hier``      hierarchical, for a group that spans hosts with as many ranks on each (CPU):
                shm within each host, one engine across hosts (``comm/engines/hierarchical.py``)
  ``mpi``       the MPI library's own collective through mpi4py (CPU; unforced only for a group
                that spans hosts in an MPI-launched job: the flat engine there, and the cross-
                host stage of ``hier`` below CROSS_ASYNC_MIN_BYTES)
  ``nccl_mpi``  a raw NCCL communicator through CuPy, bootstrapped by MPI (CUDA; only when
                forced: for CUDA-graph capture and the overlap kernels' own streams)

``FASTPAR_COMM_BACKEND=<engine>`` forces one; a forced engine that cannot serve a call is an
error naming why, never a silent substitute.
"""

from __future__ import annotations

import dataclasses

import torch

ENGINES = ("shm", "cuda_ipc", "nccl", "gloo", "mpi", "nccl_mpi", "hier")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
REDUCE_OPS = ("all_reduce", "reduce_scatter")
BYTE_OPS_MPI = ("all_to_all",)  # the mpi engine moves these as bytes: any dtype
SHM_REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
IPC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MPI_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)
NCCL_MPI_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                   torch.int64, torch.uint8, torch.int8)


# --------------------------------------------------------------- cuda_ipc size limits

KiB, MiB = 1 << 10, 1 << 20
# Below this many bytes a group that spans hosts takes one flat call (MPI where the job was
# MPI-launched, else gloo) instead of the hierarchical engine's three stages. Measured on the
# cluster harness (2 hosts x 2 ranks on 2 cores, bench/collectives.py --backends hier,mpi,gloo,
# shaped and unshaped, three runs): hier beat flat MPICH from 4 KiB up (1.1-1.4x at 4 KiB,
# 1.5-1.7x at 16 KiB); below, a scalar's three calls and padding are overhead that a fast
# fabric's flat MPI call would not pay.
HIER_MIN_BYTES = 4 * KiB
# Where the flat call is MPI's (an MPI-launched job, a dtype MPI carries) the hierarchical
# engine pays from here: measured again on the cluster harness (2 hosts x 2 ranks, 1 Gbit/s,
# bench/collectives.py --backends hier,mpi -n 400, 2026-12-07): hier/mpi 0.59x at 4 KiB, 0.61x
# at 8 KiB, 0.76x at 16 KiB, 0.69x at 32 KiB, 1.02x at 64 KiB, 1.00x at 128 and 256 KiB.
# (Against flat gloo, hier wins from 4 KiB: 15x there.)
HIER_MIN_BYTES_MPI = 64 * KiB
# From this many bytes the hierarchical engine's cross-host stage runs on torch's engine in the
# background (pipelined with the host-local stages) instead of MPI's blocking call: 16 MiB
# all-reduce, 2 x 2 ranks, 1 Gbit/s links: 146 ms pipelined over gloo, 158-186 ms over MPI.
CROSS_ASYNC_MIN_BYTES = 4 * MiB
# cuda_ipc's largest message (also the size of its staging buffer) by compute capability and
# world size, on GPUs with NVLink between every pair. Source: vLLM's custom all-reduce,
# CUSTOM_ALL_REDUCE_MAX_SIZES in vllm/distributed/device_communicators/all_reduce_utils.py,
# where each entry is where its one-/two-shot IPC kernels stop beating NCCL (H100 = sm90,
# B200 = sm100; 2, 4, 6 and 8 GPUs). Our kernels are the same kind (one-shot, two-shot, flag
# barriers), so we start from those crossovers until bench/collectives.py measures our own on
# such machines. An odd world size takes the next even entry (the smaller limit).
IPC_MAX_BYTES = {
    (9, 0): {2: 64 * MiB, 4: 32 * MiB, 6: 512 * KiB, 8: 256 * KiB},
    (10, 0): {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
}
# Other architectures (sm80 A100, sm89): vLLM's default max_size of the custom all-reduce.
IPC_DEFAULT_MAX_BYTES = 8 * MiB
# More GPUs than this with PCIe P2P only: off. vLLM disables its custom all-reduce there (every
# rank reading every peer over a shared PCIe switch is slower than NCCL's ring).
IPC_PCIE_MAX_WORLD = 2
IPC_MIN_CAPABILITY = (8, 0)  # bf16 kernels; built for sm_80 and sm_90 (+ PTX for newer)
IPC_LINKS = ("nvlink", "pcie", "same_gpu", "none")


def ipc_limit(capability: tuple[int, int], world: int, link: str) -> tuple[int, str]:
    """``(max_bytes, reason)`` for a cuda_ipc communicator of ``world`` ranks on GPUs of
    ``capability`` joined by ``link``: "nvlink" (every pair), "pcie" (P2P, not every pair over
    NVLink), "same_gpu" (every rank on one GPU, FASTPAR_SHARED_GPU testing) or "none" (some
    pair has no P2P access). ``max_bytes == 0``: off, and the reason says why."""
    if link not in IPC_LINKS:
        raise ValueError(f"link must be one of {', '.join(IPC_LINKS)}, got {link!r}")
    if not 2 <= world <= 8:
        return 0, f"group of {world} ranks is outside 2..8"
    cap = tuple(capability)
    sm = f"sm{cap[0]}{cap[1]}"
    if cap < IPC_MIN_CAPABILITY:
        return 0, f"{sm} is older than sm80 (the kernels need bf16 and are built for sm80+)"
    if link == "none":
        return 0, "some pair of the group's GPUs has no P2P access"
    if link == "pcie" and world > IPC_PCIE_MAX_WORLD:
        return 0, (f"{world} GPUs joined by PCIe only: off above {IPC_PCIE_MAX_WORLD} "
                   "(as in vLLM; NCCL's ring is faster there)")
    where = {"nvlink": "NVLink between every pair", "pcie": "2 GPUs over PCIe P2P",
             "same_gpu": "every rank on one GPU (testing: measures the protocol, not a link)"}
    table = IPC_MAX_BYTES.get(cap)
    if table is None:
        return IPC_DEFAULT_MAX_BYTES, (f"{sm}, {world} ranks, {where[link]}: up to "
                                       f"{IPC_DEFAULT_MAX_BYTES >> 20} MiB (vLLM's default)")
    limit = table[world + world % 2]
    return limit, (f"{sm}, {world} ranks, {where[link]}: up to {_size(limit)} (vLLM's table "
                   f"for {sm} at {world + world % 2} GPUs)")


def _across_hosts(op: str, facts: GroupFacts, nbytes: int, dtype: torch.dtype,
                  reduce_op: str) -> Choice:
    """CPU tensors of a group that spans hosts: hierarchical from ``HIER_MIN_BYTES``, else (or
    where it cannot serve) one flat call on the cross-host engine. all_to_all is always flat:
    MPI where the job was MPI-launched (it carries any dtype as bytes), else torch's."""
    flat = cross_engine(facts, dtype)
    if op == "all_to_all":
        flat = "mpi" if facts.mpi else facts.pg_backend
    why = _hier_refusal(op, "cpu", facts, dtype, reduce_op)
    least = hier_min_bytes(facts, dtype)
    if why is None and nbytes >= least:
        hosts, per = len(facts.per_host), facts.per_host[0]
        return Choice("hier", f"{hosts} hosts x {per} ranks: shm within each host, "
                              f"{cross_engine(facts, dtype, nbytes)} across")
    if why is None:
        why = f"{nbytes} bytes is below {_size(least)} (one flat call is faster)"
    return Choice(flat, f"spans hosts, not hier: {why}")


def hier_min_bytes(facts: GroupFacts, dtype: torch.dtype) -> int:
    """The smallest call the hierarchical engine takes: where the flat call would be MPI's,
    ``HIER_MIN_BYTES_MPI``, else ``HIER_MIN_BYTES``."""
    return HIER_MIN_BYTES_MPI if facts.mpi and dtype in MPI_DTYPES else HIER_MIN_BYTES


def size_class(nbytes: int) -> int:
    """Which side of the policy's CPU size thresholds ``nbytes`` is on (0 to 3): the routes
    of CPU calls are cached per class, the choice and its reason being alike within one."""
    return ((nbytes >= HIER_MIN_BYTES) + (nbytes >= HIER_MIN_BYTES_MPI) +
            (nbytes >= CROSS_ASYNC_MIN_BYTES))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """What the policy needs to know about a group and the machine."""

    size: int  # ranks in the group
    same_host: bool  # every member on one host
    native: bool = True  # fastpar._C loaded (shm)
    ipc_ready: bool = False  # a CUDA IPC communicator exists for this group (probed)
    ipc_max_bytes: int = 0  # its registered buffer size (ipc_limit's max_bytes)
    pg_backend: str = "gloo"  # torch.distributed's backend for the group
    # why nccl_mpi cannot run here ("" when it can; asked only when it is forced)
    nccl_mpi: str = "not checked"
    per_host: tuple = ()  # the group's ranks on each host (hosts in order of first appearance)
    hier_ready: bool = False  # fastpar.init made the group's host sub-groups (runtime.groups)
    mpi: bool = False  # the job was launched by MPI (the mpi engine can serve it)


@dataclasses.dataclass(frozen=True)
class Choice:
    engine: str
    reason: str


def _shm_refusal(op: str, device: str, facts: GroupFacts, dtype: torch.dtype,
                 reduce_op: str) -> str | None:
    if device != "cpu":
        return f"the tensor is on {device}, shm serves CPU tensors"
    if not facts.same_host:
        return "the group spans hosts"
    return _kernel_refusal(op, facts, dtype, reduce_op)


def _kernel_refusal(op: str, facts: GroupFacts, dtype: torch.dtype, reduce_op: str) -> str | None:
    """What the shm kernels cannot do (the shm engine and hier's host-local stages alike)."""
    if not facts.native:
        return "the native extension fastpar._C is not loaded"
    if op in REDUCE_OPS and dtype not in SHM_REDUCE_DTYPES:
        return f"shm reduces float32/float64/bfloat16/float16, not {dtype}"
    if op in REDUCE_OPS and reduce_op not in ("sum", "max"):
        return f"shm reduces with sum or max, not {reduce_op}"
    return None


def _hier_refusal(op: str, device: str, facts: GroupFacts, dtype: torch.dtype,
                  reduce_op: str) -> str | None:
    if device != "cpu":
        return f"the tensor is on {device}; NCCL is hierarchical across nodes on its own"
    if facts.same_host:
        return "the group is on one host"
    if op == "broadcast":
        return "broadcast is flat (it sends every byte across hosts once either way)"
    if op == "all_to_all":
        return ("all_to_all is flat (each byte bound for another host crosses once either way; "
                "a flat call skips the host-local stages)")
    why = _kernel_refusal(op, facts, dtype, reduce_op)
    if why is not None:
        return why
    counts = " + ".join(map(str, facts.per_host))
    if len(set(facts.per_host)) > 1:
        return f"its hosts hold {counts} of its ranks (uneven)"
    if set(facts.per_host) == {1}:
        return "one of its ranks per host: nothing to share within a host"
    if not facts.hier_ready:
        return ("no host sub-groups for this group (fastpar.init makes them for the world and "
                "the grid's groups)")
    return None


def cross_engine(facts: GroupFacts, dtype: torch.dtype, nbytes: int = 0) -> str:
    """The flat engine that carries a spanning group's bytes between hosts: MPI where the job
    was MPI-launched and MPI carries the dtype (its latency is gloo's 1/30 here), up to
    ``CROSS_ASYNC_MIN_BYTES`` of message; from there, and without MPI, the group's torch
    backend, which runs in the background, so the hierarchical all-reduce overlaps one part's
    cross-host stage with the next part's host-local ones (``comm/engines/hierarchical.py``)."""
    if facts.mpi and dtype in MPI_DTYPES and nbytes < CROSS_ASYNC_MIN_BYTES:
        return "mpi"
    return facts.pg_backend


def _ipc_refusal(op: str, device: str, facts: GroupFacts, nbytes: int,
                 dtype: torch.dtype) -> str | None:
    if device != "cuda":
        return f"the tensor is on {device}, cuda_ipc serves CUDA tensors"
    if op != "all_reduce":
        return f"cuda_ipc implements all_reduce only, not {op}"
    if not facts.same_host:
        return "the group spans nodes"
    if not facts.ipc_ready:
        return "no CUDA IPC communicator for this group (peers lack P2P or the probe failed)"
    if dtype not in IPC_DTYPES:
        return f"cuda_ipc reduces float32/float16/bfloat16, not {dtype}"
    if nbytes % 16:
        return f"{nbytes} bytes is not a multiple of 16"
    if nbytes > facts.ipc_max_bytes:
        return (f"{nbytes} bytes exceeds the group's cuda_ipc limit of {facts.ipc_max_bytes} "
                "bytes (policy.ipc_limit)")
    return None


def _refusal(engine: str, op: str, device: str, facts: GroupFacts, nbytes: int,
             dtype: torch.dtype, reduce_op: str) -> str | None:
    if engine == "shm":
        return _shm_refusal(op, device, facts, dtype, reduce_op)
    if engine == "hier":
        return _hier_refusal(op, device, facts, dtype, reduce_op)
    if engine == "cuda_ipc":
        if reduce_op != "sum":
            return f"cuda_ipc reduces with sum only, not {reduce_op}"
        return _ipc_refusal(op, device, facts, nbytes, dtype)
    if engine == "nccl":
        return None if device == "cuda" else f"nccl needs CUDA tensors, got {device}"
    if engine == "gloo":
        return None if facts.pg_backend == "gloo" else (
            f"the group's torch.distributed backend is {facts.pg_backend}, not gloo")
    if engine == "nccl_mpi":
        if device != "cuda":
            return f"nccl_mpi needs CUDA tensors, got {device}"
        if op == "all_to_all":
            return "nccl_mpi has no all_to_all"
        if facts.nccl_mpi:
            return facts.nccl_mpi
        if dtype not in NCCL_MPI_DTYPES:
            return f"nccl_mpi cannot carry {dtype}"
        return None
    if engine == "mpi":
        if device != "cpu":
            return f"mpi serves CPU tensors, got {device}"
        if dtype not in MPI_DTYPES and op not in BYTE_OPS_MPI:
            return f"mpi (through numpy) cannot carry {dtype}"
        return None
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def forcing(engine: str, by: str) -> str:
    """How a forced engine is named in reasons and errors: ``FASTPAR_COMM_BACKEND=shm`` or
    ``comm.use_backend('shm')``."""
    return f"{by}={engine}" if by == "FASTPAR_COMM_BACKEND" else f"{by}({engine!r})"


# quant="int8" within one host (the shm engine) from this many bytes of the tensor passed: below
# it the codec's fixed costs take about what the quarter-size copies save. Measured, float32 vs
# int8 through the native kernels (bench/collectives.py --quant int8, 2 and 4 ranks on the
# 2-core machine while it was shared, load 17-21, so noisy): from 4 MiB int8 was faster in every
# op (1.2-2.1x; 1.6-2.2x at 16 MiB), below 1 MiB it went either way (0.07-1.9x).
QUANT_SHM_MIN_BYTES = 1 * MiB


def quantizes(op: str, engine: str, nbytes: int, dtype: torch.dtype, *, device: str = "cpu",
              same_host: bool, forced: str | None) -> tuple[bool, str]:
    """``(yes, reason)``: whether a ``quant=`` call (``op``: all_reduce, all_gather or
    reduce_scatter) on ``engine`` of ``nbytes`` (the tensor's full-precision bytes) of ``dtype``
    on ``device``, in a group that is all on one host (``same_host``) or not, is quantized.

    A forced engine always (it runs what it is asked). Otherwise, measured (2 hosts x 2 ranks
    at 1 Gbit/s, 16 MB, the native CPU codec), int8 over float32: all_gather 2.61x,
    reduce_scatter 4.61x, all_reduce 1.74x faster; over bfloat16: all_gather 1.85x,
    reduce_scatter 2.65x, but all_reduce 0.73x (its two quantizations cost more than the half of
    the bytes they save). So: across hosts every call but a bfloat16 all_reduce; within a host
    on the shm engine from QUANT_SHM_MIN_BYTES; CUDA tensors within a node (NCCL, CUDA IPC over
    NVLink or PCIe) not at all, as int8 is unmeasured there; other engines within a host (gloo
    without the native build) always."""
    if engine == "local":
        return False, "group of one rank: nothing crosses"
    if forced:
        return True, "int8 on the wire (the engine is forced: it runs what it is asked)"
    if device == "cuda" and same_host:
        return False, ("CUDA tensors within a node: int8 is unmeasured against NCCL and CUDA IPC "
                       "there, so full precision (force an engine to quantize)")
    if op == "all_reduce" and dtype == torch.bfloat16 and not same_host:
        return False, ("a bfloat16 all_reduce across hosts: int8 measured 0.73x bfloat16's speed "
                       "(2 hosts x 2 ranks, 1 Gbit/s, 16 MB; its two quantizations cost more than "
                       "the half of the bytes they save): full precision")
    if engine == "shm" and nbytes < QUANT_SHM_MIN_BYTES:
        return False, (f"within a host below {QUANT_SHM_MIN_BYTES // MiB} MiB int8 costs about "
                       f"what it saves: full precision")
    return True, "int8 on the wire"


def choose(op: str, device: str, facts: GroupFacts, nbytes: int, dtype: torch.dtype, *,
           reduce_op: str = "sum", forced: str | None = None,
           forced_by: str = "FASTPAR_COMM_BACKEND") -> Choice:
    """The engine for one call. ``device`` is a device type ("cpu", "cuda"). ``forced``: the
    engine forced by ``forced_by`` (the environment variable, or ``comm.use_backend``)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
    if facts.size == 1:
        return Choice("local", "group of one rank")
    if forced:
        why = _refusal(forced, op, device, facts, nbytes, dtype, reduce_op)
        if why is not None:
            raise ValueError(f"{forcing(forced, forced_by)} cannot serve {op} of {nbytes} "
                             f"bytes of {dtype} on {device}: {why}")
        return Choice(forced, f"forced by {forcing(forced, forced_by)}")
    if device == "cpu":
        why = _shm_refusal(op, device, facts, dtype, reduce_op)
        if why is None:
            return Choice("shm", "CPU tensors on one host")
        if facts.same_host:
            return Choice(facts.pg_backend, f"not shm: {why}")
        return _across_hosts(op, facts, nbytes, dtype, reduce_op)
    if device == "cuda":
        why = _refusal("cuda_ipc", op, device, facts, nbytes, dtype, reduce_op)
        if why is None:
            return Choice("cuda_ipc", "small CUDA all_reduce within one node")
        return Choice("nccl" if facts.pg_backend == "nccl" else facts.pg_backend,
                      f"not cuda_ipc: {why}")
    return Choice(facts.pg_backend, f"device type {device}")

"""A group's fastpar backend, made by torch.distributed when a group of backend ``"fastpar"`` is
created (``init_process_group``, ``new_group``, ``init_device_mesh``): collective over the
group's ranks, on its store.

1. A gloo backend on the group's store (under the prefix ``gloo/``) serves what fastpar's kernels
   do not; on a CUDA build an NCCL one (prefix ``nccl/``) serves CUDA tensors.
2. The ranks exchange their host identities (``runtime.hostid``) through the store. Where all
   share a host, the group's shm segment is made and mapped at its first call the kernels
   serve (``comm/engines/segments.py``'s protocol, its two steps over the group's own gloo): a
   group that never needs it costs no shared memory.
3. A group that spans hosts with as many ranks on each gets its host sub-groups too
   (``_host_split``): its all-reduces, all_gather_into_tensor and reduce_scatter_tensor from
   ``policy.HIER_MIN_BYTES`` go through each host's kernels and across the hosts on gloo, the
   hierarchical engine's stages. In a job launched by MPI, MPI's own collectives (``mpi.py``)
   take what fastpar.comm's policy gives them: the flat calls of the dtypes MPI carries (the
   hierarchy starts at ``policy.HIER_MIN_BYTES_MPI`` for those), every broadcast and
   all-to-all, and the hierarchy's cross-host stage.
4. On a CUDA build, a group on one host gets the CUDA IPC all-reduce's maker too
   (``cuda.py``): its CUDA all-reduces within the size limit take fastpar's kernels, the rest
   NCCL.
5. The extension's backend takes them all and decides per call (``csrc/c10d_backend.cpp``).

torch.distributed calls the creator once per device the backend serves (on a CUDA build: cpu
and cuda, each a backend of its own that dispatches by tensor device; one serves each device).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.backend import mpi
from fastpar.backend.cuda import ipc_maker
from fastpar.comm.engines.segments import BackendExchange, StoreExchange
from fastpar.comm.engines.shm import ShmCommunicator
from fastpar.comm.policy import CROSS_ASYNC_MIN_BYTES, HIER_MIN_BYTES, HIER_MIN_BYTES_MPI
from fastpar.runtime.hostid import host_id

log = logging.getLogger("fastpar.backend")

def create(options, backend_options=None):
    """torch.distributed's creator (extended API): ``options`` carries the group's store
    (prefixed per device by torch), rank, size, timeout, id and global ranks."""
    return _make(options)


def _make(options):
    _native.require('the torch.distributed backend "fastpar"')
    from fastpar import _C

    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout
    ranks = list(options.global_ranks_in_group) or list(range(size))
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        nccl.global_ranks_in_group = ranks
        nccl.group_name = f"{options.group_id}/nccl"
        cuda = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, nccl)
    exchange = StoreExchange(dist.PrefixStore("fastpar/", store), rank, size,
                             timeout.total_seconds())
    hosts = exchange.all_gather_object(host_id())
    seconds = timeout.total_seconds()
    maker, hier, ipc = None, {}, None
    if size > 1 and len(set(hosts)) == 1:
        def maker():  # at the group's first call the kernels serve (collective over it)
            # over the group's own gloo: a store's client serves one request at a time, so
            # groups set up from several threads at once would wait on each other's keys
            shm = ShmCommunicator(BackendExchange(cpu, size), ranks, ranks[rank], seconds)
            return shm._comm, shm

        if cuda is not None and _native.status()["cuda"]:
            ipc = ipc_maker(cpu, ranks, rank, seconds)
    elif size > 1:
        # In a job launched by MPI, MPI's own calls where fastpar.comm's policy takes them.
        members = mpi.usable(exchange, os.environ)
        hier = _host_split(store, rank, ranks, hosts, timeout, members, options.group_id)
        if members is not None:
            hier["mpi_calls"] = mpi.MpiCalls(members, f"{options.group_id}/flat")
        log.info("fastpar backend: the group of global ranks %s spans %d hosts: %s", ranks,
                 len(set(hosts)), _spanning(hier))
    return _C.make_backend(rank, size, cpu, cuda, maker, seconds, ipc_maker=ipc, **hier)


def _host_split(store, rank: int, ranks: list[int], hosts: list, timeout,
                mpi_ranks: list[int] | None, group_id) -> dict:
    """A spanning group's host sub-groups, where every host has the same number (>= 2) of its
    ranks: a gloo backend across the hosts among the ranks of this one's local index (and, in
    a job launched by MPI, ``mpi_ranks`` being every member's MPI world rank, their MPI calls),
    and the maker of this host's shm communicator (over a gloo of the host's ranks): the
    hierarchical all-reduce's, all-gather's and reduce-scatter's pieces
    (``csrc/c10d_hier.cpp``). Collective over the group (each rank makes its host's and its
    index's gloo, on prefixes of the group's store); ``{}`` where the hosts differ in size."""
    order = list(dict.fromkeys(hosts))
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    local = members[hosts[rank]]
    if len(local) < 2 or any(len(m) != len(local) for m in members.values()):
        return {}
    host, index = order.index(hosts[rank]), local.index(rank)
    intra = dist.ProcessGroupGloo(dist.PrefixStore(f"intra{host}/", store), index, len(local),
                                  timeout)
    cross = dist.ProcessGroupGloo(dist.PrefixStore(f"cross{index}/", store), host, len(order),
                                  timeout)

    def intra_maker():
        shm = ShmCommunicator(BackendExchange(intra, len(local)), [ranks[r] for r in local],
                              ranks[rank], timeout.total_seconds())
        return shm._comm, shm

    split = {"cross": cross, "intra_maker": intra_maker, "local_size": len(local),
             "hier_min_bytes": HIER_MIN_BYTES, "hier_place": placement(hosts)}
    if mpi_ranks is not None:
        across = [mpi_ranks[members[h][index]] for h in order]
        split.update(cross_mpi=mpi.MpiCalls(across, f"{group_id}/cross{index}"),
                     mpi_min_bytes=HIER_MIN_BYTES_MPI, cross_mpi_max_bytes=CROSS_ASYNC_MIN_BYTES)
    return split


def placement(hosts: list) -> list[int]:
    """Where each group rank's block lands among the blocks the hierarchy gathers, ordered
    [local index][host] (hosts in order of first appearance): ``j * hosts + h`` for the rank
    of local index ``j`` on host ``h``. ``hosts``: each group rank's host."""
    order = list(dict.fromkeys(hosts))
    members = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    return [members[h].index(r) * len(order) + order.index(h) for r, h in enumerate(hosts)]


def _spanning(made: dict) -> str:
    """What serves a spanning group's calls, for the log."""
    how = ["all_reduce, all_gather_into_tensor and reduce_scatter_tensor through each host's "
           "kernels from %d bytes (%d of MPI's dtypes)" % (
               HIER_MIN_BYTES, made.get("mpi_min_bytes", HIER_MIN_BYTES))
           if "cross" in made else "no hierarchy (unequal ranks per host, or one per host)"]
    if "mpi_calls" in made:
        how.append("the flat calls MPI carries on MPI (mpirun)")
    return ", ".join(how) + ", the rest on gloo"


def served(group, device: str) -> dict:
    pg = dist.group.WORLD if group is None else group
    _native.require('the torch.distributed backend "fastpar"')
    from fastpar import _C

    return _C.backend_served(pg._get_backend(torch.device(device)))

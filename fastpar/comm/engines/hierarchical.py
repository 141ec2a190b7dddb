"""The hierarchical engine: collectives of a group that spans hosts with as many ranks on each.

Only the bytes that must cross a host do. A group of H hosts x L ranks (group index g; the rank
with host index h and local index i) is cut by ``fastpar.init`` into an *intra* group per host
(shm, our kernels) and a *cross* group per local index (the same i on every host; MPI or the
torch backend, ``policy.cross_engine``)::

    all_reduce(t)       t -> shm reduce_scatter within the host -> piece i (|t| / L)
                        piece i -> all_reduce across hosts (cross group i)
                        shm all_gather within the host -> t
    reduce_scatter(x)   x's G blocks reordered [i][h] -> shm reduce_scatter within the host ->
                        H blocks (those of local index i) -> reduce_scatter across hosts -> g's
    all_gather(x)       all_gather across hosts (H blocks of local index i) -> shm all_gather
                        within the host -> G blocks in [i][h] order -> reordered to group order

For 2 hosts an all-reduce of S bytes puts S on each direction of the link between them (each of
the L ranks sends and receives S / L), where a flat ring over the 2L ranks puts S (2L - 1) / L.
Reductions: the shm kernels reduce within a host (float32 accumulation for 16-bit dtypes), the
cross engine across hosts in the tensor's dtype. Every call is synchronous (complete on return).
"""

from __future__ import annotations

import collections

import torch

from fastpar.comm import policy, quantized
from fastpar.comm.engines.base import Native
from fastpar.comm.engines.mpi import Mpi
from fastpar.comm.engines.shm import Shm
from fastpar.comm.engines.torch_dist import Torch
from fastpar.runtime.groups import cross_ranks

# An all_reduce whose cross-host stage runs on torch's engine (in the background: from
# policy.CROSS_ASYNC_MIN_BYTES under MPI, always otherwise) is cut in this many parts from
# PIPELINE_MIN_BYTES, so that the host-local stages of one part overlap the cross-host stage of
# another (16 MiB, 2 x 2 ranks, 1 Gbit/s: 146 ms in 4 parts, 157-166 ms in one).
PIPELINE_MIN_BYTES = policy.CROSS_ASYNC_MIN_BYTES
PIPELINE_PIECES = 4

# What an engine adapter reads of a route: the group, its global ranks, the communicator.
_Leg = collections.namedtuple("_Leg", "group ranks comm")


class HierCommunicator:
    """The hierarchical collectives of one group; built at its first call (see ``CommState``)
    from the group's ``HostSplit`` (``runtime.groups``): the intra-host shm communicator is
    made then (collective over the host's members), the cross-host engine at its first use."""

    def __init__(self, state, split, ranks: list[int], facts: policy.GroupFacts):
        self._state, self._facts = state, facts
        self.hosts, self.local = len(split.members), len(split.members[0])
        index = {r: g for g, r in enumerate(ranks)}
        # group index of the block at position (i, p) of the intra-host stage's [i][p] order:
        # local index i, then position p in the cross group of i (its ranks sorted, so the
        # hosts may come in another order for each i)
        order = [index[r] for i in range(self.local) for r in cross_ranks(split.members, i)]
        self._order = None if order == list(range(len(order))) else torch.tensor(order)
        self.intra = state.communicator(Shm, split.intra, split.intra_ranks, None)
        self._cross = (split.cross, split.cross_ranks)
        self._legs: dict = {}  # cross engine -> _Leg

    def cross_engine(self, dtype: torch.dtype, nbytes: int) -> str:
        return policy.cross_engine(self._facts, dtype, nbytes)

    def _leg(self, dtype: torch.dtype, nbytes: int):
        """The adapter and route of the cross-host stage of a message of ``nbytes``."""
        engine = Mpi if self.cross_engine(dtype, nbytes) == "mpi" else Torch
        if engine not in self._legs:
            group, ranks = self._cross
            comm = self._state.communicator(engine, group, ranks, torch.device("cpu"))
            self._legs[engine] = _Leg(group, ranks, comm)
        return engine, self._legs[engine]

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        flat = t.view(-1)
        n, per = flat.numel(), -(-t.numel() // self.local)
        work = flat
        if n % self.local:  # the shm stages split into L equal pieces: pad with zeros
            work = torch.zeros(per * self.local, dtype=t.dtype)
            work[:n] = flat
        if n == 0:
            return
        engine, leg = self._leg(t.dtype, work.nbytes)
        # Where the cross engine runs in the background (torch's), large messages go in
        # PIPELINE_PIECES parts: part k's cross-host all-reduce is in flight while part k+1 is
        # reduced within the host.
        parts = PIPELINE_PIECES if engine is not Mpi and work.nbytes >= PIPELINE_MIN_BYTES else 1
        step = -(-per // parts) * self.local
        pending = []
        try:
            for start in range(0, work.numel(), step):
                part = work[start:start + step]
                piece = torch.empty(part.numel() // self.local, dtype=t.dtype)
                self.intra.reduce_scatter(part, piece, op)  # the host's sum of piece i
                pending.append([part, piece, engine.all_reduce(leg, piece, op, parts > 1)])
            for entry in pending:
                part, piece, inflight = entry
                if inflight is not None:
                    inflight.wait()  # ... and every host's
                    entry[2] = None
                self.intra.all_gather(piece, part)
        except BaseException:
            # A part failed (a dead peer, a timeout): no cross-host call of this one stays in
            # flight behind the error (its buffers would be freed under it).
            for _, _, inflight in pending:
                if inflight is not None:
                    try:
                        inflight.wait()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
            raise
        if work is not flat:
            flat.copy_(work[:n])

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: str) -> None:
        blocks = inp.view(self.hosts * self.local, -1)  # (G, block)
        if self._order is not None:
            blocks = blocks.index_select(0, self._order)  # [i][h]: local index i's in a row
        pieces = torch.empty((self.hosts, blocks.shape[1]), dtype=inp.dtype)
        self.intra.reduce_scatter(blocks.reshape(-1), pieces.view(-1), op)
        engine, leg = self._leg(inp.dtype, inp.nbytes)
        engine.reduce_scatter(leg, pieces.view(-1), out.view(-1), op, False)

    def all_gather(self, inp: torch.Tensor, stacked: torch.Tensor) -> None:
        """``stacked`` = every rank's ``inp`` in group order; ``inp`` may be a block of
        ``stacked`` (it is read before ``stacked`` is written)."""
        flat = inp.reshape(-1)
        pieces = torch.empty(self.hosts * flat.numel(), dtype=inp.dtype)
        engine, leg = self._leg(inp.dtype, stacked.nbytes)
        engine.all_gather(leg, flat, pieces, False)  # local index i's blocks of every host
        self._gather_within(pieces, stacked)

    # ---- quantized (quant=): full precision within a host, int8 across ----------------------
    # The shm stages stay full precision: within a host the bytes move through memory at
    # memory speed, so int8 there would save little and cost a quantization pass; across hosts
    # the link is the bottleneck and only int8 crosses it (``fastpar.comm.quantized`` on the
    # cross group). Error feedback: the residual is added to the input in float32 (what a
    # bfloat16 input cannot hold of that sum stays in it), and the cross stage's rounding is
    # added at the elements of the piece this rank carried across, which only this rank of the
    # host carries, so the next call's intra-host sum brings it back once.

    def _cross_route(self, dtype: torch.dtype, nbytes: int):
        engine, leg = self._leg(dtype, nbytes)
        return _CrossRoute(leg.group, leg.ranks, engine, leg.comm)

    def quantized_all_reduce(self, t: torch.Tensor, spec, residual) -> None:
        flat = t.view(-1)
        n = flat.numel()
        if n == 0:
            return
        per = -(-n // self.local)
        work = torch.zeros(per * self.local, dtype=t.dtype)
        if residual is not None:  # the carried error joins the host's sum, added in float32;
            # what t's dtype cannot hold of it stays in the residual (bf16's rounding)
            quantized.fold_residual(flat, residual.view(-1), work[:n])
        else:
            work[:n] = flat
        piece = torch.empty(per, dtype=t.dtype)
        self.intra.reduce_scatter(work, piece, "sum")
        carried = torch.zeros(per, dtype=torch.float32) if residual is not None else None
        quantized.all_reduce(self._cross_route(t.dtype, piece.nbytes), piece, spec, carried)
        if residual is not None:  # plus the cross stage's rounding of the piece this rank sent
            i = self.intra.group_rank
            lo, hi = i * per, min((i + 1) * per, n)
            if hi > lo:
                residual.view(-1)[lo:hi] += carried[:hi - lo]
        self.intra.all_gather(piece, work)
        flat.copy_(work[:n])

    def quantized_reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, spec,
                                 residual) -> None:
        groups = self.hosts * self.local
        src = inp
        if residual is not None:  # added in float32; bf16's rounding of it stays carried
            src = quantized.fold_residual(inp, residual, torch.empty_like(inp))
        blocks = src.view(groups, -1)
        if self._order is not None:
            blocks = blocks.index_select(0, self._order)
        pieces = torch.empty((self.hosts, blocks.shape[1]), dtype=inp.dtype)
        self.intra.reduce_scatter(blocks.reshape(-1), pieces.view(-1), "sum")
        carried = torch.zeros(pieces.shape, dtype=torch.float32) if residual is not None \
            else None
        route = self._cross_route(inp.dtype, pieces.nbytes)
        quantized.reduce_scatter(route, pieces.view(-1), out.view(-1), spec, carried, False)
        if residual is not None:  # rows of pieces: the blocks [i][h] of local index i
            i = self.intra.group_rank
            rows = torch.arange(i * self.hosts, (i + 1) * self.hosts)
            if self._order is not None:
                rows = self._order[rows]
            residual.view(groups, -1).index_add_(0, rows, carried)

    def _gather_within(self, pieces: torch.Tensor, stacked: torch.Tensor) -> None:
        """all_gather's host-local stage: every host's blocks of each local index (``pieces``)
        gathered over the host into ``stacked``, in group order."""
        blocks = stacked.view(self.hosts * self.local, -1)
        if self._order is None:
            self.intra.all_gather(pieces, blocks.view(-1))
            return
        arranged = torch.empty_like(blocks)
        self.intra.all_gather(pieces, arranged.view(-1))
        blocks.index_copy_(0, self._order, arranged)

    def quantized_all_gather(self, inp: torch.Tensor, stacked: torch.Tensor, spec) -> None:
        flat = inp.reshape(-1).contiguous()
        pieces = torch.empty(self.hosts * flat.numel(), dtype=inp.dtype)
        route = self._cross_route(inp.dtype, stacked.nbytes)
        pending = quantized.all_gather(route, flat, pieces, spec, False)
        assert pending is None
        self._gather_within(pieces, stacked)


class _CrossRoute:
    """What ``fastpar.comm.quantized`` reads of a route, for the cross-host stage."""

    __slots__ = ("group", "ranks", "adapter", "comm")

    def __init__(self, group, ranks, adapter, comm):
        self.group, self.ranks, self.adapter, self.comm = group, ranks, adapter, comm


class Hier(Native):
    """Hierarchical across hosts (``HierCommunicator``): shm within a host, a flat engine
    between hosts; its quantized calls quantize only the cross-host stage."""

    name = "hier"

    @staticmethod
    def make(state, group, ranks, device):
        _, _, facts = state.resolve(group)
        return HierCommunicator(state, state.topo.host_splits[group.group_name], ranks, facts)

    @staticmethod
    def quantized_all_reduce(route, t, spec, residual) -> None:
        route.comm.quantized_all_reduce(t, spec, residual)

    @staticmethod
    def quantized_reduce_scatter(route, inp, out, spec, residual, async_op):
        route.comm.quantized_reduce_scatter(inp, out, spec, residual)
        return None

    @staticmethod
    def quantized_all_gather(route, t, out, spec, async_op):
        route.comm.quantized_all_gather(t, out, spec)
        return None


"""The shm engine's communicator: owns one segment per group and carries out its collectives by
calling the kernels. Which calls come here is the engine policy's decision (``policy.py``).

The segment lives in ``/dev/shm`` under a name unique to the job (a random token chosen by the
group's first rank and broadcast over the group), mode 0600. It is unlinked as soon as every
member has mapped it, so a crash of any rank afterwards leaks nothing: the memory goes when the
last mapping does. Kernel protocol: ``csrc/shm/README.md``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import threading

import torch

from fastpar import _native
from fastpar.comm import symmetric
from fastpar.comm.engines import dtypes
from fastpar.comm.engines.base import Native
from fastpar.comm.engines.native_errors import Kind, ShmError, shm_error
from fastpar.comm.engines.segments import map_segments

log = logging.getLogger("fastpar.comm")

SLOT_BYTES = 4 << 20  # per rank; larger messages are chunked by the kernel
# The dtype/shape signature that byte-moving calls (all_gather, broadcast) pass to the kernel,
# so ranks that disagree on what the bytes are fail as ranks that disagree on their number do:
# bits 56-63 the dtype (index + 1 here), 48-55 the number of dims, 0-47 a hash of the shape.
_SIG = re.compile(r" \[sig 0x([0-9a-f]{16})\]")


def host_oversubscribed() -> bool | None:
    """Whether this host's ranks outnumber the CPUs they may run on (``Topology.oversubscribed``;
    None outside a fastpar job): then the kernels' waits hand their core over soon, since the
    peer they wait for, or another rank of the host, may need it."""
    from fastpar.runtime import is_initialized, topology

    return topology().oversubscribed if is_initialized() else None


def signature(t: torch.Tensor) -> int:
    code = dtypes.CODE.get(t.dtype, 255)
    return (code << 56) | (min(t.dim(), 255) << 48) | (hash(t.shape) & (1 << 48) - 1)


def _describe(sig: int, mine: dict, symmetric: bool = False) -> str:
    """A signature in words; this rank's own ones with their shapes. ``symmetric``: the
    signature of a symmetric call, whose hash covers which symmetric memory too."""
    if sig in mine:
        return f" of {mine[sig]}"
    code, ndim = sig >> 56, (sig >> 48) & 0xFF
    dtype = str(dtypes.DTYPES[code - 1]).removeprefix("torch.") if 1 <= code <= len(
        dtypes.DTYPES) else "another dtype"
    if symmetric:
        return (f" of {dtype} with {ndim} dims in other symmetric memory (another symmetric "
                f"tensor, or another part of it; hash {sig & (1 << 48) - 1:012x})")
    return f" of {dtype} with {ndim} dims (shape hash {sig & (1 << 48) - 1:012x})"


def raise_after_kernel(error: ShmError) -> None:
    """Raise a kernel call's ``error``; when the kernel ended this very wait because it took a
    pending SIGINT (kind ``INTERRUPTED``; a segment poisoned by an earlier interrupt is not),
    let the program's own SIGINT handler run instead (by default a KeyboardInterrupt carrying
    the error's text)."""
    if error.kind == Kind.INTERRUPTED:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise KeyboardInterrupt(str(error))
        signal.raise_signal(signal.SIGINT)
    raise error


# Below these sizes the copying shm kernels' single round beats the symmetric kernels' entry and
# exit signals (measured: 2 and 4 ranks on 2 cores, bench/collectives.py --symmetric; the
# signals cost most when ranks share cores), so symmetric tensors that small take the copying
# kernels, which work on any memory. Bytes of the tensor passed (all_gather: per rank).
SYMMETRIC_ALL_REDUCE_MIN = 16 << 10
SYMMETRIC_GATHER_MIN = 64 << 10
SYMMETRIC_SCATTER_MIN = 256 << 10
SYMMETRIC_ALL_TO_ALL_MIN = 64 << 10  # the input's bytes (alltoall.py); the copying kernel's
# single copy (process_vm_readv) starts at 64 KiB per pair too


class ShmCommunicator:
    """Collectives of one group whose members share a host.

    Construction is collective over ``group`` (``ranks`` are its global ranks, in group order).
    One call at a time: the ranks of a group must issue its collectives in the same order, which
    two threads of one rank cannot promise, so a call made while another thread is inside one
    on the same communicator raises at once (different groups may run in different threads).
    """

    def __init__(self, group, ranks: list[int], rank: int, timeout: float,
                 slot_bytes: int = SLOT_BYTES):
        _native.require("the shm backend")
        self.ranks = list(ranks)
        self.world = len(ranks)
        self.group_rank = self.ranks.index(rank)
        self.slot_bytes = slot_bytes
        self._ops = torch.ops.fastpar
        nbytes = self._ops.shm_segment_bytes(self.world, slot_bytes)

        def init(_, mapping):  # the owner lays the segment out before anyone attaches
            anchor = ctypes.c_char.from_buffer(mapping)
            self._ops.shm_init_segment(ctypes.addressof(anchor), self.world, slot_bytes)
            del anchor

        self._mmap = map_segments(
            group, rank, {"all": (self.ranks[0], self.ranks)}, nbytes,
            f"fastpar shm: setting up the shared segment of the group of global ranks "
            f"{self.ranks}", init=init)["all"]
        self._anchor = ctypes.c_char.from_buffer(self._mmap)  # keeps the address valid
        base = ctypes.addressof(self._anchor)
        oversubscribed = host_oversubscribed()
        if oversubscribed is None:  # outside a job: the group's ranks against this one's CPUs
            oversubscribed = self.world > len(os.sched_getaffinity(0))
        self._comm = self._ops.shm_attach(base, self.group_rank, self.world, slot_bytes,
                                          float(timeout), oversubscribed)
        self._busy = threading.Lock()
        # Bound overloads: skips the op-packet lookup on every call (~1 us of a ~3 us call).
        self._all_reduce = self._ops.shm_all_reduce.default
        self._all_reduce_symmetric = self._ops.shm_all_reduce_symmetric.default
        self._all_gather = self._ops.shm_all_gather.default
        self._all_gather_symmetric = self._ops.shm_all_gather_symmetric.default
        self._all_to_all_symmetric = self._ops.shm_all_to_all_symmetric.default
        self._all_gather_from_symmetric = self._ops.shm_all_gather_from_symmetric.default
        self._reduce_scatter_symmetric = self._ops.shm_reduce_scatter_symmetric.default
        self._reduce_scatter = self._ops.shm_reduce_scatter.default
        self._broadcast = self._ops.shm_broadcast.default
        self._quantized_all_gather = self._ops.shm_quantized_all_gather.default
        self._quantized_reduce_scatter = self._ops.shm_quantized_reduce_scatter.default
        self._quantized_all_reduce = self._ops.shm_quantized_all_reduce.default
        self._all_to_all = self._ops.shm_all_to_all.default

    def _failed(self, exc: RuntimeError, t: torch.Tensor | None = None,
                said: dict | None = None) -> ShmError:
        """The kernel numbers ranks within the group; name the global ranks where they differ,
        and the dtypes and shapes behind signatures (``t``: this rank's tensor; ``said``: what
        other signatures of this rank are, ``{sig: words}``). Call it right after catching
        ``exc``: it reads the error's kind (``native_errors``)."""
        def globalise(m):
            k = int(m.group(1))
            if k >= self.world or self.ranks[k] == k:
                return m.group(0)
            return f"rank {k} (global rank {self.ranks[k]})"

        mine = dict(said or {})
        if t is not None:
            mine[signature(t)] = f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
        text = _SIG.sub(lambda m: _describe(int(m.group(1), 16), mine, said is not None),
                        str(exc))
        text = re.sub(r"\brank (\d+)", globalise, text)
        return shm_error(f"{text} [shm group of global ranks {self.ranks}; after an error "
                         "the group's segment is unusable and later calls on it fail too]")

    def _call(self, name: str, kernel, *args, t: torch.Tensor | None = None,
              said: dict | None = None) -> None:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"fastpar shm: {name} on the group of global ranks {self.ranks} was called "
                f"while another thread of this rank is inside a collective on the same group; "
                f"a group's collectives must be issued one at a time, in the same order on "
                f"every rank (use one thread per group, or a group per thread)")
        try:
            kernel(self._comm, *args)
            return
        except RuntimeError as exc:
            error = self._failed(exc, t, said)
        finally:
            self._busy.release()
        raise_after_kernel(error)

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        self._call("all_reduce", self._all_reduce, t, op)

    def all_reduce_symmetric(self, t: torch.Tensor, at, op: str) -> None:
        """``t`` lies in a symmetric segment of this group; ``at`` (``symmetric_registry.Placement``):
        every rank's address of it in this process and its signature. No copy in or out."""
        self._call("all_reduce", self._all_reduce_symmetric, t, at.slots, op, at.sig,
                   said=at.describe(t))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        self._call("all_gather", self._all_gather, inp, out, signature(inp), t=inp)

    def all_gather_symmetric(self, out: torch.Tensor, at) -> None:
        """``out``: ``world`` blocks in a symmetric segment, this rank's block filled."""
        self._call("all_gather", self._all_gather_symmetric, out, at.slots, at.sig,
                   said=at.describe(out))

    def all_gather_from_symmetric(self, inp: torch.Tensor, at, out: torch.Tensor) -> None:
        """``inp``: this rank's source in a symmetric segment (``at``: every rank's); ``out``:
        a plain tensor of ``world`` blocks that every rank fills from the sources in place."""
        self._call("all_gather", self._all_gather_from_symmetric, inp, at.slots, out, at.sig,
                   said=at.describe(inp))

    def all_to_all_symmetric(self, inp: torch.Tensor, at, out: torch.Tensor) -> None:
        """Equal splits; ``inp``: ``world`` blocks in a symmetric segment, read by the peers
        where it lies (no copy in); ``out``: a plain tensor of its shape."""
        self._call("all_to_all", self._all_to_all_symmetric, inp, at.slots, out, at.sig,
                   said=at.describe(inp))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: str) -> None:
        self._call("reduce_scatter", self._reduce_scatter, inp, out, op)

    def reduce_scatter_symmetric(self, inp: torch.Tensor, at, out: torch.Tensor,
                                 op: str) -> None:
        """``inp``: ``world`` blocks in a symmetric segment; no copy in."""
        self._call("reduce_scatter", self._reduce_scatter_symmetric, inp, at.slots, out, op,
                   at.sig, said=at.describe(inp))

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._call("broadcast", self._broadcast, t, root, signature(t), t=t)

    # ---- int8 (quant=): fastpar.comm.quant's codec inside the kernels' copy loops -----------
    # A rank quantizes its input while copying it into its slot and its peers dequantize while
    # copying out, summing in float32 in rank order; bitwise fastpar.comm.quantized's results.

    def quantizes(self, block: int) -> bool:
        """Whether a round of the int8 sums, one block per rank, fits half a slot (a block of
        64K elements at 32 ranks and more does not: fastpar.comm.quantized then moves bytes)."""
        return self.world * (4 + block) + 64 * self.world <= self.slot_bytes // 2

    def quantized_all_gather(self, inp: torch.Tensor, out: torch.Tensor, spec) -> None:
        """out (world x inp's elements, contiguous) = every rank's inp through the codec."""
        self._call("all_gather (int8)", self._quantized_all_gather, inp, out, spec.block)

    def quantized_reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, spec,
                                 residual: torch.Tensor | None) -> None:
        self._call("reduce_scatter (int8)", self._quantized_reduce_scatter, inp, out,
                   spec.block, residual)

    def quantized_all_reduce(self, t: torch.Tensor, spec, residual: torch.Tensor | None) -> None:
        self._call("all_reduce (int8)", self._quantized_all_reduce, t, spec.block, residual)

    def all_to_all(self, inp: torch.Tensor, send: list[int], recv: list[int] | None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``inp`` (dim 0), ``send[p]`` for rank p, to every rank; returns what every
        rank sent this one, in rank order, and the rows from each. ``recv`` (the rows expected
        from each rank) may be None: the kernel reads what each rank sends from the segment.
        ``out``: where the result goes (needs ``recv``)."""
        rows = inp.new_empty((0, *inp.shape[1:]))  # the signature: dtype and row shape
        result = []

        def kernel(comm, *args):
            result.extend(self._all_to_all(comm, *args))
        self._call("all_to_all", kernel, inp, send, recv, signature(rows), out, t=rows)
        return result[0], result[1]

    def close(self) -> None:
        if self._comm is None:
            return
        with self._busy:  # a collective in flight on another thread ends first (or times out)
            self._ops.shm_detach(self._comm)
        self._comm = None
        del self._anchor
        self._mmap.close()


class Shm(Native):
    """fastpar's shared-memory kernels (``ShmCommunicator``); a symmetric tensor of the group,
    or a contiguous part of one (above the sizes where it pays), is worked on where it lies, no
    copy in or out."""

    name = "shm"

    @staticmethod
    def make(state, group, ranks, device):
        return ShmCommunicator(group, ranks, state.topo.rank, state.topo.timeout)

    @staticmethod
    def close(comm) -> None:
        comm.close()

    @staticmethod
    def native_quant(route, spec) -> bool:
        """The shm kernels run int8 calls themselves, unless one block per rank does not fit
        a round of their slot (blocks of 64K elements among 32 ranks or more): then the bytes
        move through the byte all-gather, to the same result."""
        if route.comm.quantizes(spec.block):
            return True
        log.debug("int8 on the shm engine of global ranks %s: one block of %d elements per "
                  "rank does not fit a round of the kernels' slot; moving packed bytes instead",
                  route.ranks, spec.block)
        return False

    @staticmethod
    def all_to_all_symmetric(route, inp, out):
        """``inp`` in symmetric memory of the group (or a contiguous part of one, from
        ``SYMMETRIC_ALL_TO_ALL_MIN`` bytes): every rank reads its blocks from the peers'
        buffers where they lie (the kernel checks every rank passed the same part of the same
        one). Returns the output (``out``, or a new tensor), None when not done here."""
        at = symmetric.lookup(inp, route.group) if inp.nbytes >= SYMMETRIC_ALL_TO_ALL_MIN \
            else None
        if at is None:
            return None
        out = torch.empty_like(inp) if out is None else out
        route.comm.all_to_all_symmetric(inp, at, out)
        return out

    @staticmethod
    def all_reduce(route, t, op, async_op):
        at = symmetric.lookup(t, route.group, op) if t.nbytes >= SYMMETRIC_ALL_REDUCE_MIN \
            else None
        if at is None:
            return Native.all_reduce(route, t, op, async_op)
        route.comm.all_reduce_symmetric(t, at, op)

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        at = symmetric.lookup(out, route.group) if block.nbytes >= SYMMETRIC_GATHER_MIN else None
        if at is None:
            return Native.all_gather_into(route, block, out, async_op)
        route.comm.all_gather_symmetric(out, at)

    @staticmethod
    def gather_from(route, t, out) -> bool:
        """``all_gather(t, out=out)`` with ``t`` (not ``out``'s block) in symmetric memory: every
        rank copies each rank's ``t`` into ``out`` where it lies. False (nothing done) when
        ``t`` is not symmetric memory of the group, or too small to pay."""
        at = symmetric.lookup(t, route.group) if t.nbytes >= SYMMETRIC_GATHER_MIN else None
        if at is None or symmetric.lookup(out, route.group) is not None:
            return False  # (a symmetric out: the in-place kernel, after the copy in)
        route.comm.all_gather_from_symmetric(t, at, out)
        return True

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        at = symmetric.lookup(inp, route.group, op) if inp.nbytes >= SYMMETRIC_SCATTER_MIN \
            else None
        if at is None:
            return Native.reduce_scatter(route, inp, out, op, async_op)
        route.comm.reduce_scatter_symmetric(inp, at, out, op)

"""All-to-all: ``fastpar.comm.all_to_all``, ``all_to_all_v`` and ``all_to_all_v_device``.

Rows (dim 0) of a tensor go from every rank of the group to every rank. With n ranks, rank i
sends ``send_counts[j]`` rows to group rank j, its rows ordered by destination::

    x_i = [x_i->0 ; x_i->1 ; ... ; x_i->n-1]        (sum_j send_counts_i[j], ...) rows
    y_j = [x_0->j ; x_1->j ; ... ; x_n-1->j]        (sum_i send_counts_i[j], ...) rows

``all_to_all`` is the equal split (``dim 0 / n`` rows to each rank). The transpose of the
exchange (what ``y_j``'s block from i goes back to i) is ``all_to_all_v(dy, recv_counts,
send_counts)``: the backward of ``comm.all_to_all_rows`` (``autograd.py``).

Engines (``policy.py``): shm (the native kernel: counts travel with the first round's data),
MPI (``Alltoallv``), gloo and NCCL (``all_to_all_single`` with split sizes), local (one rank: the
tensor itself). A group that spans hosts takes one flat call (MPI where MPI launched the job,
else torch's backend), never the hierarchical engine. Without ``recv_counts`` the flat engines
first exchange the counts in a small all-to-all of their own.

``all_to_all_v_device`` keeps the counts on the device (no host sync, as an MoE layer on GPUs
needs): the counts are exchanged into a device tensor and the output is sized by a bound.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from fastpar.comm.collectives import Handle, done, overlaps
from fastpar.comm.routing import check_tensor, route as route_of
from fastpar.comm.views import byte_view


def _counts(name: str, what: str, counts, n: int) -> list[int]:
    """``counts`` (a list, tuple or 1-D integer tensor) as n non-negative ints; ``ValueError``
    naming the values otherwise. A CUDA tensor is copied to the host (a sync: see
    ``all_to_all_v_device``)."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex \
                or counts.dtype == torch.bool:
            raise ValueError(f"{name}: {what} must be a 1-D integer tensor or a list of ints, "
                             f"got a {counts.dtype} tensor of shape {tuple(counts.shape)}")
        counts = counts.tolist()
    try:
        counts = [operator.index(c) for c in counts]
    except TypeError:
        raise ValueError(f"{name}: {what} must be integers, got {counts!r}") from None
    if len(counts) != n:
        raise ValueError(f"{name}: {what} has {len(counts)} entries {counts} for a group of "
                         f"{n} ranks (one per rank)")
    negative = [f"{c} for rank {j}" for j, c in enumerate(counts) if c < 0]
    if negative:
        raise ValueError(f"{name}: {what} {counts} holds negative counts: "
                         f"{', '.join(negative)}")
    return counts


def exchange(name, t, send, recv, group, async_op, out=None):
    """``(result or Handle, send counts, recv counts)`` of one all-to-all, the counts as lists;
    arguments checked before any communication (``send=None``: equal splits)."""
    check_tensor(name, t)
    if t.dim() == 0:
        raise ValueError(f"{name} needs a tensor with at least one dim to split, got a 0-dim "
                         "tensor")
    route = route_of("all_to_all", t, group)
    n, rows = len(route.ranks), t.shape[0]
    equal = send is None  # all_to_all: alike on every rank, unlike the counts of all_to_all_v
    if send is None:
        if rows % n:
            raise ValueError(f"{name}: dim 0 of size {rows} is not divisible by the group "
                             f"size {n}")
        send = recv = [rows // n] * n
    else:
        send = _counts(name, "send_counts", send, n)
        if sum(send) != rows:
            raise ValueError(f"{name}: send_counts {send} add up to {sum(send)} rows but dim 0 "
                             f"of the input has {rows} (shape {tuple(t.shape)})")
        if recv is not None:
            recv = _counts(name, "recv_counts", recv, n)
    if out is not None:
        if recv is None:
            raise ValueError(f"{name}: out= needs recv_counts (the rows it must hold are "
                             "known only after the counts are exchanged)")
        want = (sum(recv), *t.shape[1:])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or \
                out.dtype != t.dtype or out.device != t.device or not out.is_contiguous():
            got = (f"{out.dtype} {tuple(out.shape)} on {out.device}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"{name}: out must be a contiguous {t.dtype} tensor of shape "
                             f"{want} on {t.device}, got {got}")
    if route.adapter.local:
        if recv is not None and recv != send:
            raise ValueError(f"{name}: recv_counts {recv} differ from send_counts {send} on a "
                             "group of one rank")
        if out is not None:
            return done(out.copy_(t.clone() if overlaps(out, t) else t), async_op), send, send
        return done(t, async_op), send, send
    inp = t.contiguous()
    alias = None
    if out is not None and overlaps(out, inp):  # peers read inp while out is written: the
        alias, out = out, None                   # result goes through a new tensor
    # equal splits, by the call (not by counts that one rank's could match and another's not):
    # a symmetric input of the group is read where it lies (shm), every rank deciding alike
    read = route.adapter.all_to_all_symmetric(route, inp, out) if equal else None
    if read is not None:
        out, work = read, None
    else:
        out, recv, work = route.adapter.all_to_all(route, inp, send, recv, out, async_op)
    if alias is not None:
        result = out
        if async_op and work is not None:
            return Handle(alias, work, lambda: alias.copy_(result)), send, recv
        out = alias.copy_(result)
    return (Handle(out, work) if async_op else out), send, recv


def all_to_all(t: torch.Tensor, group=None, async_op: bool = False, *, out=None):
    """Equal splits: block j of ``t``'s dim 0 (``dim 0 / n`` rows) goes to group rank j; the
    result's block i came from group rank i. Same shape as ``t`` (a new tensor; ``t`` itself
    on a group of one rank). ``group=None``: the world. ``out``: a contiguous tensor of ``t``'s
    shape, dtype and device the result is written into (and returned), e.g. reused across calls
    so that no new memory is faulted in each time."""
    return exchange("all_to_all", t, None, None, group, async_op, out)[0]


def all_to_all_v(t: torch.Tensor, send_counts, recv_counts=None, group=None,
                 async_op: bool = False, *, out=None):
    """Variable splits: ``send_counts[j]`` rows of ``t`` (dim 0, in order) go to group rank j;
    the result is what every rank sent this one, concatenated in group-rank order.

    ``send_counts``, ``recv_counts``: a list of ints or a 1-D integer tensor, one entry per rank
    (a CUDA tensor is read on the host: a sync; ``all_to_all_v_device`` has none).
    ``recv_counts=None``: the counts are exchanged (shm: read from its segment in the same
    round as the data). Given, every rank checks them against what is sent (shm: a mismatch
    fails on every rank). ``ValueError`` before any communication for a wrong number of
    counts, negative counts, or send counts that do not add up to ``t.shape[0]``. ``out``: as
    for ``all_to_all``, of ``sum(recv_counts)`` rows (so it needs ``recv_counts``)."""
    return exchange("all_to_all_v", t, send_counts, recv_counts, group, async_op, out)[0]


def all_to_all_v_device(t: torch.Tensor, send_counts: torch.Tensor, capacity: int, group=None,
                        async_op: bool = False):
    """``all_to_all_v`` with the counts on ``t``'s device and no device-to-host sync.

    ``send_counts``: int64 tensor (n,) on ``t``'s device; ``capacity``: the most rows any rank
    sends to any one rank (a host int, the same on every rank; rows past it are dropped, since
    checking would need the sync this function avoids). Returns ``(out, recv_counts)``: ``out``
    has ``n * capacity`` rows, of which the first ``recv_counts.sum()`` are the concatenation
    ``all_to_all_v`` returns and the rest zeros; ``recv_counts`` (n,) stays on the device. With
    ``async_op`` ``out`` is a ``Handle`` (``recv_counts`` is valid after its ``wait()``).

    How (only device ops between the collectives): the counts go in an all-to-all of n
    integers; each rank's rows are scattered into n slices of ``capacity`` rows (padded), an
    equal-split all-to-all moves them, and the received slices are gathered back to back. It
    runs on the group's torch.distributed backend (NCCL on GPUs; gloo for CPU tensors, which is
    how it is tested without a GPU)."""
    check_tensor("all_to_all_v_device", t)
    if t.dim() == 0:
        raise ValueError("all_to_all_v_device needs a tensor with at least one dim to split")
    n = dist.get_world_size(group)
    if not isinstance(send_counts, torch.Tensor) or tuple(send_counts.shape) != (n,) or \
            send_counts.device != t.device or send_counts.dtype != torch.int64:
        got = (f"{send_counts.dtype} {tuple(send_counts.shape)} on {send_counts.device}"
               if isinstance(send_counts, torch.Tensor) else type(send_counts).__name__)
        raise ValueError(f"all_to_all_v_device: send_counts must be an int64 tensor of shape "
                         f"({n},) on {t.device}, got {got}")
    if operator.index(capacity) < 0:
        raise ValueError(f"all_to_all_v_device: capacity must be >= 0, got {capacity}")
    rest, dev = t.shape[1:], t.device
    recv_counts = torch.empty_like(send_counts)
    counts_work = dist.all_to_all_single(recv_counts, send_counts, group=group, async_op=True)
    # Row i of t goes to rank j (the slice it falls in) at position i - start_j of slice j;
    # rows past a slice's capacity, or past the counts' sum, land in a spare row n * capacity.
    ends = send_counts.cumsum(0)
    rows = torch.arange(t.shape[0], device=dev)
    dest = torch.searchsorted(ends, rows, right=True)
    within = rows - (ends - send_counts).take(dest.clamp(max=n - 1))
    slot = torch.where((dest < n) & (within < capacity), dest * capacity + within,
                       n * capacity)
    padded = torch.zeros((n * capacity + 1, *rest), dtype=t.dtype, device=dev)
    padded.index_copy_(0, slot, t.contiguous())
    received = torch.empty((n * capacity, *rest), dtype=t.dtype, device=dev)
    # As bytes, as the flat adapter does: gloo does not carry every dtype.
    data_work = dist.all_to_all_single(byte_view(received), byte_view(padded[:n * capacity]),
                                       group=group, async_op=True)
    out = torch.empty_like(received)

    def finish():  # out row k: slice j (where k falls among the received counts), row k - start
        counts_work.wait()
        data_work.wait()
        got = recv_counts.clamp(max=capacity)
        ends = got.cumsum(0)
        k = torch.arange(n * capacity, device=dev)
        src = torch.searchsorted(ends, k, right=True)
        offset = k - (ends - got).take(src.clamp(max=n - 1))
        index = torch.where(src < n, src * capacity + offset, 0)
        torch.index_select(received, 0, index, out=out)
        out.masked_fill_((src >= n).view(-1, *[1] * len(rest)), 0)

    if async_op:
        return Handle(out, _Both(counts_work, data_work), finish), recv_counts
    finish()
    return out, recv_counts


class _Both:
    """Two works as one (what ``Handle`` waits on)."""

    def __init__(self, *works):
        self._works = works

    def wait(self):
        for w in self._works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

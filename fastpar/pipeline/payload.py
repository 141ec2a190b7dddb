"""The payload of a pipeline message on the wire, and Megatron's scatter-gather over tp.

    wire = Payload(scatter_group, device)              # scatter_group None: nothing is cut
    cut = wire.cuts(values)                            # per tensor: sent as 1/tp shares?
    why = wire.check_replicated(values, cut, direction, mb, stage)   # None, or the mismatch
    parts = wire.pack(values, cut)                     # what the engine sends
    layout = wire.layout(entries)                      # ((dtype, numel), ...) of what arrives
    values = wire.unpack(entries, bufs, direction)     # the received buffers, gathered, shaped

Scatter-gather: with ``scatter_group`` (the tp group) set, a tensor that every rank of that
group holds alike is sent as this rank's 1/tp of it (flattened), and the receiver all-gathers
the shares over its own tp group: tp times less traffic between stages. On the first scattered
message of each step per direction, the sender proves the tensors alike (a checksum
all-gathered over the tp group), so that a stage whose output differs across the group (a
sharded output, per-rank dropout) fails instead of being spliced.

``entries`` are the header's tensors as ``fastpar.pipeline.messages.decode`` reads them: per
tensor ``None`` or ``(dtype, shape, requires_grad, cut)``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastpar.comm import collectives
from fastpar.pipeline.messages import ACTIVATION, WHAT


class Payload:
    """How this rank's Channels lay tensors out on the wire: whole, or cut over ``scatter_group``
    (every tensor whose element count the group's size divides)."""

    def __init__(self, scatter_group, device):
        self.group, self.device = scatter_group, device
        self.tp = 1 if scatter_group is None else dist.get_world_size(scatter_group)
        self.tp_rank = 0 if scatter_group is None else dist.get_rank(scatter_group)
        self._verified: set = set()  # directions whose replication was checked this step

    def cuts(self, values) -> list[bool]:
        """Per tensor of ``values``: whether it travels as this rank's 1/tp share."""
        return [v is not None and self.tp > 1 and v.numel() > 0 and v.numel() % self.tp == 0
                for v in values]

    def check_replicated(self, values, cut, direction, mb, stage) -> str | None:
        """``None`` when the tensors to cut are alike on every rank of the tp group (checked
        once per step and direction; collective over the group), else why not in words."""
        tensors = [v for v, c in zip(values, cut) if c]
        if not tensors or direction in self._verified:
            return None
        sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().abs()
                                         .sum()]) for t in tensors]).reshape(-1)
        every = collectives.all_gather(sums.to(self.device), group=self.group, dim=0)
        every = every.reshape(self.tp, -1).cpu()  # (tp, 2 * tensors)
        if not torch.equal(every, every[:1].expand_as(every)):
            return (f"fastpar p2p: scatter-gather needs the {WHAT[direction]} that stage "
                    f"{stage - 1 if direction == ACTIVATION else stage + 1} sends (microbatch "
                    f"{mb}) to be identical on every rank of the tp group, but the tp ranks hold "
                    f"different tensors (checksums {every[:, 0].tolist()}): the stage ends in a "
                    "sharded or per-rank layer; build the Pipeline with scatter_gather=False")
        self._verified.add(direction)
        return None

    def pack(self, values, cut) -> list[torch.Tensor]:
        """The contiguous tensors to send: each tensor whole, or this rank's 1/tp share if cut."""
        parts = []
        for v, c in zip(values, cut):
            if v is None:
                continue
            v = v.detach()
            if c:  # this rank's 1/tp of the flattened tensor; the receiver all-gathers
                v = v.reshape(-1).chunk(self.tp)[self.tp_rank]
            parts.append(v.contiguous())
        return parts

    def layout(self, entries) -> tuple:
        """``((dtype, numel), ...)``: the received buffers, one per tensor that is not None."""
        return tuple((e[0], math.prod(e[1]) // (self.tp if e[3] else 1))
                     for e in entries if e is not None)

    def unpack(self, entries, bufs, direction) -> list:
        """The tensors of the message from its received buffers (in ``layout`` order): cut ones
        all-gathered over the tp group, each viewed in its shape, activations that required
        grad requiring it again (fresh leaves)."""
        received, values = iter(bufs), []
        for e in entries:
            if e is None:
                values.append(None)
                continue
            dtype, shape, grad, cut = e
            buf = next(received)
            if cut:
                buf = collectives.all_gather(buf, group=self.group, dim=0)
            t = buf.view(shape)
            if grad and t.is_floating_point() and direction == ACTIVATION:
                t.requires_grad_(True)
            values.append(t)
        return values

    def warm_up(self) -> None:
        """The all-gather on arrival, built now (collective over the tp group)."""
        if self.group is not None:
            collectives.all_gather(torch.zeros(self.tp, device=self.device), group=self.group)

    def new_step(self) -> None:
        self._verified.clear()

"""``fastpar.DataParallel``: gradients averaged over the dp group, overlapped with backward.

    model = fastpar.DataParallel(model)          # group=None: the topology's dp group
    opt = torch.optim.AdamW(model.parameters())
    with model.no_sync():                        # accumulate locally, no communication
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()            # returns with every gradient averaged
    opt.step(); opt.zero_grad()

Construction broadcasts every parameter and buffer from dp rank 0, then packs the trainable
parameters into buckets (``fastpar.data_parallel.buckets``); each ``param.grad`` is a view into
its bucket, so autograd accumulates straight into the memory the collective reduces. The
``Reducer`` (``fastpar.data_parallel.reducer``) runs one reduction cycle per backward outside
``no_sync()``: buckets launched in index order as backward fills them, the last gradient's hook
waits for all of them and averages, so ``loss.backward()`` alone leaves averaged gradients.
A trainable parameter that gets no gradient is an error, at the next forward or in
``finish_gradient_synchronization()``, on every rank (``find_unused_parameters=True``: allowed).

Expert parameters (``param.expert_parallel``, ``fastpar.nn.MoE``'s experts) are sharded over the
expert-parallel group inside dp: each rank holds other experts, whose gradients already sum the
tokens of its ep group. They take their own buckets and reducer over ``expert_group`` (the
ranks holding the same experts, the topology's edp group), divided by dp all the same (the sum
covers every dp rank's tokens once), and their initial values are broadcast over that group.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.data_parallel.reducer import Reducer
from fastpar.runtime import group_size, topology
from fastpar.state_dict import full_state_dict, load_full_state_dict

log = logging.getLogger("fastpar.data_parallel")

PREFIX = "module."  # where nn.Module registers the wrapped module; hidden from state dicts


class DataParallel(nn.Module, Joinable):
    """Average the gradients of ``module`` over a data-parallel group.

    ``bucket_mb``: bucket cap in MiB (the first bucket is at most 1 MiB). ``overlap``: reduce each
    bucket as soon as backward has filled it (True) or all of them at the end of backward.
    ``group``: the dp group (None: ``fastpar.topology().dp_group``, so under TP/PP each
    tensor/pipeline coordinate averages over its own replicas). ``find_unused_parameters``: allow
    trainable parameters that get no gradient. ``reduce_dtype``: the dtype the buckets reduce in
    (e.g. ``torch.float32`` for a bfloat16 model); default: each parameter's own. ``quant``
    ("int8" or a ``comm.Quant``): float32 and bfloat16 buckets are all-reduced as block-scaled
    int8 (``fastpar.comm.quant``; float32 sums, both stages of the all-reduce quantized), which
    completes inside the bucket's launch (no overlap with the rest of backward);
    ``error_feedback``: each rank carries what the int8 could not send into its next step
    (a float32 residual per bucket). ``expert_group``: where expert parameters are reduced
    (None: the topology's edp group; see the module docstring).

    The state dict has the wrapped module's keys (no ``module.`` prefix); ``fastpar.
    full_state_dict`` sees through the wrapper. A dp group of one rank communicates nothing.
    """

    def __init__(self, module: nn.Module, *, bucket_mb: float = 25.0, overlap: bool = True,
                 group=None, find_unused_parameters: bool = False,
                 reduce_dtype: torch.dtype | None = None, quant=None,
                 error_feedback: bool = False, expert_group=None, process_group=None,
                 bucket_cap_mb: float | None = None, broadcast_buffers: bool = False,
                 gradient_as_bucket_view: bool = True, static_graph: bool = False,
                 device_ids=None, output_device=None):
        nn.Module.__init__(self)
        Joinable.__init__(self)
        group, bucket_mb = _ddp_arguments(module, group, process_group, bucket_mb, bucket_cap_mb,
                                          device_ids, output_device)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.static_graph, self.gradient_as_bucket_view = bool(static_graph), True
        quant = quant_codec.spec(quant)  # a bad name or block raises here, before anything
        if error_feedback and quant is None:
            raise ValueError("DataParallel: error_feedback=True needs quant (e.g. 'int8')")
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype)
                                             and reduce_dtype.is_floating_point):
            raise ValueError(f"reduce_dtype must be a floating torch.dtype, got {reduce_dtype!r}")
        self.module = module
        self.group = topology().dp_group if group is None else group
        self.dp_size = group_size(self.group, "DataParallel")
        self.overlap, self.find_unused_parameters = bool(overlap), bool(find_unused_parameters)
        self.reduce_dtype, self.bucket_mb = reduce_dtype, float(bucket_mb)
        self._src = dist.get_process_group_ranks(self.group)[0]  # global rank of dp rank 0

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        experts = [(n, p) for n, p in named if getattr(p, "expert_parallel", False)]
        dense = [(n, p) for n, p in named if not getattr(p, "expert_parallel", False)]
        if experts and expert_group is None:
            expert_group = topology().edp_group
        self.expert_group = expert_group if experts else None
        self._expert_src = None if self.expert_group is None else \
            dist.get_process_group_ranks(self.expert_group)[0]
        # Before any other collective: a replica that differs would pair the broadcasts and
        # the (collective) symmetric bucket allocations up wrongly instead of raising.
        self._check_replicas_agree([p for _, p in named])
        self._broadcast_from_rank0()

        def reducer(params, group):
            r = Reducer([p for _, p in params], [n for n, _ in params], group=group,
                        dp_size=self.dp_size, bucket_mb=self.bucket_mb, overlap=self.overlap,
                        find_unused_parameters=self.find_unused_parameters,
                        reduce_dtype=reduce_dtype, quant=quant,
                        error_feedback=bool(error_feedback))
            r.attach()
            return r

        self.reducer = reducer(dense, self.group)
        self.expert_reducer = reducer(experts, self.expert_group) if experts else None
        self._reducers = [r for r in (self.reducer, self.expert_reducer) if r is not None]
        self._no_sync = False
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        log.debug("%r", self)

    # ---- construction -------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Every parameter (frozen ones too) and buffer takes dp rank 0's value; an expert
        parameter its expert group's rank 0's."""
        for t in [*self.module.parameters(), *self.module.buffers()]:
            if getattr(t, "expert_parallel", False):
                if group_size(self.expert_group) > 1:
                    comm.broadcast(t.data, src=self._expert_src, group=self.expert_group)
            elif self.dp_size > 1:
                comm.broadcast(t.data, src=self._src, group=self.group)

    def _check_replicas_agree(self, params) -> None:
        """Every rank of the group must hold the same model and bucket settings (then the bucket
        plan, a pure function of them, is the same too), or the collectives would pair up
        wrongly; one all_gather says which rank differs."""
        if self.dp_size == 1:
            return
        tensors = [*self.module.parameters(), *self.module.buffers()]  # what is broadcast
        itemsize = 0 if self.reduce_dtype is None else self.reduce_dtype.itemsize
        mine = torch.tensor([[len(params), sum(p.numel() for p in params), len(tensors),
                              self.bucket_mb, itemsize]], dtype=torch.float64)
        every = comm.all_gather(mine, group=self.group)  # (dp, 5)
        if not bool((every == every[0]).all()):
            ranks = dist.get_process_group_ranks(self.group)
            rows = ", ".join(f"rank {r}: {int(a)} trainable params / {int(b)} elements / "
                             f"{int(c)} tensors, bucket_mb {d:g}, reduce itemsize {int(e)}"
                             for r, (a, b, c, d, e) in zip(ranks, every.tolist()))
            raise ValueError(f"DataParallel: the dp replicas hold different models ({rows}); "
                             "every rank of the dp group must wrap the same module with the "
                             "same bucket_mb and reduce_dtype")

    # ---- the module ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._no_sync:
            Join.notify_join_context(self)  # inside join(): this rank still has inputs
        if self.broadcast_buffers and self.dp_size > 1:  # as DDP: dp rank 0's buffers
            with torch.no_grad():
                for buf in self.module.buffers():
                    comm.broadcast(buf, src=self._src, group=self.group)
        if not torch.is_grad_enabled():  # no backward will follow: leave the cycle alone
            return self.module(*args, **kwargs)
        for r in self._reducers:
            r.finish()  # the previous cycle must be complete
            r.prepare_gradients()
            r.sync = not self._no_sync
        output = self.module(*args, **kwargs)
        if not self._no_sync and self.find_unused_parameters:
            for r in self._reducers:
                r.mark_unreached(output)
        return output

    def step(self, *args, **kwargs):
        """For a wrapped ``fastpar.pipeline.Pipeline``: its ``step(inputs, targets)``, every
        bucket reduced over dp unless inside ``no_sync()``. Returns the pipeline's loss (this
        replica's mean; average it over dp for the global one). Collective over dp.

        The microbatches' backwards accumulate into the buckets, reducing nothing, until this
        rank's last full backward (``Pipeline.step(before_last_backward=)``): no gradient
        changes after it, so its hooks launch each bucket as it fills, overlapped with the rest
        of that backward, as DDP does. After the step the buckets of the parameters it did not
        reach (another chunk's, an expert no token chose) are launched and every reduction
        waited for. Where the schedule has no full backward (zb's W passes write ``.grad``
        without the hooks) every bucket is reduced after the step."""
        step = getattr(self.module, "step", None)
        if step is None:
            raise TypeError(f"DataParallel.step needs a wrapped module with .step (a fastpar "
                            f"Pipeline); {type(self.module).__name__} has none: call the "
                            "wrapper itself, then backward")
        for r in self._reducers:
            r.finish()
            r.prepare_gradients()
            r.sync = False  # the hooks only keep .grad in the buckets

        def reduce_from_here():  # the last backward's gradients are final: reduce as they come
            for r in self._reducers:
                r.sync = True

        cycles = [r.cycles for r in self._reducers]
        # a pipeline's tied weights: their copies' gradients summed once, after the reduction
        # (its float32 buffers are copied back into .grad when a cycle closes)
        tied = getattr(self.module, "tied", None)
        if tied:
            kwargs["sum_tied"] = False
        loss = step(*args, **kwargs,
                    before_last_backward=None if self._no_sync else reduce_from_here)
        if not self._no_sync:
            for r, before in zip(self._reducers, cycles):
                r.close_cycle(finished=r.cycles > before)
            if tied:
                self.module.sum_tied_grads()
        return loss

    @property
    def buckets(self):
        """The gradient buckets, in launch order (the expert buckets last)."""
        return tuple(b for r in self._reducers for b in r.buckets)

    def finish_gradient_synchronization(self) -> None:
        """Complete a reduction cycle that backward left open, or say why it cannot.

        Nothing to do after a normal backward (its last gradient hook finished the cycle). With
        ``find_unused_parameters=True`` the parameters that got no gradient are marked ready and
        the cycle completes (collective: call it on every rank); otherwise an error names them.
        """
        for r in self._reducers:
            r.finish()

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """DDP's ``join()``: a context for uneven inputs. A rank that runs out of batches
        shadows the others' reductions (its buckets count as zeros, and the sum is still divided
        by the whole dp size, as DDP's ``divide_by_initial_world_size=True``); at the end the
        last rank to join gives every rank its parameters and buffers."""
        if not divide_by_initial_world_size:
            raise ValueError("DataParallel.join: divide_by_initial_world_size=False is not "
                             "supported (the buckets are divided by the whole dp size)")
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.buckets[0].data.device if self.reducer.buckets else \
            torch.device("cpu")

    @property
    def join_process_group(self):
        return self.group

    def register_comm_hook(self, state, hook) -> None:
        """DDP's communication hook: ``hook(state, bucket)`` returns a ``torch.futures.Future``
        of the bucket's reduced gradients, averaged (DDP's contract: ``bucket.buffer()``,
        ``.index()``, ``.is_last()``, ``.gradients()``, ``.parameters()``; e.g. torch's
        ``default_hooks.allreduce_hook`` or ``fp16_compress_hook`` with the dp group as
        ``state``). Replaces the reducer's own all-reduce and division for every bucket."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook: a communication hook is already registered "
                               "(DDP allows one)")
        for r in self._reducers:
            r.comm_hook = (state, hook)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this block reduce nothing: gradients
        accumulate in the buckets, and the next backward outside reduces all of it."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def _full_state_dict(self):  # fastpar.full_state_dict sees through the wrapper
        return full_state_dict(self.module)

    def _load_full_state_dict(self, state_dict, strict=True):
        return load_full_state_dict(self.module, state_dict, strict=strict)

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{b.nbytes / 2**20:.3g}" for b in self.buckets[:4])
        more = ", ..." if len(self.buckets) > 4 else ""
        why = "dp group of one rank: no communication" if self.dp_size == 1 else (
            "each bucket reduced as soon as backward fills it" if self.overlap
            else "all buckets reduced after backward")
        return (f"dp={self.dp_size}, buckets={len(self.buckets)} [{sizes}{more}] MiB, "
                f"overlap={self.overlap} ({why}), find_unused_parameters="
                f"{self.find_unused_parameters}, reduce_dtype={self.reduce_dtype}")


class _JoinHook(JoinHook):
    """What a rank out of inputs runs for each step the others still take: the buffers'
    broadcast and every bucket's all-reduce, with zeros; at the end, the last joiner's model."""

    def __init__(self, dp: DataParallel):
        self.dp = dp

    @torch.no_grad()
    def main_hook(self) -> None:
        dp = self.dp
        if dp.broadcast_buffers and dp.dp_size > 1:
            for buf in dp.module.buffers():
                comm.broadcast(buf, src=dp._src, group=dp.group)
        for r in dp._reducers:
            for b in r.buckets:
                comm.all_reduce(torch.zeros_like(b.data), group=r.group)

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        dp = self.dp
        if dp.dp_size == 1:
            return
        ranks = dist.get_process_group_ranks(dp.group)
        last = comm.all_gather(torch.tensor([float(is_last_joiner)]), group=dp.group)
        src = ranks[int(last.nonzero()[0])]  # the first of the last joiners
        for t in [*dp.module.parameters(), *dp.module.buffers()]:
            comm.broadcast(t.data, src=src, group=dp.group)


def _ddp_arguments(module, group, process_group, bucket_mb, bucket_cap_mb, device_ids,
                   output_device):
    """DistributedDataParallel's names for ``group`` and ``bucket_mb``, and its device checks:
    ``(group, bucket_mb)``; ``ValueError`` naming what conflicts."""
    if process_group is not None and group is not None:
        raise ValueError("DataParallel: pass group or process_group (DDP's name), not both")
    if bucket_cap_mb is not None:
        if bucket_mb != 25.0:
            raise ValueError(f"DataParallel: pass bucket_mb ({bucket_mb}) or bucket_cap_mb "
                             f"({bucket_cap_mb}, DDP's name), not both")
        bucket_mb = bucket_cap_mb
    devices = {p.device for p in module.parameters()}
    if device_ids is not None or output_device is not None:
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"DataParallel: device_ids={device_ids!r} and output_device="
                             f"{output_device!r} apply to a module on one CUDA device only (as "
                             f"DDP's); this one is on {sorted(map(str, devices))}: leave them "
                             "None")
        mine = next(iter(devices))
        for given in ([*device_ids] if device_ids is not None else []) + (
                [output_device] if output_device is not None else []):
            device = torch.device("cuda", given) if isinstance(given, int) else \
                torch.device(given)
            if device != mine:
                raise ValueError(f"DataParallel: device {given!r} is not the module's {mine}")
    return (group if group is not None else process_group), bucket_mb


def _strip_prefix(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: ``<prefix>module.<key>`` -> ``<prefix><key>`` (order kept)."""
    inner = prefix + PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if k == inner[:-1] or k.startswith(inner)]:
            value = meta.pop(key)
            meta[(prefix + key[len(inner):]) if key != inner[:-1] else prefix[:-1]] = value


def _add_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys,
                unexpected_keys, error_msgs) -> None:
    """load_state_dict pre-hook: the wrapped module's keys ``<prefix><key>`` are loaded into
    ``<prefix>module.<key>``; keys that have it already (a DDP checkpoint's) stay."""
    for key in [k for k in state_dict if k.startswith(prefix)
                and not k.startswith(prefix + PREFIX)]:
        state_dict[prefix + PREFIX + key[len(prefix):]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if k == prefix[:-1] or k.startswith(prefix)]:
            rest = key[len(prefix):] if key != prefix[:-1] else ""
            meta[prefix + PREFIX + rest if rest else prefix + PREFIX[:-1]] = meta[key]

"""``Pipeline``: a model cut into stages over the pp group, run by a validated schedule.

    topo = fastpar.init(pp=4)                       # mpirun -np 4 python train.py
    pipe = Pipeline([lambda: Block() for _ in range(16)], loss_fn=F.cross_entropy,
                    schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())      # this rank's chunks only
    loss = pipe.step(inputs, targets)               # forward + backward of the whole batch
    opt.step(); opt.zero_grad()

Construction is collective over the world (every rank builds its pipeline). Every rank's action
list is compiled and validated on the host before anything runs, so a schedule that would hang
never starts.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from fastpar.comm import collectives
from fastpar.pipeline import partition as part
from fastpar.pipeline.board import Board
from fastpar.pipeline.channels import Channels
from fastpar.pipeline.executor import Executor
from fastpar.pipeline.schedules import compile_schedule, gpipe, theoretical_bubble
from fastpar.pipeline.tied import sum_copies
from fastpar.runtime import job


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _split(x, m: int, what: str, device, joins: list | None = None):
    """``m`` microbatches of ``x`` (a tensor or a tuple of tensors) along dim 0.

    A tensor that requires grad is cut into fresh leaves (``joins`` gets ``(x, leaves)``, whose
    gradients go back into ``x`` in one backward after the step): autograd through ``split``
    would build a zero-padded gradient of the whole batch for every microbatch."""
    if isinstance(x, (tuple, list)):
        parts = [_split(t, m, what, device, joins) for t in x]
        return [tuple(p[i] for p in parts) for i in range(m)]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[0] % m:
        raise ValueError(f"{what} of shape {tuple(x.shape)} cannot be split into {m} equal "
                         f"microbatches along dim 0 (the batch must be a multiple of {m})")
    parts = list(x.to(device).split(x.shape[0] // m))
    if x.requires_grad and joins is not None:
        parts = [p.detach().requires_grad_() for p in parts]
        joins.append((x, parts))
    return parts


def _join_grads(joins) -> None:
    """The microbatch leaves' gradients, back into the tensors they were cut from."""
    for x, parts in joins:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parts]
        torch.autograd.backward(x, torch.cat(grads).to(x.device))


def _agree(fn) -> None:
    """Run ``fn``; if it raises ValueError, KeyError or TypeError on any rank, raise on every
    rank what each said (collective over the world)."""
    problem = None
    try:
        fn()
    except (ValueError, KeyError, TypeError) as exc:
        problem = f"rank {dist.get_rank()}: {exc}"
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, problem)
    problems = [p for p in said if p]
    if problems:
        raise ValueError("Pipeline: " + "; ".join(problems))


def _sequence_parallel(chunks) -> bool:
    return any(getattr(m, "sequence_parallel", False) for c in chunks for m in c.modules())


class Pipeline(nn.Module):
    """``layers`` partitioned over the pp group into ``pp x virtual_stages`` contiguous stages.

    layers: an ``nn.Sequential``, a list of modules, or a list of zero-argument factories (only
    this rank's layers get built). loss_fn(output, target) -> the mean loss of a microbatch.
    schedule: "gpipe", "1f1b", "interleaved" (virtual_stages >= 2) or "zb" (ZB-H1).
    balance: layer count per stage, in stage order (default: balanced by parameter count).
    trace: a path; after every step global rank 0 writes its pp group's timeline there (Chrome
    trace JSON) and beside it as PNG (``FASTPAR_TRACE`` sets it too).
    scatter_gather: send 1/tp of each activation and all-gather on arrival (default: on when
    tp > 1 and no layer uses sequence parallelism). p2p: "auto", "shm" or "torch".
    stage: ``stage([(name, module), ...]) -> nn.Module`` builds a chunk from its layers (default:
    an ``nn.Sequential`` of them; ``fastpar.pipeline.hf`` places Hugging Face parts under their
    dotted names). Its state-dict keys must be the layers' own under their names.
    tied: groups of state-dict keys naming one weight held as copies (``[("embed.weight",
    "head.weight")]``), on the first and last stage: checked equal at construction; every step
    gives each copy the sum of their gradients (``fastpar.pipeline.tied``).
    """

    def __init__(self, layers, *, loss_fn, schedule: str = "1f1b", microbatches: int,
                 virtual_stages: int = 1, balance=None, trace=None, scatter_gather=None,
                 p2p: str = "auto", stage=None, tied=()):
        super().__init__()
        from fastpar.comm.state import current

        topo = current().topo
        self.microbatches = _positive("microbatches", microbatches)
        self.virtual_stages = v = _positive("virtual_stages", virtual_stages)
        self.pp, self.pp_rank = topo.pp_size, topo.pp_rank
        self.schedule, self.loss_fn = schedule, loss_fn
        self.group, self.pp_ranks = topo.pp_group, topo.ranks("pp")
        self._topo = topo
        # Every rank's list, validated: a schedule that cannot run fails here, on every rank.
        self.actions = compile_schedule(schedule, self.pp, microbatches, v)
        self.forward_actions = [[a for a in acts if a.kind in ("F", "SF", "RF")]
                                for acts in (gpipe(self.pp, microbatches, r, v)
                                             for r in range(self.pp))]
        items, bounds, keys = part.partition(layers, self.pp, v, balance)
        trace = trace if trace is not None else os.environ.get("FASTPAR_TRACE") or None
        # One decision for the whole world, rank 0's: layer cuts, tracing.
        decided = [(len(items), bounds, trace is not None)]
        dist.broadcast_object_list(decided, src=0)
        if decided[0][0] != len(items):
            raise ValueError(f"rank {topo.rank} has {len(items)} layers but rank 0 has "
                             f"{decided[0][0]}: every rank must pass the same layers")
        self.bounds, self.tracing = decided[0][1], decided[0][2]
        self.trace_path = trace
        self.layer_keys = keys
        self.stage_keys = [sum(keys[self.bounds[s]:self.bounds[s + 1]], [])
                           for s in range(self.pp * v)]
        # Building this rank's chunks can fail here alone (a missing tensor): every rank hears
        # of it before the next collective, instead of waiting in it until the timeout.
        self.chunks = None
        self.tied, spanning = [], []
        _agree(lambda: self._build(items, stage, tied, spanning))
        _agree(lambda: self._check_tied_across(spanning))
        # One setting for the world (a receiver all-gathers what a sender scattered): on only
        # if every rank wants it and no layer anywhere is sequence parallel.
        want = (not _sequence_parallel(self.chunks)) if scatter_gather is None else \
            bool(scatter_gather)
        flag = torch.tensor([int(want)], device=topo.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        scatter_gather = topo.tp_size > 1 and bool(flag.item())
        self.channels = Channels(self.group, all_groups=topo.grid.groups("pp"),
                                 scatter_group=topo.tp_group if scatter_gather else None,
                                 engine=p2p, device=topo.device)
        # the loss broadcast's communicator, built now rather than inside the first step
        collectives.broadcast(torch.zeros((), dtype=torch.float64, device=topo.device),
                              src=self.pp_ranks[-1], group=self.group)
        self.board = Board.create(topo.mpi_comm, topo.rank)
        if self.board is not None:
            job().on_close(self.board.close)
        self.executor = Executor(list(self.chunks), pp=self.pp, rank=self.pp_rank, v=v,
                                 channels=self.channels, loss_fn=loss_fn, board=self.board)
        self.stats: dict = {}

    def _build(self, items, stage, tied, spanning) -> None:
        v, dev = self.virtual_stages, self._topo.device
        self.chunks = nn.ModuleList(
            part.build_chunk(items, self.bounds[s], self.bounds[s + 1], stage).to(dev)
            for s in (c * self.pp + self.pp_rank for c in range(v)))
        self._check_chunk_keys()
        self.tied = self._tie(tied, spanning)

    def _check_chunk_keys(self) -> None:
        for c, chunk in enumerate(self.chunks):
            want = set(self.stage_keys[c * self.pp + self.pp_rank])
            got = set(chunk.state_dict(keep_vars=True))
            if got != want:
                raise ValueError(f"pipeline chunk {c} has state-dict keys that are not its "
                                 f"layers' own under their names: missing "
                                 f"{sorted(want - got)[:5]}, unexpected {sorted(got - want)[:5]}"
                                 " (a stage builder must place each layer under its name)")

    def _tie(self, tied, spanning: list) -> list[tuple[list[nn.Parameter], object]]:
        """This rank's copies of each tied weight (distinct Parameters) and the group their
        gradients are summed over (the embedding group when the copies span the first and last
        stage on different ranks, else None), checked equal here; ``spanning`` gets ``(keys,
        sum of this rank's copy)`` of the ties across stages, for ``_check_tied_across``. A
        copy after a tie's first is marked as one (the chunk's ``tied_copies``), so the global
        gradient norm counts the weight once (``fastpar.optim.clip``)."""
        every = {k for keys in self.layer_keys for k in keys}
        last = self.pp * self.virtual_stages - 1
        mine = {}
        for chunk in self.chunks:
            mine.update(chunk.state_dict(keep_vars=True))
        local = []
        for keys in tied:
            keys = tuple(keys)
            unknown = [k for k in keys if k not in every]
            if len(keys) < 2 or unknown:
                raise ValueError(f"tied={keys!r}: a tie names two or more state-dict keys of "
                                 f"the layers; unknown: {unknown}")
            stages = {k: next(s for s, sk in enumerate(self.stage_keys) if k in sk)
                      for k in keys}
            if any(s not in (0, last) for s in stages.values()):
                raise ValueError(f"tied={keys!r}: copies on stages {stages}; a tied weight's "
                                 f"copies must be on the first or last stage (0 or {last})")
            spans = self.pp > 1 and {0, last} <= set(stages.values())
            found = {}
            for k in keys:
                if k in mine:
                    found.setdefault(id(mine[k]), (k, mine[k]))
            copies = [p for _, p in found.values()]
            if any(not torch.equal(copies[0].detach(), q.detach()) for q in copies[1:]):
                raise ValueError(f"tied={keys!r}: this rank's copies hold different values")
            if spans:
                spanning.append((keys, copies[0].detach().double().sum().item() if copies
                                 else 0.0))
            if copies and (len(copies) > 1 or spans):
                local.append((copies, self._topo.embedding_group if spans else None))
            for k, p in found.values():
                if k != keys[0]:  # a copy: the first key's holder counts the weight
                    chunk = next(c for c in self.chunks if k in c.state_dict(keep_vars=True))
                    chunk.tied_copies = [*getattr(chunk, "tied_copies", []), p]
        return local

    def _check_tied_across(self, spanning) -> None:
        """The copies on the first and last stage hold the same values (the embedding group's
        ranks compare checksums; the others have nothing to check)."""
        if not spanning or self._topo.embedding_group is None:
            return
        here = torch.tensor([s for _, s in spanning], dtype=torch.float64, device=self._topo.device)
        both = collectives.all_gather(here, group=self._topo.embedding_group, dim=0)
        both = both.reshape(-1, len(spanning)).cpu()
        if not torch.equal(both, both[:1].expand_as(both)):
            raise ValueError(f"tied weights {[k for k, _ in spanning]} differ between the first "
                             f"and last stage (sums {both.tolist()}): load the same values into "
                             "every copy")

    def sum_tied_grads(self, grad_of=None) -> None:
        """Give each tied weight's copies the sum of their gradients, here and across the first
        and last stage: after backward (and the dp reduction), before clipping and the optimizer
        step. ``step`` calls it (``sum_tied=True``) and ``DataParallel.step`` after its
        reduction; with gradient accumulation over several steps call it once, at the end.
        ``grad_of(p)``: the tensor to sum for copy ``p`` instead of ``p.grad`` (a ZeRO-2/3
        optimizer's ``grad_shard``, its copies isolated in buckets of their own)."""
        for params, group in self.tied:
            grads = [grad_of(p) if grad_of is not None else p.grad for p in params]
            if all(g is None for g in grads):
                raise ValueError("the tied weights' gradients are gone (a ZeRO-2/3 optimizer "
                                 "took them): build it with isolate=<the copies>, then call "
                                 "pipe.sum_tied_grads(grad_of=opt.grad_shard) after "
                                 "opt.reduce(), with Pipeline.step(sum_tied=False)")
            sum_copies(params, grads, group)

    # -- running ------------------------------------------------------------------------
    def _stage_data(self, inputs, targets):
        first = self.pp_rank == 0
        last = any(c * self.pp + self.pp_rank == self.pp * self.virtual_stages - 1
                   for c in range(self.virtual_stages))
        if first and inputs is None:
            raise ValueError("inputs is None on the first pipeline stage, which needs them")
        m, dev = self.microbatches, self._topo.device
        self._joins = []
        data = _split(inputs, m, "inputs", dev, self._joins) if first else None
        tgt = _split(targets, m, "targets", dev) if last and targets is not None else None
        return data, tgt, last

    def step(self, inputs, targets, *, before_last_backward=None,
             sum_tied: bool | None = None) -> float:
        """Forward and backward of the whole batch (``microbatches`` equal slices along dim 0)
        by the schedule; gradients accumulate into ``.parameters()``. Returns the batch's mean
        loss (the mean of the microbatch losses), the same value on every rank of the pipeline.
        ``inputs`` is needed on the first stage and ``targets`` on the last (others may pass
        ``None``). ``before_last_backward``: called just before this rank's last full backward
        (``Executor.run``; ``DataParallel.step`` passes it to reduce during that backward).
        ``sum_tied``: end with ``sum_tied_grads`` (default: when no ``before_last_backward`` is
        given; ``DataParallel.step`` passes False and sums after its reduction)."""
        data, tgt, last = self._stage_data(inputs, targets)
        if last and tgt is None:
            raise ValueError("targets is None on the last pipeline stage, which needs them")
        start = time.perf_counter()
        losses, _, records, peak = self.executor.run(
            self.actions[self.pp_rank], data, tgt, train=True,
            before_last_backward=before_last_backward)
        _join_grads(self._joins)
        if sum_tied if sum_tied is not None else before_last_backward is None:
            self.sum_tied_grads()
        loss = torch.zeros((), dtype=torch.float64, device=self._topo.device)
        if last:
            loss += torch.stack([x.double() for x in losses]).mean()
        collectives.broadcast(loss, src=self.pp_ranks[-1], group=self.group)
        self.stats = {"step_s": time.perf_counter() - start, "peak_activation_bytes": peak,
                      "records": records}
        if self.tracing:
            self._write_trace(records)
        return loss.item()

    def forward(self, inputs):
        """Inference of the whole batch (no gradients); the output on every pipeline rank."""
        data, _, last = self._stage_data(inputs, None)
        with torch.no_grad():
            _, outs, _, _ = self.executor.run(self.forward_actions[self.pp_rank], data, None,
                                              train=False)
        result = [None]
        if last:
            try:
                result[0] = (tuple(torch.cat(parts).cpu() for parts in zip(*outs))
                             if isinstance(outs[0], tuple) else torch.cat(outs).cpu())
            except Exception as exc:  # noqa: BLE001 - every rank raises it, below
                result[0] = exc
        if self.pp > 1:  # through the CPU, so that it lands on each rank's own device
            dist.broadcast_object_list(result, src=self.pp_ranks[-1], group=self.group)
        if isinstance(result[0], Exception):
            raise RuntimeError(f"Pipeline.forward: joining the last stage's outputs failed: "
                               f"{result[0]}") from result[0]
        dev = self._topo.device
        return (tuple(t.to(dev) for t in result[0]) if isinstance(result[0], tuple)
                else result[0].to(dev))

    def theoretical_bubble(self) -> float:
        return theoretical_bubble(self.schedule, self.pp, self.microbatches,
                                  self.virtual_stages)

    def _write_trace(self, records) -> None:
        from fastpar.pipeline import trace

        gathered = [None] * self.pp if self._topo.rank == self.pp_ranks[0] else None
        if self.pp > 1:
            dist.gather_object(records, gathered, dst=self.pp_ranks[0], group=self.group)
        else:
            gathered = [records]
        if gathered is None:
            return
        self.stats["bubble"] = trace.measured_bubble(gathered)
        self.stats["all_records"] = gathered
        if self._topo.rank == 0:
            meta = {"schedule": self.schedule, "pp": self.pp, "microbatches": self.microbatches,
                    "virtual_stages": self.virtual_stages,
                    "theoretical_bubble": self.theoretical_bubble()}
            trace.write(self.trace_path, gathered, meta=meta)

    # -- state ----------------------------------------------------------------------------
    def _full_state_dict(self) -> dict:
        """Collective over the world: every stage's tensors, under the serial keys, on the CPU
        (the whole model would not fit on one rank's GPU)."""
        from fastpar.state_dict import full_state_dict

        local = {}
        for chunk in self.chunks:
            local.update({k: v.cpu() for k, v in full_state_dict(chunk).items()})
        parts = [None] * self.pp
        if self.pp > 1:
            dist.all_gather_object(parts, local, group=self.group)
        else:
            parts = [local]
        merged = {}
        for p in parts:
            merged.update(p)
        order = [k for keys in self.layer_keys for k in keys]
        return {k: merged[k] for k in order if k in merged}

    def _load_full_state_dict(self, sd: dict, strict: bool = True):
        from fastpar.state_dict import load_full_state_dict

        expected = {k for keys in self.layer_keys for k in keys}
        missing = sorted(expected - sd.keys())
        unexpected = sorted(set(sd) - expected)
        if strict and (missing or unexpected):
            raise KeyError(f"load_full_state_dict(Pipeline): missing keys {missing}, "
                           f"unexpected keys {unexpected}")
        for c, chunk in enumerate(self.chunks):
            keys = set(self.stage_keys[c * self.pp + self.pp_rank])
            load_full_state_dict(chunk, {k: v for k, v in sd.items() if k in keys},
                                 strict=strict)
        return missing, unexpected

    def close(self) -> None:
        self.channels.close()
        if self.board is not None:
            self.board.close()

    def extra_repr(self) -> str:
        stages = [c * self.pp + self.pp_rank for c in range(self.virtual_stages)]
        return (f"schedule={self.schedule}, pp={self.pp}, microbatches={self.microbatches}, "
                f"virtual_stages={self.virtual_stages}, stages here={stages}, "
                f"p2p={self.channels.engine_name}")


"""``fastpar.optim.DistributedOptimizer``: ZeRO stage 1, optimizer state sharded over dp.

    model = build_model()                       # NOT wrapped in fastpar.DataParallel
    opt = fastpar.optim.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    loss_fn(model(x_local), y_local).backward() # this dp rank's slice of the batch
    norm = opt.clip_grad_norm_(1.0)             # optional: reduces, then clips
    opt.step(); sched.step(); opt.zero_grad()

Each step (``fastpar.optim.flat`` holds the layout, dp ranks r = 0..dp-1)::

    reduce:  g_shard_r = reduce_scatter(flat(param.grad))[r] / dp     # mean over dp
    update:  inner.step() on master_r (this rank's fp32 slice), using g_shard_r
    gather:  params = all_gather(master_r)                            # every rank, full model

Gradients are copied into a flat buffer and reduced in the master dtype (float32 for a
bfloat16 model). The inner optimizer (``optimizer_cls``: Adam, AdamW, SGD, ...) keeps state for
1/dp of the elements; gradients travel once as a reduce-scatter and parameters once as an
all-gather (the bytes of one all-reduce). ``group=None`` is the topology's dp group.

Gradients: the optimizer averages the plain per-rank gradients itself, so the model must not also
be wrapped in ``fastpar.DataParallel`` (its already averaged gradients would be averaged again:
harmless in value, but the all-reduce is wasted). A parameter whose ``.grad`` is None counts as a
zero gradient: its master still steps, so weight decay (AdamW, SGD's ``weight_decay``) moves a
parameter the serial optimizer would skip; an untouched Adam/SGD state without decay stays put.
"""

from __future__ import annotations

import copy
import logging
import math

import torch

from fastpar import comm
from fastpar.optim.clip import check_max_norm, clip_by_global_norm_, counted
from fastpar.optim.flat import FlatGroup
from fastpar.runtime import group_rank, group_size, topology

log = logging.getLogger("fastpar.optim")


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over the dp group; see the module docstring.

    ``params``: an iterable of tensors (one hyper-parameter group; per-group options are not
    supported); frozen ones (``requires_grad=False``) are skipped. ``optimizer_cls(masters,
    **kwargs)`` builds the inner optimizer over one flat master shard per (dtype, device).
    ``param_groups`` and ``state`` are the inner optimizer's, so ``torch.optim.lr_scheduler``
    drives it. Masters are ``float32`` (or ``float64`` for ``float64`` parameters), so a bfloat16
    model keeps full-precision weights and state.
    """

    def __init__(self, params, optimizer_cls, *, group=None, **kwargs):
        # torch.optim.Optimizer.__init__ is not called: it would build param_groups of the
        # full parameters; this class delegates them to the inner optimizer instead.
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("DistributedOptimizer takes an iterable of tensors; per-group "
                            "options (dicts) are not supported")
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("DistributedOptimizer: params must be tensors")
        seen, trainable = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append(p)
        if not trainable:
            raise ValueError("DistributedOptimizer got no trainable parameters")
        self.group = topology().dp_group if group is None else group
        self.dp_size = group_size(self.group, "DistributedOptimizer")
        self.dp_rank = group_rank(self.group, "DistributedOptimizer")
        by_key: dict[tuple, list] = {}  # (dtype, device) -> params, in order of first appearance
        for p in trainable:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        # Buffers in symmetric memory when the dp group's collectives go to shm: the gradient
        # reduce-scatter then reads every rank's buffer where it lies, and the parameter
        # all-gather copies the peers' shards straight out of theirs (no staging copies).
        alloc = None
        if comm.symmetric_available(self.group, "all_gather"):
            def alloc(numel, dtype):  # collective: every dp rank builds the same FlatGroups
                return comm.symmetric_empty(numel, dtype=dtype, group=self.group).zero_()
        self.symmetric = alloc is not None
        self.flat = [FlatGroup(ps, self.dp_size, self.dp_rank, alloc) for ps in by_key.values()]
        self.optimizer_cls, self.kwargs = optimizer_cls, dict(kwargs)
        self.inner = optimizer_cls([f.master for f in self.flat], **kwargs)
        self._reduced = False  # master grads hold this backward's reduced gradient
        log.debug("%r", self)

    # ---- what torch.optim.Optimizer users (and lr schedulers) read ------------------------------

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("DistributedOptimizer holds one flat group per dtype; build "
                                  "it with every parameter instead of adding groups")

    def __repr__(self) -> str:
        groups = "; ".join(f.describe() for f in self.flat)
        return (f"DistributedOptimizer({self.optimizer_cls.__name__}, dp={self.dp_size}, "
                f"dp_rank={self.dp_rank}, symmetric={self.symmetric}, {groups})")

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self) -> None:
        """Average the gradients over dp into this rank's master shard gradients (collective)."""
        for f in self.flat:
            g = comm.reduce_scatter(f.flat_grad(), group=self.group)  # (shard,): the dp sum
            if self.dp_size > 1:
                g = g.div_(self.dp_size)  # once, after the sum
            else:
                g = g.clone()  # dp 1 returns the reused buffer itself
            f.master.grad = g
        self._reduced = True

    @torch.no_grad()
    def update(self) -> None:
        """The inner step on the masters, then every rank's parameters from all shards."""
        self.inner.step()
        for f in self.flat:
            # (padded,); symmetric: each rank copies its peers' shards out of their buffers
            full = comm.all_gather(f.master.detach(), group=self.group, out=f.buffer("gather"))
            f.write_params(full)
        self._reduced = False

    def step(self, closure=None):
        """``reduce()`` unless ``clip_grad_norm_`` already did, then ``update()``. Call on every
        dp rank (collective)."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        if not self._reduced:
            self.reduce()
        self.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the masters'); a pending reduction is dropped."""
        for f in self.flat:
            for p in f.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self.inner.zero_grad(set_to_none=True)
        self._reduced = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        model: torch.nn.Module | None = None) -> torch.Tensor:
        """Scale the dp-averaged gradients so their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on the serial model; returns the norm before clipping
        (in the masters' dtype). Reduces first (if not yet done), so call it after backward and
        before ``step()``::

            norm = (sum over ranks of sum(w * |g_shard_r| ** p)) ** (1 / p)    # all_reduce
            g_shard_r *= min(1, max_norm / (norm + 1e-6))

        Without ``model`` the sum runs over the dp group with w = 1: right when each dp rank
        holds the whole model (no tensor or pipeline parallelism). Under TP/PP pass ``model``
        (the module holding this rank's parameters): the sum then also runs over the topology's
        mp group (tp x pp) and counts what ``fastpar.optim.clip_grad_norm_`` counts (w = 1 for
        the shards of ``fastpar.nn`` layers; for parameters replicated over tp, w = 1 on tp rank
        0 only), so each serial element counts once. Tied weights count as there: a GPT's tied
        embedding and its head's copy are two parameters, both counted, as on the serial
        ``GPT`` (see ``fastpar.optim.clip``).
        """
        check_max_norm(max_norm)
        norm_type = float(norm_type)
        if not self._reduced:
            self.reduce()
        grads = [f.master.grad for f in self.flat]
        weights, groups = [None] * len(grads), [self.group]
        if model is not None:
            keep = counted(model)
            weights = [f.shard_mask(keep) for f in self.flat]
            groups.append(topology().mp_group)
        if math.isinf(norm_type):
            local = torch.stack([(g.abs() if w is None else g.abs() * w).max().double()
                                 for g, w in zip(grads, weights)]).max().reshape(1)
        else:
            local = sum((g.double().abs().pow(norm_type) * (1.0 if w is None else w)).sum()
                        for g, w in zip(grads, weights)).reshape(1)
        total = clip_by_global_norm_(grads, local, max_norm, norm_type, groups)
        return total.to(grads[0].dtype)

    # ---- memory ------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: the inner state plus the master shards
        (about 1/dp of a serial optimizer's state plus an fp32 copy of the weights)."""
        total = sum(f.master.numel() * f.master.element_size() for f in self.flat)
        for st in self.inner.state.values():
            total += sum(t.numel() * t.element_size() for t in st.values()
                         if isinstance(t, torch.Tensor))
        return total

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state dict and the masters; loads back only
        at the same dp size (``consolidated_state_dict`` moves between sizes)."""
        return {"dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "numels": [f.numel for f in self.flat],
                "masters": [f.master.detach().clone() for f in self.flat],
                "inner": self.inner.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of ``state_dict`` (same dp size and rank, same parameters); the masters are
        restored and all-gathered into the parameters (collective)."""
        got = (state_dict["dp_size"], state_dict["dp_rank"], list(state_dict["numels"]))
        want = (self.dp_size, self.dp_rank, [f.numel for f in self.flat])
        if got != want:
            raise ValueError(f"DistributedOptimizer.load_state_dict: saved at dp_size "
                             f"{got[0]}, dp_rank {got[1]} with flat groups of {got[2]} elements; "
                             f"this optimizer has dp_size {want[0]}, dp_rank {want[1]}, "
                             f"{want[2]}; use consolidated_state_dict() to change dp size")
        self.inner.load_state_dict(copy.deepcopy(state_dict["inner"]))  # steps mutate it
        self._set_masters(list(state_dict["masters"]), sharded=True)

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict:
        """The full, unsharded state, identical on every rank (collective): per flat group the
        master weights and each per-element state tensor as ``(numel,)`` in flat order, the
        scalar state (Adam's ``step``) as is, and the hyper-parameters. Independent of dp; plain
        tensors, lists and numbers, so ``torch.load(weights_only=True)`` reads it."""
        inner = self.inner.state_dict()
        state = {}
        for i, f in enumerate(self.flat):
            st = {}
            for key, value in inner["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == f.master.shape \
                        and value.dim() == 1:
                    value = comm.all_gather(value.detach(), group=self.group)[:f.numel]
                st[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[i] = st
        masters = [comm.all_gather(f.master.detach(), group=self.group)[:f.numel].clone()
                   for f in self.flat]
        return {"numels": [f.numel for f in self.flat], "masters": masters, "state": state,
                "param_groups": inner["param_groups"]}

    @torch.no_grad()
    def load_consolidated_state_dict(self, state_dict: dict) -> None:
        """Take this rank's shard of a ``consolidated_state_dict`` saved at any dp size (the same
        parameters, in the same order); masters and parameters are set from it."""
        numels = [f.numel for f in self.flat]
        if list(state_dict["numels"]) != numels:
            raise ValueError(f"DistributedOptimizer.load_consolidated_state_dict: saved flat "
                             f"groups of {list(state_dict['numels'])} elements, this optimizer "
                             f"has {numels} (a different model or parameter order)")
        state = {}
        for i, f in enumerate(self.flat):
            st = {}
            for key, value in state_dict["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == (f.numel,) \
                        and value.dim() == 1 and key != "step":
                    value = f.local(value.to(f.master.device))
                elif isinstance(value, torch.Tensor):
                    value = value.clone()  # torch keeps it as is: the caller's dict stays intact
                st[key] = value
            state[i] = st
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._set_masters(list(state_dict["masters"]), sharded=False)

    def _set_masters(self, masters: list[torch.Tensor], sharded: bool) -> None:
        for f, m in zip(self.flat, masters):
            m = m.to(device=f.master.device, dtype=f.master.dtype)
            f.master.copy_(m if sharded else f.local(m))
            f.write_params(comm.all_gather(f.master.detach(), group=self.group))
        self._reduced = False

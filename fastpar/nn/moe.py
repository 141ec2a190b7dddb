"""Mixture-of-Experts layer with its experts sharded over an expert-parallel group.

    moe = fastpar.nn.MoE(1024, 2816, num_experts=8, top_k=2, group=ep_group, seed=0)
    y = moe(x)                                # (..., hidden) -> (..., hidden)
    loss = task_loss + moe.aux_loss           # router losses times their coefficients, with grad
    moe.last_aux["load_balancing"], moe.last_aux["z_loss"]    # unweighted, detached: to log
    moe.expert_load.min(), moe.expert_load.max(), moe.last_dropped

With T this rank's tokens (the rows of ``x.reshape(-1, hidden)``, in that order), E =
num_experts, k = top_k, n ranks in ``group`` and L = E / n experts per rank (rank r holds
experts r L .. r L + L - 1)::

    router:   logits = x @ W_r.T  (T, E) in x's dtype; from here on float32 at least
              p = softmax(logits)
              expert_tj, gate_tj = the k largest p_t (j < k, largest first)
              renormalize=True: gate_tj /= sum_j gate_tj (before any drop; computed as the
              softmax of the k chosen logits)
    expert e: fc2(gelu(fc1 x)) or down_proj(silu(gate_proj x) * up_proj x), no biases
    output:   y_t = sum_{j < k, slot (t, j) kept} gate_tj * expert_{expert_tj}(x_t)
    losses:   load_balancing = E sum_e f_e P_e    f_e = slots routed to e / (T k), before drops
                                                  P_e = mean_t p_te
              (balance="sequence": f_e, P_e and the loss per sequence x[b] of an input
              (B, ..., hidden), then the mean over the B sequences: each sequence's loss depends
              on it alone, so a batch cut into other microbatches or over other ranks has the
              same mean; "tokens", the default: over this rank's T tokens at once)
              z_loss = mean_t logsumexp(logits_t)^2
              aux_loss = aux_loss_coef * load_balancing + z_loss_coef * z_loss

Both losses are over this rank's tokens (no communication); ``aux_loss`` carries their gradient
into the router, so a trainer adds it to its loss after each forward, or, where the loss is
computed elsewhere (a pipeline's last stage), ties it to the output with ``with_aux_loss(y,
moe.aux_loss, scale)``: y unchanged, and backward through y also backpropagates scale x aux_loss.

Capacity (``capacity_factor=None``: dropless). Each rank keeps at most ``C = ceil(capacity_factor
* T k / E)`` slots per expert, T being this rank's own tokens (so an expert receives at most
``n C`` rows). The drop rule: an expert's slots queue by choice, then by token order within the
rank (every token's first choice, in token order, then every token's second choice, ...), and
the slots past the first C are dropped. A dropped slot adds nothing to y, so a token whose every
slot is dropped gets y_t = 0 and the caller's residual carries it.

The parallel forward (the backward is autograd's through the same steps)::

    dispatch: slots sorted by expert (stably: the queue order above), dropped ones removed; the
              kept slots' counts per (rank, local expert) go to each rank in a small all_to_all,
              then the rows x_t themselves with comm.all_to_all_rows (backward: the transposed
              exchange, so each expert's gradient sums over the tokens of every rank of group)
    experts:  the received rows, padded per local expert to the largest count C_max, go through
              the L experts as one torch.bmm per weight: (L, C_max, hidden) @ (L, hidden, ffn)
    combine:  the expert outputs go back with the reverse all_to_all_rows; y = index_add over
              the slots of gate * output (the sum over top-k, in float32 at least)

The counts are read on the host (C_max, the exchange's row counts, the dropped count): every
forward syncs the device with the host. ``comm.all_to_all_v_device`` moves rows without a sync,
padded to a bound.

Initialisation (the contract of ``fastpar.nn.sharding``): the serial layer is an ``nn.Linear(
hidden, E, bias=False)`` router, then E bias-free ``fastpar.testing.SerialMLP``s, all drawn in
that order from the stream of ``seed``; every rank draws them all and keeps its L experts, so
the layer at any n is the same layer. The router is replicated (the same on every rank).
Expert weights are stacked as ``(L, in, out)``: ``experts.fc1[l]`` is expert r L + l's
``fc1.weight.T``, so the state dict is the serial layer's (n = 1) with dim 0 of every expert
tensor sharded (``experts.shard_dims``; ``fastpar.full_state_dict`` gathers it over ``group``).

Data parallelism: an expert's weights live on one rank of ``group`` and its gradient already sums
the tokens of every rank of ``group``, so data parallel must reduce expert gradients over the
ranks that hold the same experts (the expert-data-parallel group), not over the dp group (a
mean divides that sum by every rank whose tokens it covers: that group's size times n). Every
expert parameter carries ``param.expert_parallel = True`` to say so; the router's does not (it
is replicated, and its gradient holds this rank's tokens only, like any replicated weight's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm import all_to_all
from fastpar.comm.autograd import all_to_all_rows
from fastpar.nn.sharding import ShardedModule, full_linear, generator
from fastpar.runtime import group_rank, group_size

_WEIGHTS = {"gelu": ("fc1", "fc2"), "swiglu": ("gate_proj", "up_proj", "down_proj")}


class GroupedExperts(ShardedModule):
    """This rank's L experts as stacked ``(L, in, out)`` weights (see the module docstring),
    run as one batched GEMM per weight over ``(L, C, hidden)`` inputs (C rows per expert)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, activation: str,
                 group, *, device=None, dtype=None, gen=None):
        super().__init__()
        self.group, self.activation = group, activation
        ep = 1 if group is None else group_size(group)
        self.num_experts, self.local_experts = num_experts, num_experts // ep
        self.first_expert = self.local_experts * (0 if group is None else group_rank(group))
        names = _WEIGHTS[activation]
        # (in, out) of each weight: every one but the last maps hidden -> ffn
        shapes = [(hidden_size, ffn_hidden_size)] * (len(names) - 1) \
            + [(ffn_hidden_size, hidden_size)]
        for name, (fan_in, fan_out) in zip(names, shapes):
            self.register_parameter(name, nn.Parameter(torch.empty(
                self.local_experts, fan_in, fan_out, device=device, dtype=dtype)))
        self.shard_dims = {name: 0 for name in names} if ep > 1 else {}
        if not getattr(self, names[0]).is_meta:
            self._draw(names, shapes, gen)
        self._mark()

    @torch.no_grad()
    def _draw(self, names, shapes, gen) -> None:
        """Every expert in order, each as the serial ``nn.Linear`` weights (out, in) in the MLP's
        order; this rank keeps its own, transposed."""
        for e in range(self.num_experts):
            drawn = [full_linear(fan_out, fan_in, False, gen)[0] for fan_in, fan_out in shapes]
            local = e - self.first_expert
            if 0 <= local < self.local_experts:
                for name, weight in zip(names, drawn):
                    getattr(self, name)[local].copy_(weight.t())

    def _mark(self) -> None:
        for p in self.parameters(recurse=False):
            p.expert_parallel = True

    # A Parameter's attributes are lost where torch makes a new Parameter: a conversion that
    # cannot reuse it (to_empty from meta) and deepcopy / unpickling. Mark again after both.
    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._mark()
        return out

    def __setstate__(self, state):
        super().__setstate__(state)
        self._mark()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (L, C, hidden) -> (L, C, hidden); expert l on ``x[l]``."""
        if self.activation == "gelu":
            h = F.gelu(torch.bmm(x, self.fc1))  # (L, C, ffn)
            return torch.bmm(h, self.fc2)
        h = F.silu(torch.bmm(x, self.gate_proj)) * torch.bmm(x, self.up_proj)  # (L, C, ffn)
        return torch.bmm(h, self.down_proj)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of "
                f"{self.num_experts}, activation={self.activation}")


class MoE(nn.Module):
    """Top-k routed experts, sharded over ``group`` (see the module docstring for the math).

    ``group``: the expert-parallel group. ``None`` (unlike the tp layers, where it means the tp
    group) is no expert parallelism: every expert on this rank, no communication and no
    ``fastpar.init`` needed, as with a group of one rank.
    ``capacity_factor``: ``None`` for dropless, else the per-rank capacity and drop rule of the
    module docstring. ``activation``: "gelu" or "swiglu" (as ``ParallelMLP``). ``renormalize``:
    scale each token's k gates to sum to 1 (default off: the gates are the softmax
    probabilities, so with k = 1 the main loss still trains the router). ``seed``: as for every
    ``fastpar.nn`` layer.

    After each forward (``None`` before the first; each forward replaces them, so read them
    before the next, e.g. per pipeline microbatch):

    * ``aux_loss``: 0-dim tensor with grad, ``aux_loss_coef * load_balancing + z_loss_coef *
      z_loss`` (defaults 1e-2 and 1e-3, Switch's and ST-MoE's);
    * ``last_aux``: ``{"load_balancing": ..., "z_loss": ...}``, unweighted, detached;
    * ``expert_load``: int64 (num_experts,), this rank's slots routed to each expert before
      drops (sum it over ranks for the global load);
    * ``last_dropped``: int, this rank's slots dropped by the capacity (0 when dropless).

    ``phase_hook`` (``None``: off, one attribute test per phase): a callable ``hook(phase,
    tensor)`` the forward calls as each phase ends, for timing (``bench/moe.py``), with
    ``tensor`` the phase's result that the next phase takes (``None`` where it has none):
    "route" (router, top-k, losses, the sort by expert: None), "permute" (the rows in expert
    order), then at ep > 1 only "counts" (their exchange: None) and "a2a_out" (the received
    rows), "experts" (their outputs), at ep > 1 "a2a_back" (the outputs back here), and
    "unpermute" (the gate-weighted sum over the k choices: the layer's output).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 group=None, capacity_factor: float | None = None, activation: str = "gelu",
                 renormalize: bool = False, aux_loss_coef: float = 1e-2,
                 z_loss_coef: float = 1e-3, balance: str = "tokens", device=None, dtype=None,
                 seed=None):
        super().__init__()
        if activation not in _WEIGHTS:
            raise ValueError(f"MoE: activation must be 'gelu' or 'swiglu', got {activation!r}")
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive integer, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"MoE: top_k {top_k} is larger than num_experts {num_experts}")
        if balance not in ("tokens", "sequence"):
            raise ValueError(f"MoE: balance must be 'tokens' or 'sequence', got {balance!r}")
        self.balance = balance
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be positive or None (dropless), got "
                             f"{capacity_factor!r}")
        self.ep = 1 if group is None else group_size(group, "MoE")
        if num_experts % self.ep:
            raise ValueError(f"MoE: num_experts {num_experts} is not divisible by the "
                             f"expert-parallel size {self.ep} (the ranks of group)")
        self.group = group
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.local_experts = num_experts // self.ep
        self.capacity_factor, self.renormalize = capacity_factor, renormalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        gen = generator(seed)
        # skip_init: nn.Linear's own draw would advance the stream; full_linear draws in its place
        self.router = torch.nn.utils.skip_init(
            nn.Linear, hidden_size, num_experts, bias=False, dtype=dtype,
            device=torch.get_default_device() if device is None else device)
        if not self.router.weight.is_meta:
            with torch.no_grad():
                self.router.weight.copy_(full_linear(num_experts, hidden_size, False, gen)[0])
        self.experts = GroupedExperts(hidden_size, ffn_hidden_size, num_experts, activation,
                                      group, device=device, dtype=dtype, gen=gen)
        self.aux_loss: torch.Tensor | None = None
        self.last_aux: dict[str, torch.Tensor] | None = None
        self.expert_load: torch.Tensor | None = None
        self.last_dropped: int | None = None
        self.phase_hook = None

    def __getstate__(self):
        # The last forward's results are not part of a copy (deepcopy, pickle): aux_loss is a
        # non-leaf tensor, which deepcopy refuses.
        state = dict(self.__dict__)
        state.update(aux_loss=None, last_aux=None, expert_load=None, last_dropped=None,
                     phase_hook=None)
        return state

    def capacity(self, tokens: int) -> int | None:
        """Slots kept per expert for ``tokens`` tokens on this rank (``None``: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: the input's last dim is {x.shape[-1]}, hidden_size is "
                             f"{self.hidden_size} (input shape {tuple(x.shape)})")
        tokens = x.reshape(-1, self.hidden_size)  # (T, hidden)
        t, k, e = tokens.shape[0], self.top_k, self.num_experts
        wide = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(tokens, self.router.weight).to(wide)  # (T, E)
        probs = logits.softmax(-1)
        gate, chosen = probs.topk(k, dim=-1)  # (T, k) each, largest first
        if self.renormalize:  # p_tj / sum_j p_tj, as a softmax: at k = 1 exactly 1, no gradient
            gate = logits.gather(1, chosen).softmax(-1)
        # Slot s = j T + t is token t's choice j: sorting by expert stably queues an expert's
        # slots by choice, then token (the drop rule).
        slot_expert = chosen.t().reshape(-1)  # (k T,)
        order = torch.argsort(slot_expert, stable=True)
        load = torch.bincount(slot_expert, minlength=e)  # (E,)
        self._router_losses(logits, probs, chosen, load, x.shape[0] if x.dim() > 2 else 1, t)
        capacity = self.capacity(t)
        kept = load if capacity is None else load.clamp(max=capacity)
        if capacity is not None:
            queued = torch.arange(k * t, device=x.device) - (load.cumsum(0) - load)[
                slot_expert[order]]  # place of each sorted slot in its expert's queue
            order = order[queued < capacity]
        self.expert_load = load.detach()
        self.last_dropped = 0 if capacity is None else k * t - int(kept.sum())
        token, choice = order % max(t, 1), order // max(t, 1)  # (S,) kept slots, by expert
        hook = self.phase_hook
        if hook is not None:
            hook("route", None)
        rows = tokens[token]  # (S, hidden)
        if hook is not None:
            hook("permute", rows)
        out = self._experts(rows, kept)  # (S, hidden)
        weighted = out.to(wide) * gate[token, choice].unsqueeze(1)
        y = torch.zeros((t, self.hidden_size), dtype=wide, device=x.device)
        y = y.index_add(0, token, weighted).to(x.dtype).reshape(x.shape)
        if hook is not None:
            hook("unpermute", y)
        return y

    def _router_losses(self, logits, probs, chosen, load, sequences, t) -> None:
        if self.balance == "sequence" and sequences > 1 and t:
            e, per = self.num_experts, t // sequences  # tokens are rows of x: sequence-major
            counts = torch.zeros(sequences, e, dtype=probs.dtype, device=probs.device)
            counts.scatter_add_(1, chosen.view(sequences, per * self.top_k),
                                torch.ones(sequences, per * self.top_k, dtype=probs.dtype,
                                           device=probs.device))
            f = counts / (per * self.top_k)  # (B, E)
            p_mean = probs.view(sequences, per, e).sum(1) / per  # (B, E)
            balance = e * (f * p_mean).sum(1).mean()
        else:
            f = load.to(probs.dtype) / max(t * self.top_k, 1)  # (E,) fraction of slots, no grad
            p_mean = probs.sum(0) / max(t, 1)  # (E,)
            balance = self.num_experts * (f * p_mean).sum()
        z = torch.logsumexp(logits, -1).square().sum() / max(t, 1)
        self.aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z
        self.last_aux = {"load_balancing": balance.detach(), "z_loss": z.detach()}

    def _experts(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (``kept[e]`` for expert e) through their experts, wherever
        they live; returns the outputs in the same order."""
        n, per, hook = self.ep, self.local_experts, self.phase_hook
        sent = kept.view(n, per)  # [rank j, local expert l]: rows for j's l-th expert
        if n == 1:
            out = self._local(rows, sent)
            if hook is not None:
                hook("experts", out)
            return out
        got = all_to_all(sent, self.group)  # [source rank i, l]: rows i sends my l-th expert
        send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
        if hook is not None:
            hook("counts", None)
        received = all_to_all_rows(rows, self.group, send, recv)  # (sum recv, hidden)
        if hook is not None:
            hook("a2a_out", received)
        out = self._local(received, got)
        if hook is not None:
            hook("experts", out)
        out = all_to_all_rows(out, self.group, recv, send)
        if hook is not None:
            hook("a2a_back", out)
        return out

    def _local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` in blocks (source i, local expert l), ``counts[i, l]`` rows each, through
        the local experts as one padded batch; returns the outputs in the same order."""
        n, per = counts.shape
        dev, (r, h) = rows.device, rows.shape
        c_max = int(counts.sum(0).max())
        blocks = counts.reshape(-1)  # (n L,) in row order
        block_expert = torch.arange(per, device=dev).repeat(n)
        earlier = (counts.cumsum(0) - counts).reshape(-1)  # rows of expert l from sources < i
        block_start = blocks.cumsum(0) - blocks
        block = torch.repeat_interleave(torch.arange(n * per, device=dev), blocks, output_size=r)
        # row -> (its expert, its place among that expert's rows) in the padded batch
        slot = block_expert[block] * c_max + earlier[block] \
            + torch.arange(r, device=dev) - block_start[block]
        padded = rows.new_zeros(per * c_max, h).index_copy(0, slot, rows)
        out = self.experts(padded.view(per, c_max, h))  # (L, C_max, hidden)
        return out.reshape(per * c_max, h)[slot]

    def extra_repr(self) -> str:
        cap = "dropless" if self.capacity_factor is None else \
            f"capacity_factor={self.capacity_factor}"
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts} ({self.local_experts} per rank, ep={self.ep}), "
                f"top_k={self.top_k}, {cap}, renormalize={self.renormalize}, "
                f"balance={self.balance}, "
                f"aux_loss_coef={self.aux_loss_coef}, z_loss_coef={self.z_loss_coef}")


class _WithAux(torch.autograd.Function):
    """y unchanged; backward gives ``aux`` the gradient ``scale`` (as if ``scale * aux`` had
    been added to the loss)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        shape, dtype, device = ctx.aux_meta
        return dy, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def with_aux_loss(y: torch.Tensor, aux: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    """``y``, such that backward through it also backpropagates ``scale * aux`` (a 0-dim loss
    with grad, e.g. ``MoE.aux_loss``): the router losses of a layer whose output reaches the loss
    through other code (a pipeline's later stages). ``scale``: the weight the loss this output
    feeds gets (a pipeline divides each microbatch's loss by the microbatches). Without grad, or
    with ``aux`` None, ``y`` itself."""
    if aux is None or not torch.is_grad_enabled() or not aux.requires_grad:
        return y
    return _WithAux.apply(y, aux, float(scale))

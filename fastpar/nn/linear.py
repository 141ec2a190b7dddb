"""Column- and row-parallel linear layers (Megatron-LM's two halves of a TP region).

With ``n`` ranks in the TP group and ``W`` the serial ``(out, in)`` weight::

    ColumnParallelLinear  W_n = W.chunk(n, 0)[rank]     (out/n, in)
        forward: y_n = x @ W_n.T + b_n            (gather_output: y = all_gather(y_n, -1))
        dgrad:   dx = all_reduce(dy_n @ W_n)      wgrad: dW_n = dy_n.T @ x
    RowParallelLinear     W_n = W.chunk(n, 1)[rank]     (out, in/n)
        forward: y = all_reduce(x_n @ W_n.T) + b  (bias added once, after the reduction)
        dgrad:   dx_n = dy @ W_n                  wgrad: dW_n = dy.T @ x_n

Sequence parallelism (``sequence_parallel=True``): outside the TP region activations are sharded
along ``sequence_dim``; the column layer all-gathers its input (reduce-scatter in backward) and
the row layer reduce-scatters its output (all-gather in backward) instead of the all-reduces.

Overlap (``fastpar/nn/overlap.py``): ``overlap=True`` cuts the GEMM into ``overlap_pieces`` pieces
along the tokens and runs each piece's collective while the next computes, and runs the column
layer's dgrad collective behind its wgrad GEMM; ``overlap=None`` lets ``overlap.decide`` choose
from the device, the engine and the sizes. ``layer.overlap_decision`` (and ``extra_repr``) says
what the last forward did and why. (``chunks=``, the old name of ``overlap_pieces=``, is
deprecated: in fastpar ``chunks`` means the pipeline's model chunks.)
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm.autograd import (all_gather_sequence, copy_to_tp, gather_from_tp,
                                   reduce_from_tp, reduce_scatter_sequence, scatter_to_tp)
from fastpar.nn import overlap as ov
from fastpar.nn.sharding import (ShardedModule, copy_into, copy_replicated, full_linear, generator,
                                 resolve_group)
from fastpar.runtime import group_size

# The decision inside a graph torch.compile traces: the collective runs whole, in the graph.
TRACED = ov.Decision(False, 1, "traced by torch.compile: the collectives run in the graph")


def check_overlap(overlap, overlap_pieces) -> None:
    if overlap not in (None, True, False):
        raise ValueError(f"overlap must be True, False or None (the policy decides), got "
                         f"{overlap!r}")
    if overlap_pieces is not None and (isinstance(overlap_pieces, bool)
                                       or not isinstance(overlap_pieces, int)
                                       or overlap_pieces < 1):
        raise ValueError(f"overlap_pieces must be a positive integer or None, got "
                         f"{overlap_pieces!r}")


def pieces_argument(overlap_pieces, chunks, layer: str):
    """A layer's ``overlap_pieces``, given as such or by its deprecated name ``chunks=``
    (a DeprecationWarning at the caller's line; both: a ValueError naming both values). Called
    by each public constructor, so that the warning points at the user's code."""
    if chunks is None:
        return overlap_pieces
    if overlap_pieces is not None:
        raise ValueError(f"{layer}: got chunks={chunks!r} and overlap_pieces={overlap_pieces!r};"
                         f" chunks= is the deprecated name of overlap_pieces=, pass only that")
    warnings.warn(f"{layer}(chunks={chunks!r}) is deprecated, use overlap_pieces={chunks!r} "
                  "(chunks= will be removed in the next release; in fastpar chunks are the "
                  "pipeline's model chunks)", DeprecationWarning, stacklevel=3)
    return chunks


def _forced() -> str | None:
    from fastpar.comm.state import current

    return current().forced


def _engine(group, op: str, device: str, nbytes: int, dtype) -> str:
    """The engine the comm policy gives ``op`` of ``nbytes`` on ``group`` (creates nothing)."""
    from fastpar.comm.state import current

    st = current()
    _, _, facts = st.resolve(group)
    try:
        return st.decide(op, device, facts, nbytes, dtype).engine
    except ValueError:  # a forced engine that cannot serve it: the call itself will say so
        return str(st.forced)


class _ParallelLinear(ShardedModule):
    # "linear": the weight is nn.Linear's (out, in); "conv1d": Hugging Face's Conv1D (GPT-2),
    # stored (in, out) and computed as its transpose (fastpar/nn/fused.py's layers)
    layout = "linear"

    def __init__(self, in_features, out_features, bias, sharded_dim, *, sequence_parallel,
                 sequence_dim, overlap, overlap_pieces, group, device, dtype, seed):
        super().__init__()
        check_overlap(overlap, overlap_pieces)
        self.group = resolve_group(group)
        self.tp = group_size(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.overlap, self.overlap_pieces = overlap, overlap_pieces
        self.overlap_decision: ov.Decision | None = None  # the last forward's
        self._decision_key = None
        self._signal_key, self._signal_comm = None, None  # RowParallelLinear._signal's answer
        size = (out_features, in_features)[sharded_dim]
        if size % self.tp:
            kind = ("out_features", "in_features")[sharded_dim]
            raise ValueError(f"{type(self).__name__}: {kind} {size} is not divisible by the "
                             f"tensor-parallel size {self.tp}")
        shape = [out_features, in_features]
        shape[sharded_dim] //= self.tp
        factory = {"device": device, "dtype": dtype}
        bias_shape = shape[0]
        conv1d = self.layout == "conv1d"
        self.weight = nn.Parameter(torch.empty(shape[::-1] if conv1d else shape, **factory))
        self.shard_dims = {"weight": 1 - sharded_dim if conv1d else sharded_dim}
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_shape, **factory))
            if sharded_dim == 0:
                self.shard_dims["bias"] = 0
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            weight, b = full_linear(out_features, in_features, bias, generator(seed))
            copy_into(self.weight, self.shard_full("weight", weight.t() if conv1d else weight))
            if bias:
                copy_into(self.bias, self.shard_full("bias", b))

    @property
    def linear_weight(self) -> torch.Tensor:
        """This rank's weight as ``F.linear`` takes it, (out, in): the weight, or a Conv1D
        layout's transpose (a view: its gradient reaches the weight)."""
        return self.weight.t() if self.layout == "conv1d" else self.weight

    @classmethod
    def from_serial(cls, linear: nn.Module, group=None, **kwargs):
        """A parallel layer holding this rank's shard of ``linear``'s weights (an nn.Linear, or
        for the Conv1D layout Hugging Face's Conv1D: ``nx`` in, ``nf`` out)."""
        if cls.layout == "conv1d":
            features = (linear.nx, linear.nf)
        else:
            features = (linear.in_features, linear.out_features)
        layer = cls(*features, linear.bias is not None,
                    group=group, device="meta", dtype=linear.weight.dtype, **kwargs)
        layer.to_empty(device=linear.weight.device)
        copy_into(layer.weight, layer.shard_full("weight", linear.weight.detach()))
        layer.weight.requires_grad_(linear.weight.requires_grad)  # frozen stays frozen
        if linear.bias is not None:
            copy_into(layer.bias, layer.shard_full("bias", linear.bias.detach()))
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def _seq_dim(self, x: torch.Tensor) -> int:
        return self.sequence_dim % x.dim()

    def _decide(self, x: torch.Tensor, op: str, features: int) -> ov.Decision:
        """The overlap decision for an input like ``x`` whose collective is ``op`` over
        ``features`` per full-sequence token; kept per input shape, logged when it changes."""
        if torch.compiler.is_compiling():  # no overlap in a traced graph (nor state to keep)
            return TRACED
        # the forced engine too: comm.use_backend() between two calls changes the engine
        forced = _forced() if self.tp > 1 else None
        autocast = torch.is_autocast_enabled(x.device.type)
        key = (tuple(x.shape), x.dtype, x.device.type, forced, autocast, self.overlap,
               self.overlap_pieces)
        if key != self._decision_key:
            # the all-gather of a column layer under SP sends tp x its input's tokens
            tokens = x.numel() // x.shape[-1] * (self.tp if op == "all_gather" else 1)
            nbytes = tokens * features * x.element_size()
            device = x.device.type
            engine = _engine(self.group, op, device, nbytes, x.dtype) if self.tp > 1 else "local"
            decision = ov.decide(self.overlap, self.overlap_pieces, tp=self.tp, device=device,
                                 engine=engine, nbytes=nbytes, autocast=autocast)
            if decision != self.overlap_decision:
                ov.log.debug("%s(%d -> %d, tp %d) on input %s: overlap %s", type(self).__name__,
                             self.in_features, self.out_features, self.tp, tuple(x.shape),
                             decision)
            self.overlap_decision, self._decision_key = decision, key
        return self.overlap_decision

    def extra_repr(self) -> str:
        said = (f"overlap={self.overlap}, overlap_pieces={self.overlap_pieces}"
                if self.overlap_decision is None else f"overlap: {self.overlap_decision}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp}, "
                f"sequence_parallel={self.sequence_parallel}, {said}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split along out_features; see the module docstring.

    ``gather_output=False`` leaves ``y`` sharded along its last dim (the input of a
    ``RowParallelLinear``); True all-gathers it (replicated, not sequence-sharded).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, overlap=None, overlap_pieces=None, group=None,
                 device=None, dtype=None, seed=None, chunks=None):
        overlap_pieces = pieces_argument(overlap_pieces, chunks, type(self).__name__)
        super().__init__(in_features, out_features, bias, 0, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim, overlap=overlap,
                         overlap_pieces=overlap_pieces, group=group, device=device, dtype=dtype,
                         seed=seed)
        self.gather_output = gather_output

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the TP region sees it: full sequence, gradients summed over the group.
        Blocks that feed one input to several column layers call it once and use ``local``."""
        if self.sequence_parallel:
            return all_gather_sequence(x, self.group, self.sequence_dim)
        return copy_to_tp(x, self.group)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output shard of an input already inside the TP region."""
        return F.linear(x, self.linear_weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared_forward(x, [self])[0]
        return gather_from_tp(y, self.group) if self.gather_output else y

    @staticmethod
    def shared_forward(x: torch.Tensor, layers: list) -> list[torch.Tensor]:
        """Each layer's output shard for one input (q, k, v; gate, up): the input enters the
        TP region once, overlapped with the GEMMs when the first layer's decision says so (the
        layers share its group, sequence parallelism and decision)."""
        first = layers[0]
        op = "all_gather" if first.sequence_parallel else "all_reduce"
        decision = first._decide(x, op, first.in_features)
        for layer in layers[1:]:
            layer.overlap_decision = decision
        if decision.enabled:
            params = [layer.linear_weight for layer in layers] + [layer.bias for layer in layers]
            return list(ov.ColumnParallelOverlap.apply(
                x, first.group, first.sequence_parallel, first._seq_dim(x), decision.pieces,
                len(layers), *params))
        x = first.enter(x)
        return [layer.local(x) for layer in layers]


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split along in_features; see the module docstring.

    ``input_is_parallel=True``: ``x`` is already this rank's shard of its last dim (the output of
    a ``ColumnParallelLinear``); False scatters a replicated ``x`` first.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1, overlap=None, overlap_pieces=None, group=None,
                 device=None, dtype=None, seed=None, chunks=None):
        overlap_pieces = pieces_argument(overlap_pieces, chunks, type(self).__name__)
        super().__init__(in_features, out_features, bias, 1, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim, overlap=overlap,
                         overlap_pieces=overlap_pieces, group=group, device=device, dtype=dtype,
                         seed=seed)
        self.input_is_parallel = input_is_parallel

    def _signal(self, x: torch.Tensor, decision: ov.Decision):
        """The communicator of the signal-driven forward, or None; the decision records which
        and why (CUDA inputs only: on CPU there is nothing to ask)."""
        if not x.is_cuda:
            return None
        from fastpar.comm.state import current

        key = (self._decision_key, id(current()))  # a new job (shutdown, init) asks again
        if self._signal_key == key:  # asked already for inputs like this one
            return self._signal_comm
        from fastpar.nn.overlap_signal import signal_path

        comm, said = signal_path(x, self.linear_weight, self.group, self.sequence_parallel)
        self._signal_key, self._signal_comm = key, comm
        if said != decision.signal:
            self.overlap_decision = dataclasses.replace(decision, signal=said)
            ov.log.debug("RowParallelLinear(%d -> %d): %s", self.in_features, self.out_features,
                         said)
        return comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = "reduce_scatter" if self.sequence_parallel else "all_reduce"
        decision = self._decide(x, op, self.out_features)
        weight = self.linear_weight
        if self.tp == 1:
            return F.linear(x, weight, self.bias)
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        if decision.enabled:
            signal = self._signal(x, decision)
            y = ov.RowParallelOverlap.apply(x, weight, self.group, self.sequence_parallel,
                                            self._seq_dim(x), decision.pieces, signal)
        elif self.sequence_parallel:
            y = reduce_scatter_sequence(F.linear(x, weight), self.group, self.sequence_dim)
        else:
            # The matmul output is fresh and saved by nobody, so it is reduced in place.
            y = reduce_from_tp(F.linear(x, weight), self.group, inplace=True)
        if self.sequence_parallel:
            # The bias is replicated but meets only this rank's tokens: sum its grad over ranks
            # (in float32 for a bf16 bias).
            bias = None if self.bias is None else copy_replicated(self.bias, self.group)
        else:
            bias = self.bias
        return y if bias is None else y + bias

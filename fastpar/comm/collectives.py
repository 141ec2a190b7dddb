"""Raw collectives: ``fastpar.comm.all_reduce`` & co., each served by the engine the policy picks.

Every call returns its result tensor, or with ``async_op=True`` a ``Handle``: ``wait()`` returns
the result, and the handle unpacks as the raw ``(tensor, handle)`` pair for overlap. Synchronous
engines (shm, mpi) complete before the handle is returned; torch.distributed engines (gloo,
NCCL) really run in the background, non-contiguous inputs included (the result is copied back
into the input's layout in ``wait()``).

``group=None`` means the world (``torch.distributed.group.WORLD``) here, as in
torch.distributed. (The layers of ``fastpar.nn`` take ``group=None`` to mean the topology's tp
group; the autograd collectives take no ``None`` at all.) ``op``: "sum", "max", "min", "prod" or
the ``torch.distributed.ReduceOp`` of the same name.

``quant="int8"`` (all_reduce, all_gather, reduce_scatter; or a ``comm.Quant`` for another block)
sends block-scaled int8 instead of the tensor's own bytes: float32 and bfloat16 tensors, sums
only, float32 accumulation (``fastpar.comm.quant`` defines the codec, ``fastpar.comm.quantized``
and ``hierarchical`` where each engine quantizes). ``residual=`` (all_reduce, reduce_scatter): a
float32 tensor of the input's shape carrying the rounding error from call to call (error
feedback). A group of one rank sends nothing and quantizes nothing.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fastpar.comm import policy, quantized
from fastpar.comm import quant as quant_codec
from fastpar.comm import routing
from fastpar.comm.engines import functional
from fastpar.comm.routing import check_tensor, choose, is_avg, op_name
from fastpar.comm.state import current

log = logging.getLogger("fastpar.comm")


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and returns the result.

    ``result`` is the output tensor itself, allocated up front and valid once ``wait()``
    returns, so a handle also unpacks as the raw pair: ``out, handle = all_gather(x,
    async_op=True)``; compute that does not read ``out``; ``handle.wait()``.
    """

    def __init__(self, result: torch.Tensor, work=None, finish=None):
        self.result, self._work, self._finish = result, work, finish

    def __iter__(self):
        return iter((self.result, self))

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._finish is not None:  # fills self.result in place (a layout change)
                self._finish()
                self._finish = None
        return self.result

    def is_completed(self) -> bool:
        """Whether ``result`` holds the result: once the work is done, the step that fills the
        result from it (a layout change, a decode) runs here, so True means it may be read
        without ``wait()``."""
        if self._work is not None:
            if not self._work.is_completed():
                return False
            self.wait()  # done: this only runs the finishing step
        return True


def use_backend(name: str | None) -> str | None:
    """Force one engine for this job's following calls (``None``: the policy decides again), as
    ``FASTPAR_COMM_BACKEND`` does from the environment; returns the previous setting."""
    if name is not None and name not in policy.ENGINES:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(policy.ENGINES)}")
    st = current()
    previous, st.forced, st.forced_by = st.forced, name, "comm.use_backend"
    return previous


def engine_for(name: str, t: torch.Tensor, group=None, op="sum") -> tuple[str, str]:
    """``(engine, reason)``: what collective ``name`` ("all_reduce", ...) of ``t`` on ``group``
    would take now. Communicates nothing, except that a CUDA all_reduce first builds the
    group's CUDA IPC communicator (collective over the group) as a call would."""
    check_tensor(name, t)
    choice = choose(name, t, group, op_name(op))[2]
    return choice.engine, choice.reason


def _averaged(got, out: torch.Tensor, group):
    """``got`` (a result ``out`` or a ``Handle`` of it) divided by the group's size: now, or
    once the handle is waited for (integers rounded toward zero)."""
    n = dist.get_world_size(group)

    def divide():
        if out.is_floating_point() or out.is_complex():
            out.div_(n)
        else:
            out.div_(n, rounding_mode="trunc")

    if isinstance(got, Handle):
        return Handle(out, got, divide)
    divide()
    return out


def _check_dim(name: str, t: torch.Tensor, dim: int) -> int:
    """``dim`` made non-negative; ``IndexError`` naming the shape when it is out of range."""
    if not -t.dim() <= dim < t.dim():
        raise IndexError(f"{name}: dim {dim} is out of range for a tensor of shape "
                         f"{tuple(t.shape)} ({t.dim()} dims)")
    return dim % t.dim()


def _quant(name: str, t: torch.Tensor, op, quant, residual=None):
    """The ``Quant`` of a call (None: full precision), its arguments checked."""
    spec = quant_codec.spec(quant)
    if spec is None:
        if residual is not None:
            raise ValueError(f"{name}: residual= (error feedback) needs quant=")
        return None
    if t.dtype not in quant_codec.DTYPES:
        raise ValueError(f"{name}: quant={spec.kind!r} takes float32 or bfloat16 tensors, got "
                         f"{t.dtype}")
    if op is not None and op_name(op) != "sum":
        raise ValueError(f"{name}: quant={spec.kind!r} reduces by sum only, got op={op!r}")
    if residual is not None and (
            not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or
            residual.shape != t.shape or residual.device != t.device or
            not residual.is_contiguous()):
        got = (f"{residual.dtype} {tuple(residual.shape)} on {residual.device}"
               if isinstance(residual, torch.Tensor) else type(residual).__name__)
        raise ValueError(f"{name}: residual must be a contiguous float32 tensor of the input's "
                         f"shape {tuple(t.shape)} on {t.device}; got {got}")
    return spec


def _quant_route(name: str, t: torch.Tensor, group, op, spec):
    """``(route, spec)`` of a quantized call: its engine moves bytes (an all-gather or all-to-all
    of int8 pieces), so it is chosen as for an all_gather of t's bytes (MPI carries them for a
    bfloat16 tensor too; a group across hosts takes the hierarchical engine). Where the policy
    says int8 does not pay (``policy.quantizes``: small calls within a host, CUDA tensors within
    a node, a bfloat16 all_reduce across hosts), the call's own full-precision route and spec
    None."""
    flat = t.reshape(-1)
    as_bytes = flat.view(torch.uint8) if flat.is_contiguous() else \
        torch.empty(flat.numel() * flat.element_size(), dtype=torch.uint8, device=t.device)
    route = routing.route("all_gather", as_bytes, group)
    st = current()
    yes, why = policy.quantizes(name, route.engine, t.numel() * t.element_size(), t.dtype,
                                device=t.device.type,
                                same_host=st.resolve(route.group)[2].same_host, forced=st.forced)
    if yes:
        return route, spec
    log.debug("%s quant=%r on global ranks %s: %s", name, spec.kind, route.ranks, why)
    if name == "all_gather":
        return routing.route(name, t, group), None
    return routing.route(name, t, group, op), None


def _routed(name: str, t: torch.Tensor, group, op, quant, residual):
    """``(route, spec, t)`` of an all_reduce or reduce_scatter: full precision (spec None) when
    no ``quant`` is asked or the policy skips it; in the latter case what error feedback
    carried is sent now, added to t in float32 (in place for all_reduce, whose t is its result;
    a new tensor otherwise), and the residual keeps only what t's dtype could not hold of the
    sum (zeros for float32; a bfloat16 tensor's rounding, carried on to the next call)."""
    if quant is None and residual is None:
        return routing.route(name, t, group, op), None, t
    route, spec = _quant_route(name, t, group, op, _quant(name, t, op, quant, residual))
    if spec is None and residual is not None:
        out = t if name == "all_reduce" else torch.empty_like(t)
        t = quantized.fold_residual(t, residual, out)
    return route, spec, t


def _quant_handle(result, pending, async_op):
    """The result of a quantized call whose bytes may still be in flight (``pending``)."""
    if pending is None:
        return done(result, async_op)
    if async_op:
        return Handle(result, pending)
    pending.wait()
    return result


def done(result, async_op):
    """``result``, or with ``async_op`` a finished ``Handle`` of it."""
    return Handle(result) if async_op else result


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors on one device share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.device == b.device and a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _through_contiguous(t: torch.Tensor, call, async_op: bool):
    """Run ``call`` (an in-place collective) on a contiguous copy of ``t`` and copy the result
    back: at once for synchronous engines, in ``wait()`` for asynchronous ones."""
    c = t.contiguous()
    inner = call(c)
    if async_op and inner._work is not None:
        return Handle(t, inner._work, lambda: t.copy_(c))
    t.copy_(c)
    return done(t, async_op)


def all_reduce(t: torch.Tensor, group=None, op="sum", async_op: bool = False, *, quant=None,
               residual: torch.Tensor | None = None):
    """In place: ``t = op over the group's ranks of t``. Returns ``t`` (or a ``Handle``).

    On the shm and CUDA IPC engines a whole ``symmetric_empty`` tensor of this group (on shm
    also a registered part of one, ``symmetric.register_parts``) is reduced where it lies (no
    copy in or out; bitwise the copying path's result). ``quant``,
    ``residual``: see the module docstring (quantized calls complete before they return)."""
    if functional.compiling():  # traced by torch.compile: torch's functional collective
        functional.traceable("all_reduce", async_op, quant, residual)
        return t.copy_(functional.all_reduce(t, group, op_name(op)))
    if is_avg(op):  # the sum, divided by the group's size
        return _averaged(all_reduce(t, group, "sum", async_op, quant=quant, residual=residual),
                         t, group)
    route, spec, _ = _routed("all_reduce", t, group, op, quant, residual)
    op = route.op
    if route.adapter.local:
        return done(t, async_op)
    if spec is not None:
        c = t.contiguous()
        route.adapter.quantized_all_reduce(route, c, spec, residual)
        if c is not t:
            t.copy_(c)
        return done(t, async_op)
    if not t.is_contiguous():  # every engine wants contiguous memory (NCCL, ours); gloo copies
        return _through_contiguous(t, lambda c: all_reduce(c, group, op, True), async_op)
    work = route.adapter.all_reduce(route, t, op, async_op)
    return Handle(t, work) if work is not None else done(t, async_op)


def all_gather(t: torch.Tensor, group=None, dim: int = 0, async_op: bool = False, *,
               out: torch.Tensor | None = None, quant=None):
    """The concatenation along ``dim`` of ``t`` from every rank of the group, in group order.

    A 0-dim tensor is gathered into shape ``(n,)`` for a group of ``n`` ranks (``(1,)`` alone,
    a view). ``out`` (``dim=0`` only): a contiguous ``(n * t.shape[0], ...)`` tensor to gather
    into, returned; ``t`` may already be this rank's block of it (then nothing is copied in).
    When ``out`` is symmetric memory of this group on the shm engine (``comm.symmetric_empty``,
    or a registered part of one), every rank copies its peers' blocks straight from their
    buffers (no staging copy); so it does when ``t`` is (and ``out`` a plain tensor: ZeRO-3
    gathers its parameters from the peers' master shards that way). ``quant``: see
    the module docstring; every rank's block, this rank's too, is what its int8 says."""
    check_tensor("all_gather", t)  # arguments are checked before any communication
    if t.dim() == 0:
        t = t.reshape(1)  # a view; gathered along dim 0 into (n,)
    dim = _check_dim("all_gather", t, dim)
    if functional.compiling():
        functional.traceable("all_gather", async_op, quant)
        y = functional.all_gather(t, group, dim)
        return y if out is None else out.copy_(y)
    spec = _quant("all_gather", t, None, quant) if quant is not None else None
    route = routing.route("all_gather", t, group) if spec is None else None
    if route is None:
        route, spec = _quant_route("all_gather", t, group, None, spec)
    if out is not None:
        return _all_gather_into(t, out, dim, route, async_op, spec)
    if route.adapter.local:
        return done(t, async_op)
    if spec is not None:
        n = len(route.ranks)
        stacked = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        pending = route.adapter.quantized_all_gather(route, t.contiguous(), stacked, spec,
                                                     async_op)
        if dim == 0:
            return _quant_handle(stacked, pending, async_op)
        if pending is not None:
            pending.wait()
        return done(torch.cat(stacked.chunk(n, dim=0), dim=dim), async_op)
    n = len(route.ranks)
    inp = t.contiguous()
    stacked = torch.empty((n * inp.shape[0], *inp.shape[1:]), dtype=t.dtype, device=t.device)
    work = route.adapter.all_gather(route, inp, stacked, async_op)

    if dim == 0:
        return Handle(stacked, work) if async_op else stacked
    # (n * d0, ...) -> n pieces of t's shape, joined along dim.
    if work is None:
        return done(torch.cat(stacked.chunk(n, dim=0), dim=dim), async_op)
    shape = list(inp.shape)
    shape[dim] *= n
    result = torch.empty(shape, dtype=t.dtype, device=t.device)
    return Handle(result, work, lambda: torch.cat(stacked.chunk(n, dim=0), dim=dim, out=result))



def _all_gather_into(t: torch.Tensor, out: torch.Tensor, dim: int, route, async_op: bool,
                     spec=None):
    """``all_gather(t, out=out)``: this rank's block of ``out`` holds ``t``, then the others."""
    n = len(route.ranks)
    want = (n * t.shape[0], *t.shape[1:])
    if dim != 0 or tuple(out.shape) != want or out.dtype != t.dtype or \
            out.device != t.device or not out.is_contiguous():
        raise ValueError(
            f"all_gather: out must be a contiguous {t.dtype} tensor of shape {want} on "
            f"{t.device} and dim 0 (the concatenation of {n} ranks' {tuple(t.shape)}); got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}, contiguous={out.is_contiguous()}, "
            f"dim {dim}")
    if spec is not None and not route.adapter.local:  # t is read before out is written
        pending = route.adapter.quantized_all_gather(route, t.contiguous(), out, spec, async_op)
        return _quant_handle(out, pending, async_op)
    me = route.ranks.index(current().topo.rank)
    block = out.narrow(0, me * t.shape[0], t.shape[0])
    if block.data_ptr() != t.data_ptr() or block.stride() != t.stride():
        if t.is_contiguous() and not overlaps(t, out) and \
                route.adapter.gather_from(route, t, out):
            return done(out, async_op)  # t in symmetric memory: read where it lies
        block.copy_(t)
    work = None if route.adapter.local else \
        route.adapter.all_gather_into(route, block, out, async_op)
    return Handle(out, work) if async_op and work is not None else done(out, async_op)


def reduce_scatter(t: torch.Tensor, group=None, dim: int = 0, op="sum",
                   async_op: bool = False, *, out: torch.Tensor | None = None, quant=None,
                   residual: torch.Tensor | None = None):
    """This rank's shard along ``dim`` of ``op`` over the group of ``t``.

    On the shm engine a whole ``symmetric_empty`` tensor of this group, or a registered part
    of one (``dim=0``), is reduced where it lies: no copy in. ``out`` (``dim=0`` only): a contiguous ``(t.shape[0] / n, ...)``
    tensor of ``t``'s dtype and device to write the shard into, returned (a view of a larger
    buffer is fine: ZeRO-2/3 reduce straight into their gradient shard). ``quant``,
    ``residual``: see the module docstring."""
    check_tensor("reduce_scatter", t)  # arguments are checked before any communication
    if t.dim() == 0:
        raise ValueError("reduce_scatter needs a tensor with at least one dim to split, got a "
                         "0-dim tensor")
    dim = _check_dim("reduce_scatter", t, dim)
    if functional.compiling():
        functional.traceable("reduce_scatter", async_op, quant, residual)
        y = functional.reduce_scatter(t, group, dim, op_name(op))
        return y if out is None else out.copy_(y)
    if is_avg(op):
        got = reduce_scatter(t, group, dim, "sum", async_op, out=out, quant=quant,
                             residual=residual)
        return _averaged(got, got.result if isinstance(got, Handle) else got, group)
    route, spec, t = _routed("reduce_scatter", t, group, op, quant, residual)
    op = route.op
    n = len(route.ranks)
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by "
                         f"the group size {n}")
    want = (t.shape[dim] // n, *t.movedim(dim, 0).shape[1:])
    if out is not None and (dim != 0 or tuple(out.shape) != want or out.dtype != t.dtype or
                            out.device != t.device or not out.is_contiguous()):
        raise ValueError(
            f"reduce_scatter: out must be a contiguous {t.dtype} tensor of shape {want} on "
            f"{t.device} and dim 0 (this rank's shard of {tuple(t.shape)} over {n} ranks); got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}, contiguous={out.is_contiguous()}, "
            f"dim {dim}")
    if route.adapter.local:
        return done(t if out is None else out.copy_(t), async_op)
    # Move dim to the front so that each rank's shard is one contiguous block.
    inp = t.movedim(dim, 0).contiguous()
    if out is None:
        out = torch.empty(want, dtype=t.dtype, device=t.device)
    if spec is not None:
        res = residual
        if res is not None and dim != 0:
            res = residual.movedim(dim, 0).contiguous()
        pending = route.adapter.quantized_reduce_scatter(route, inp, out, spec, res, async_op)
        if res is not residual:  # dim != 0: the carried error back in the input's layout
            if pending is not None:
                pending.wait()
                pending = None
            residual.copy_(res.movedim(0, dim))
        return _quant_handle(out.movedim(0, dim), pending, async_op)
    work = route.adapter.reduce_scatter(route, inp, out, op, async_op)
    result = out.movedim(0, dim)  # a view: filled when out is
    return Handle(result, work) if async_op else result


def broadcast(t: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """In place: ``t`` of global rank ``src`` on every rank of the group. Returns ``t``."""
    if functional.compiling():
        functional.traceable("broadcast", async_op)
        return t.copy_(functional.broadcast(t, src, group))
    route = routing.route("broadcast", t, group)
    ranks = route.ranks
    if src not in ranks:
        raise ValueError(f"broadcast: src rank {src} is not in the group {ranks}")
    if route.adapter.local:
        return done(t, async_op)
    if not t.is_contiguous():
        return _through_contiguous(t, lambda c: broadcast(c, src, group, True), async_op)
    work = route.adapter.broadcast(route, t, src, async_op)
    return Handle(t, work) if work is not None else done(t, async_op)

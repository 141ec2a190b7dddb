"""ZeRO-3 parameters: 1/dp shards that are all-gathered around each module's forward and
backward, the next module's gather prefetched (unless ``prefetch=False``), and freed after use.

Units are modules: the root and every ``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict``
are opened, any other module is one unit (a GPT block, an embedding, a ``Linear``); what the root
or a container holds itself is a unit of its own. A unit's trainable parameters are one or more
runs of the flat order (``fastpar.optim.zero_shards``). Each run owns a ``(dp * piece,)``
buffer whose storage is released (``untyped_storage().resize_(0)``) when the run is freed and
re-allocated when it is gathered. A gathered parameter is a view of its run's buffer; a released one is a
NaN of its shape that takes no memory (one element expanded), so reading it outside its
module's forward/backward and outside ``gathered()`` gives NaN rather than reading freed
memory, writing it raises, and ``state_dict()`` / ``load_state_dict()`` of a module holding
released parameters raise naming ``gathered()``. Releasing the buffer's storage, not only
swapping ``.data``, keeps every tensor autograd saved from a parameter (``weight.t()`` in a
linear) a view of memory that the backward's gather fills again::

    forward pre-hook of unit u:   wait u's gather (prefetched) or gather now;
                                  launch the gather of unit u + 1 (forward order; not with
                                  prefetch=False, which holds one unit fewer)
    forward hook of unit u:       hook u's outputs (backward pre-hook); free u
    backward pre-hook of unit u:  wait or gather u; launch the gather of unit u - 1 (not with
                                  prefetch=False)
    post-accumulate-grad hooks:   once every parameter of u has its gradient, free u

Prefetching stays inside a unit's container (``module_units``): a pipeline's chunk does not
prefetch the next chunk's first unit, which runs at another point of the schedule.
``keep_gathered``: a unit gathered for a training forward or backward is not freed after it but
at the step's reduction (``DistributedOptimizer.reduce`` frees every unit): one all-gather per
unit per step instead of two per microbatch, the stage's whole parameters held meanwhile
(FSDP2's ``reshard_after_forward=False``, kept across the microbatches too).
``held`` / ``peak_held``: the bytes of gather buffers allocated now and at most since
``begin_peaks()`` (the trainer's memory records take the peak of every step).

``gathered()`` pins every unit full for its duration (checkpoints, and ``fastpar.train``'s
pipeline steps when it gathers once per step; see ``docs/design.md``, ZeRO and pipelines).
Recomputation (``nn.recompute``) inside a unit re-runs its forward hooks in backward: only
under ``gathered()``.

Where the dp group's collectives go to shm, a float32 (or float64) model's master shards are
symmetric memory (``DistributedOptimizer`` makes them so; ``FlatGroup.master_symmetric``), and
each gather copies every rank's piece straight out of its master into the plain gather buffer:
one read and one write per byte, no staging copy. The gather buffers themselves stay ordinary
memory: a symmetric segment's pages given back (``MADV_REMOVE``) and faulted in again at every
gather cost more than the copies saved (2 ranks, an 8 MiB run: 8.9 ms a gather against 1.4 ms
with the pages kept and 1.9 ms for the copying kernel into reused heap memory), and kept they
would hold the whole model. A bfloat16 model casts its float32 master piece into the buffer and
gathers through the copying kernel.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.data_parallel.reducer import tensors_in

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def module_units(root: nn.Module) -> list[tuple[nn.Module, list, int]]:
    """``[(module, its trainable parameters not in an earlier unit, its container)]`` in
    registration order (the forward order of a sequential model); units without parameters
    are left out. The container is an id shared by the units of one ``nn.Sequential`` (or
    other container, or the root): prefetching stays inside it (a pipeline's chunk is one, and
    the next chunk does not run next)."""
    units, seen = [], set()

    def take(m, recurse, parent):
        ps = [p for p in m.parameters(recurse=recurse) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            units.append((m, ps, parent))

    def walk(m, is_root, parent):
        if is_root or isinstance(m, CONTAINERS):
            take(m, recurse=False, parent=id(m))
            for child in m.children():
                walk(child, False, id(m))
        else:
            take(m, recurse=True, parent=parent)

    walk(root, True, id(root))
    return units


class ShardedParams:
    """Owns the gather buffers of every run and the module hooks of ZeRO-3."""

    def __init__(self, flat, group, dp_rank: int, root: nn.Module, units, quant=None,
                 prefetch: bool = True, keep_gathered: bool = False):
        self.group, self.dp_rank, self.quant, self.prefetch = group, dp_rank, quant, prefetch
        # keep_gathered: a unit gathered in a training forward or backward stays gathered until
        # the step's reduction frees every unit (DistributedOptimizer.reduce): one all-gather
        # per unit per step across the microbatches, the whole stage held meanwhile
        self.keep_gathered = keep_gathered
        self.held = self.peak_held = 0  # bytes of gather buffers allocated now / at most
        self.runs = {}  # (id(f), run.index) -> [f, run, buffer, handle or None, gathered]
        self._nan = {}  # (dtype, device) -> one NaN element: what a released parameter shows
        with torch.no_grad():
            for f in flat:
                for run in f.runs:
                    buf = torch.zeros(run.piece * f.dp_size, dtype=f.dtype, device=f.device)
                    for i in range(run.first, run.last):
                        f.params[i].data = f.run_view(buf, i)  # views from now on
                    self.runs[(id(f), run.index)] = [f, run, buf, None, True]
        where = {id(p): (id(f), f.run_of[i].index) for f in flat for i, p in enumerate(f.params)}
        self.units = [(m, sorted({where[id(p)] for p in ps})) for m, ps, _ in units]
        self.container = [parent for _, _, parent in units]  # prefetch stays inside one
        self.pinned = 0
        self._hooks = []
        for u, (m, keys) in enumerate(self.units):
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward(u)))
            self._hooks.append(m.register_forward_hook(self._post_forward(u)))
            self._hooks.append(m.register_state_dict_pre_hook(self._refuse_released(u, True)))
            self._hooks.append(m.register_load_state_dict_pre_hook(self._refuse_released(u)))
            for key in keys:
                f, run = self.runs[key][:2]
                for i in range(run.first, run.last):
                    self._hooks.append(f.params[i].register_post_accumulate_grad_hook(
                        self._grad_ready(u)))
        self._left = [0] * len(self.units)  # parameters still without gradient, this backward
        self.held = sum(entry[2].untyped_storage().nbytes() for entry in self.runs.values())
        self.free_all()
        self.peak_held = 0

    # ---- one run -----------------------------------------------------------------------------

    def _launch(self, key) -> None:
        """Start the all-gather of a run into its buffer (nothing if gathered or in flight)."""
        entry = self.runs[key]
        f, run, buf, handle, gathered = entry
        if gathered or handle is not None:
            return
        nbytes = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() == 0:
            self.held += nbytes
            self.peak_held = max(self.peak_held, self.held)
        buf.untyped_storage().resize_(nbytes)
        for i in range(run.first, run.last):
            f.params[i].data = f.run_view(buf, i)  # read only after _wait
        piece = f.master.detach()[run.soff:run.soff + run.piece]
        if f.master_symmetric:  # every rank reads every master piece where it lies
            entry[3] = comm.all_gather(piece, group=self.group, async_op=True, out=buf)
            return
        mine = buf[self.dp_rank * run.piece:(self.dp_rank + 1) * run.piece]
        with torch.no_grad():
            mine.copy_(piece)  # cast if bf16
        quant = self.quant if buf.dtype in quant_codec.DTYPES else None  # float64: as it is
        entry[3] = comm.all_gather(mine, group=self.group, async_op=True, out=buf, quant=quant)

    def _wait(self, key) -> None:
        entry = self.runs[key]
        if entry[4]:
            return
        if entry[3] is None:
            self._launch(key)
        entry[3].wait()
        entry[3], entry[4] = None, True

    def _free(self, key) -> None:
        entry = self.runs[key]
        if entry[3] is not None:  # a prefetch that was not used: complete it first
            entry[3].wait()
            entry[3] = None
        entry[4] = False
        f, run, buf = entry[:3]
        nan = self._nan.get((buf.dtype, buf.device))
        if nan is None:
            nan = self._nan[(buf.dtype, buf.device)] = torch.full((1,), float("nan"),
                                                                  dtype=buf.dtype, device=buf.device)
        for i in range(run.first, run.last):
            f.params[i].data = nan.expand(f.params[i].shape)
        self.held -= buf.untyped_storage().nbytes()
        buf.untyped_storage().resize_(0)

    # ---- units ---------------------------------------------------------------------------------

    def gather_unit(self, u: int, prefetch: int | None = None) -> None:
        """Gather unit ``u`` (wait for it) and launch the gather of unit ``prefetch`` (when the
        optimizer prefetches)."""
        for key in self.units[u][1]:
            self._launch(key)
        if self.prefetch and prefetch is not None and 0 <= prefetch < len(self.units) and \
                self.container[prefetch] == self.container[u]:
            for key in self.units[prefetch][1]:  # overlaps the compute of unit u
                self._launch(key)
        for key in self.units[u][1]:
            self._wait(key)

    def free_unit(self, u: int, training: bool = False) -> None:
        """Free unit ``u``'s gathered parameters (not while pinned, nor after a training pass
        while the units are kept gathered)."""
        if not self.pinned and not (training and self.keep_gathered):
            for key in self.units[u][1]:
                self._free(key)

    def free_all(self) -> None:
        for key in self.runs:
            self._free(key)

    def begin_peaks(self) -> None:
        """``peak_held`` from now (the trainer's memory meter: one step at a time)."""
        self.peak_held = self.held

    def refresh(self) -> None:
        """After the masters changed: gathered runs are gathered again."""
        for key, entry in self.runs.items():
            if entry[4]:
                entry[4] = False
                self._launch(key)
                self._wait(key)

    @contextlib.contextmanager
    def gathered(self):
        """Every unit's full parameters for the duration (collective: all-gathers every run)."""
        if self.pinned == 0:
            for key in self.runs:
                self._launch(key)
            for key in self.runs:
                self._wait(key)
        self.pinned += 1
        try:
            yield
        finally:
            self.pinned -= 1
            if self.pinned == 0:
                self.free_all()

    # ---- hooks ---------------------------------------------------------------------------------

    def _pre_forward(self, u: int):
        def hook(module, args):
            if not self.pinned:
                self.gather_unit(u, prefetch=u + 1)
        return hook

    def _post_forward(self, u: int):
        def hook(module, args, output):
            if self.pinned:
                return None
            if torch.is_grad_enabled():
                state = {"done": False}

                def pre_backward(grad):
                    if not state["done"] and not self.pinned:
                        state["done"] = True
                        # counted per backward, not per forward: a pipeline runs several
                        # forwards of a unit before their backwards
                        self._left[u] = sum(self.runs[k][1].last - self.runs[k][1].first
                                            for k in self.units[u][1])
                        self.gather_unit(u, prefetch=u - 1)
                    return grad
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
            self.free_unit(u, training=torch.is_grad_enabled())
            return None
        return hook

    def _refuse_released(self, u: int, saving: bool = False):
        def hook(module, *args):
            if saving and args[1]:  # state_dict(keep_vars=True): the Parameters, no values
                return
            if not self.pinned and not all(self.runs[k][4] for k in self.units[u][1]):
                raise RuntimeError(
                    f"ZeRO-3: the parameters of {type(module).__name__} are released (each rank "
                    "holds 1/dp of them); state_dict() and load_state_dict() need them "
                    "gathered: call them inside `with opt.gathered():` (load_state_dict there "
                    "changes only the gathered copies: load masters with "
                    "opt.load_master_weights or a checkpoint)")
        return hook

    def _grad_ready(self, u: int):
        def hook(p):
            if self.pinned:
                return
            self._left[u] -= 1
            if self._left[u] == 0:
                self.free_unit(u, training=True)
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
